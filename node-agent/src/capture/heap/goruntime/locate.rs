//! Where the runtime's heap profile globals are in a Go binary without a symbol table
//! (`-ldflags=-s`), from the code that uses them: the runtime's functions are found by name
//! in Go's own function table ([`crate::gopclntab`], which stripped binaries keep), decoded
//! with iced-x86, and the RIP-relative operands that only those globals can be are read off:
//!
//! - `runtime.schedinit` does `if disableMemoryProfiling { MemProfileRate = 0 }`: a byte
//!   compared with 0, then a quadword stored as 0 a few instructions later;
//! - `runtime.memProfileInternal` (what `runtime.MemProfile` and `runtime/pprof` call) loads
//!   `mProfCycle` (the only 32-bit global it loads) and `mbuckets` (the only 64-bit one);
//!   `runtime.mProf_Flush` loads the same `mProfCycle`, `runtime.mProf_FlushLocked` the
//!   same `mbuckets`, and `runtime.stkbucket` takes the address of `mbuckets`: each of
//!   these present must agree.
//!
//! The same shapes hold from Go 1.23 to 1.26 (checked against the symbol tables of each by
//! the tests). What is found is then checked against the binary's data: every global in
//! writable data, `MemProfileRate` initialized to its default (524288, `512 * 1024` in
//! `runtime/mprof.go`; a program changes it only at run time), `disableMemoryProfiling`
//! 0 or 1. The values read from the process are checked again by the caller (the rate and
//! the flag, and the bucket walk's own validation).
//!
//! Bounded: a function's code read is capped ([`MAX_FUNCTION_BYTES`]), decoding stops at
//! its end or at the first invalid instruction.

use std::collections::BTreeSet;

use iced_x86::{Decoder, DecoderOptions, Instruction, MemorySize, Mnemonic, OpKind, Register};
use object::{Object as _, ObjectSection as _, SectionFlags};

use super::binary::GoSymbols;
use crate::gopclntab::GoTable;

/// Most bytes of one function decoded (the runtime functions read are a few KiB).
pub const MAX_FUNCTION_BYTES: u64 = 64 << 10;
/// `runtime.MemProfileRate`'s initial value (`512 * 1024`).
pub const DEFAULT_MEM_PROFILE_RATE: u64 = 512 * 1024;

/// The instructions of runtime function `name`, or `None` when the binary has none of that
/// name (the linker drops what nothing calls).
fn instructions<'data, R: object::ReadRef<'data>>(
    obj: &object::File<'data, R>,
    table: &GoTable,
    name: &str,
) -> Result<Option<Vec<Instruction>>, String> {
    let Some(f) = table.func_named(name) else {
        return Ok(None);
    };
    let len = (f.end - f.entry).min(MAX_FUNCTION_BYTES);
    let text = obj
        .sections()
        .find(|s| f.entry >= s.address() && f.entry - s.address() < s.size())
        .ok_or_else(|| format!("{name} at {:#x} is in no section", f.entry))?;
    let code = text
        .data_range(f.entry, len)
        .map_err(|e| format!("reading the code of {name}: {e}"))?
        .ok_or_else(|| format!("the code of {name} is not in the file"))?;
    let mut decoder = Decoder::with_ip(64, code, f.entry, DecoderOptions::NONE);
    let mut out = Vec::new();
    let mut instr = Instruction::default();
    while decoder.can_decode() {
        decoder.decode_out(&mut instr);
        if instr.is_invalid() {
            break;
        }
        out.push(instr);
    }
    Ok(Some(out))
}

/// The RIP-relative target of `i`'s operand `op` when it is a memory operand.
fn rip_target(i: &Instruction, op: u32) -> Option<u64> {
    (i.op_kind(op) == OpKind::Memory && i.is_ip_rel_memory_operand())
        .then(|| i.ip_rel_memory_address())
}

/// The width of general-purpose register `r` in bits (iced-x86 orders them EAX..R15D,
/// RAX..R15; its own `size()` needs the instruction-info tables, not built here).
fn gpr_bits(r: Register) -> usize {
    let r = r as u32;
    if (Register::EAX as u32..=Register::R15D as u32).contains(&r) {
        32
    } else if (Register::RAX as u32..=Register::R15 as u32).contains(&r) {
        64
    } else {
        0
    }
}

/// Targets of `mov reg, [rip+X]` loads of `bits`-bit registers.
fn loads(code: &[Instruction], bits: usize) -> BTreeSet<u64> {
    code.iter()
        .filter(|i| {
            i.mnemonic() == Mnemonic::Mov
                && i.op0_kind() == OpKind::Register
                && gpr_bits(i.op0_register()) == bits
        })
        .filter_map(|i| rip_target(i, 1))
        .collect()
}

/// Targets of `lea reg, [rip+X]`.
fn addresses_taken(code: &[Instruction]) -> BTreeSet<u64> {
    code.iter()
        .filter(|i| i.mnemonic() == Mnemonic::Lea)
        .filter_map(|i| rip_target(i, 1))
        .collect()
}

fn is_zero_immediate(i: &Instruction, op: u32) -> bool {
    matches!(
        i.op_kind(op),
        OpKind::Immediate8
            | OpKind::Immediate8to32
            | OpKind::Immediate8to64
            | OpKind::Immediate32
            | OpKind::Immediate32to64
    ) && i.immediate(op) == 0
}

/// `(disableMemoryProfiling, MemProfileRate)` from `schedinit`: `cmp byte [rip+A], 0`, then
/// within four instructions `mov qword [rip+B], 0`.
fn rate_and_flag(code: &[Instruction]) -> BTreeSet<(u64, u64)> {
    let mut found = BTreeSet::new();
    for (n, cmp) in code.iter().enumerate() {
        let Some(flag) = rip_target(cmp, 0) else {
            continue;
        };
        if cmp.mnemonic() != Mnemonic::Cmp
            || cmp.memory_size() != MemorySize::UInt8
            || !is_zero_immediate(cmp, 1)
        {
            continue;
        }
        for store in code.iter().skip(n + 1).take(4) {
            if store.mnemonic() == Mnemonic::Mov
                && matches!(store.memory_size(), MemorySize::UInt64 | MemorySize::Int64)
                && is_zero_immediate(store, 1)
                && let Some(rate) = rip_target(store, 0)
            {
                found.insert((flag, rate));
            }
        }
    }
    found
}

/// The one element of `set`, or why not.
fn one(set: &BTreeSet<u64>, what: &str, func: &str) -> Result<u64, String> {
    match set.iter().collect::<Vec<_>>().as_slice() {
        [one] => Ok(**one),
        [] => Err(format!("no candidate for {what} in {func}")),
        many => Err(format!(
            "{} candidates for {what} in {func}, expected one",
            many.len()
        )),
    }
}

/// The runtime's heap profile globals of a Go binary without a symbol table, at their
/// link-time addresses. `mbuckets` and `mprof_cycle` are 0 when the binary has no
/// `runtime.memProfileInternal`: nothing in it can read a heap profile, so the linker
/// disabled memory profiling (which `MemProfileRate` = 0 at run time then says).
pub fn locate<'data, R: object::ReadRef<'data>>(
    obj: &object::File<'data, R>,
    table: &GoTable,
) -> Result<GoSymbols, String> {
    let schedinit = instructions(obj, table, "runtime.schedinit")?
        .ok_or("no runtime.schedinit in Go's function table")?;
    let pairs = rate_and_flag(&schedinit);
    let (disable_memory_profiling, mem_profile_rate) = match pairs.iter().collect::<Vec<_>>()[..] {
        [&pair] => pair,
        _ => {
            return Err(format!(
                "expected one `if disableMemoryProfiling {{ MemProfileRate = 0 }}` in \
                 runtime.schedinit, found {}",
                pairs.len()
            ));
        }
    };
    let data = WritableData::of(obj);
    data.check_initial(
        mem_profile_rate,
        8,
        &[DEFAULT_MEM_PROFILE_RATE],
        "MemProfileRate",
    )?;
    data.check_initial(
        disable_memory_profiling,
        1,
        &[0, 1],
        "disableMemoryProfiling",
    )?;
    let (mut mbuckets, mut mprof_cycle) = (0, 0);
    if let Some(code) = instructions(obj, table, "runtime.memProfileInternal")? {
        let func = "runtime.memProfileInternal";
        mprof_cycle = one(
            &loads(&code, 32),
            "runtime.mProfCycle (a 32-bit load)",
            func,
        )?;
        mbuckets = one(&loads(&code, 64), "runtime.mbuckets (a 64-bit load)", func)?;
        let mut agreed = (0, 0);
        for (name, cycle, buckets) in [
            ("runtime.mProf_Flush", true, false),
            ("runtime.mProf_FlushLocked", false, true),
            ("runtime.stkbucket", false, true),
        ] {
            let Some(code) = instructions(obj, table, name)? else {
                continue;
            };
            let refs: BTreeSet<u64> = loads(&code, 32)
                .into_iter()
                .chain(loads(&code, 64))
                .chain(addresses_taken(&code))
                .collect();
            if cycle {
                if !refs.contains(&mprof_cycle) {
                    return Err(format!(
                        "{name} does not use the runtime.mProfCycle found in {func} \
                         ({mprof_cycle:#x})"
                    ));
                }
                agreed.0 += 1;
            }
            if buckets {
                if !refs.contains(&mbuckets) {
                    return Err(format!(
                        "{name} does not use the runtime.mbuckets found in {func} \
                         ({mbuckets:#x})"
                    ));
                }
                agreed.1 += 1;
            }
        }
        if agreed.0 == 0 || agreed.1 == 0 {
            return Err(format!(
                "the runtime.mProfCycle and runtime.mbuckets found in {func} are not used by \
                 the functions that should use them too (mProf_Flush, mProf_FlushLocked, \
                 stkbucket)"
            ));
        }
        data.check_initial(mprof_cycle, 4, &[], "mProfCycle")?;
        data.check_initial(mbuckets, 8, &[], "mbuckets")?;
    }
    Ok(GoSymbols {
        mbuckets,
        mem_profile_rate,
        disable_memory_profiling,
        mprof_cycle,
    })
}

/// The binary's writable sections, to check what was found.
struct WritableData<'a, 'data, R: object::ReadRef<'data>> {
    sections: Vec<object::Section<'data, 'a, R>>,
}

impl<'a, 'data, R: object::ReadRef<'data>> WritableData<'a, 'data, R> {
    fn of(obj: &'a object::File<'data, R>) -> Self {
        Self {
            sections: obj
                .sections()
                .filter(|s| match s.flags() {
                    SectionFlags::Elf { sh_flags } => {
                        sh_flags & u64::from(object::elf::SHF_WRITE) != 0
                    }
                    _ => false,
                })
                .collect(),
        }
    }

    /// Checks that `size` bytes at `addr` lie in writable data and, where the file holds
    /// their initial value and `allowed` is not empty, that it is one of `allowed`.
    fn check_initial(
        &self,
        addr: u64,
        size: u64,
        allowed: &[u64],
        name: &str,
    ) -> Result<(), String> {
        let s = self
            .sections
            .iter()
            .find(|s| addr >= s.address() && addr.saturating_add(size) <= s.address() + s.size())
            .ok_or_else(|| {
                format!(
                    "runtime.{name} found at {addr:#x}, which is not in the binary's writable data"
                )
            })?;
        if allowed.is_empty() || s.file_range().is_none() {
            return Ok(());
        }
        let bytes =
            s.data_range(addr, size).ok().flatten().ok_or_else(|| {
                format!("runtime.{name} at {addr:#x} cannot be read from the file")
            })?;
        let mut word = [0u8; 8];
        word[..bytes.len().min(8)].copy_from_slice(&bytes[..bytes.len().min(8)]);
        let value = u64::from_le_bytes(word);
        if !allowed.contains(&value) {
            return Err(format!(
                "runtime.{name} found at {addr:#x} starts as {value}, expected one of {allowed:?}"
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(code: &[u8]) -> Vec<Instruction> {
        let mut d = Decoder::with_ip(64, code, 0x1000, DecoderOptions::NONE);
        let mut out = Vec::new();
        while d.can_decode() {
            out.push(d.decode());
        }
        out
    }

    #[test]
    fn finds_the_flag_and_the_rate_in_schedinit_shaped_code() {
        // cmp byte [rip+0x10], 0; jz +11; mov qword [rip+0x20], 0 (Go 1.23's bytes).
        let code = decode(&[
            0x80, 0x3d, 0x10, 0, 0, 0, 0, 0x74, 0x0b, 0x48, 0xc7, 0x05, 0x20, 0, 0, 0, 0, 0, 0, 0,
        ]);
        assert_eq!(
            rate_and_flag(&code).into_iter().collect::<Vec<_>>(),
            [(0x1007 + 0x10, 0x1014 + 0x20)]
        );
        // A store of something else than 0 is not the pattern.
        let code = decode(&[
            0x80, 0x3d, 0x10, 0, 0, 0, 0, 0x74, 0x0b, 0x48, 0xc7, 0x05, 0x20, 0, 0, 0, 1, 0, 0, 0,
        ]);
        assert!(rate_and_flag(&code).is_empty());
    }

    #[test]
    fn loads_are_told_apart_by_width() {
        // mov edx, [rip+0x10]; mov rcx, [rip+0x20]; lea rax, [rip+0x30]
        let code = decode(&[
            0x8b, 0x15, 0x10, 0, 0, 0, 0x48, 0x8b, 0x0d, 0x20, 0, 0, 0, 0x48, 0x8d, 0x05, 0x30, 0,
            0, 0,
        ]);
        assert_eq!(loads(&code, 32).into_iter().collect::<Vec<_>>(), [0x1016]);
        assert_eq!(loads(&code, 64).into_iter().collect::<Vec<_>>(), [0x102d]);
        assert_eq!(
            addresses_taken(&code).into_iter().collect::<Vec<_>>(),
            [0x1044]
        );
        assert!(one(&loads(&code, 16), "x", "f").is_err());
    }
}
