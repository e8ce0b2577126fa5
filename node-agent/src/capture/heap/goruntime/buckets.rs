//! Walking the Go runtime's memory profile buckets (`runtime.mbuckets`,
//! linked by `allnext`) in a running process, validating as it reads.
//!
//! Why the walk is consistent without stopping the process: buckets are
//! never freed and new ones are only prepended to the list, so the list
//! reachable from the head read at the start is immutable; a bucket's
//! header and stack are written before it is published. The counts that
//! change are the `memRecord`s, and their `active` cycle (the published
//! profile, what `/debug/pprof/heap` serves) changes only when a GC cycle is
//! flushed, which changes `runtime.mProfCycle`. So the walk reads the cycle
//! before and after and starts over when it moved.

use std::collections::HashSet;

use super::layout::Layout;
use super::memory::{MemoryError, ProcessMemory};

/// Memory the buckets of one capture's Go processes may hold in all (see [`HeldBudget`]).
/// A real program's profile is a few thousand buckets of a few dozen frames: well under
/// a MiB.
pub const DEFAULT_HELD_BYTES: u64 = 64 << 20;

/// What the buckets read in one capture may hold, across its processes. Reading is bounded
/// per process (its byte budget, [`WalkLimits::max_buckets`]); keeping must be bounded per
/// capture, since every process's buckets stay until the profile is built, and the list's
/// contents are the workload's: overlapping fake buckets in a few MiB of its memory can
/// each claim a 1,024-frame stack.
#[derive(Debug)]
pub struct HeldBudget {
    limit: u64,
    used: u64,
}

impl HeldBudget {
    /// A budget of `limit` bytes.
    pub fn new(limit: u64) -> Self {
        Self { limit, used: 0 }
    }

    /// Bytes held now.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// The limit.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    fn charge(&mut self, bytes: u64) -> bool {
        if self.used.saturating_add(bytes) > self.limit {
            return false;
        }
        self.used += bytes;
        true
    }

    fn release(&mut self, bytes: u64) {
        self.used = self.used.saturating_sub(bytes);
    }
}

/// Bytes one kept bucket of `nstk` frames holds: the bucket, its stack, and its address
/// in the set that detects a list looping back on itself.
fn held_bytes(nstk: u64) -> u64 {
    (std::mem::size_of::<(Bucket, Cycle)>() as u64) + nstk * 8 + 32
}

/// One `memRecordCycle`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Cycle {
    /// Sampled allocations.
    pub allocs: u64,
    /// Sampled frees.
    pub frees: u64,
    /// Bytes of the sampled allocations.
    pub alloc_bytes: u64,
    /// Bytes of the sampled frees.
    pub free_bytes: u64,
}

impl Cycle {
    fn parse(b: &[u8]) -> Self {
        let w = |i: usize| {
            b.get(i * 8..i * 8 + 8)
                .and_then(|s| s.try_into().ok())
                .map_or(0, u64::from_le_bytes)
        };
        Self {
            allocs: w(0),
            frees: w(1),
            alloc_bytes: w(2),
            free_bytes: w(3),
        }
    }

    fn add(&mut self, o: &Cycle) {
        self.allocs = self.allocs.wrapping_add(o.allocs);
        self.frees = self.frees.wrapping_add(o.frees);
        self.alloc_bytes = self.alloc_bytes.wrapping_add(o.alloc_bytes);
        self.free_bytes = self.free_bytes.wrapping_add(o.free_bytes);
    }

    fn is_zero(&self) -> bool {
        *self == Cycle::default()
    }
}

/// One allocation site: block size, stack (return PCs, leaf first) and the
/// published counts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    /// The size of each allocation of this bucket.
    pub size: u64,
    /// Return PCs, innermost first.
    pub stack: Vec<u64>,
    /// The counts as `runtime.MemProfile` would report them.
    pub record: Cycle,
}

/// Bounds on one walk.
#[derive(Debug, Clone, Copy)]
pub struct WalkLimits {
    /// Most buckets read (the list is corrupt or hostile beyond it).
    pub max_buckets: usize,
    /// Times the walk starts over when a GC cycle completes during it.
    pub attempts: u32,
}

impl Default for WalkLimits {
    fn default() -> Self {
        Self {
            // A real program has a few thousand allocation sites at most.
            max_buckets: 1 << 20,
            attempts: 4,
        }
    }
}

/// Addresses of the globals in the process (load bias applied).
#[derive(Debug, Clone, Copy)]
pub struct Globals {
    /// `runtime.mbuckets`.
    pub mbuckets: u64,
    /// `runtime.mProfCycle`.
    pub mprof_cycle: u64,
}

/// The buckets read and how the read went.
#[derive(Debug, Clone)]
pub struct Walk {
    /// Every memory profile bucket.
    pub buckets: Vec<Bucket>,
    /// The GC profile cycle the counts belong to.
    pub cycle: u32,
    /// Walks started over because a GC cycle completed meanwhile.
    pub restarts: u32,
    /// No GC had published a cycle yet, so every pending cycle was summed
    /// (as `runtime.MemProfile` does then).
    pub summed_pending: bool,
}

/// Why the buckets could not be read.
#[derive(Debug, thiserror::Error)]
pub enum WalkError {
    /// A read failed.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// A value broke an invariant of the runtime's structures.
    #[error("profile bucket at {addr:#x} is not valid: {reason}; nothing was read from it")]
    Invalid {
        /// The bucket.
        addr: u64,
        /// What was expected and found.
        reason: String,
    },
    /// More buckets than the limit.
    #[error("more than {0} profile buckets: the list is corrupt or larger than the agent reads")]
    TooMany(usize),
    /// The list loops.
    #[error(
        "the profile bucket list loops back to {addr:#x} after {after} buckets (a corrupt or \
         hostile list); nothing was read from it"
    )]
    Cycle {
        /// The bucket met twice.
        addr: u64,
        /// Buckets read before.
        after: usize,
    },
    /// The capture's Go processes hold too much already.
    #[error(
        "the heap profiles read in this capture would hold more than {limit} bytes with this \
         process's ({read} buckets read so far): this process's was not kept (its allocation \
         sites are unusually many or deep, or its profile is hostile)"
    )]
    HeldBudget {
        /// The capture's limit.
        limit: u64,
        /// Buckets of this process read when it was reached.
        read: usize,
    },
    /// GC cycles kept completing during the walk.
    #[error(
        "the profile changed during each of {0} reads (a GC cycle completed every time); try \
         again"
    )]
    Unstable(u32),
}

/// Reads every bucket once, consistently with one published GC cycle. What the walk
/// keeps is charged to `held` (and stays charged on success: the buckets are returned).
pub fn walk(
    mem: &mut ProcessMemory,
    layout: &Layout,
    globals: Globals,
    limits: WalkLimits,
    held: &mut HeldBudget,
) -> Result<Walk, WalkError> {
    for attempt in 0..limits.attempts.max(1) {
        let before = mem.u32(globals.mprof_cycle)?;
        let head = mem.u64(globals.mbuckets)?;
        let (mut buckets, charged) = read_list(mem, layout, head, before, limits, held)?;
        let after = match mem.u32(globals.mprof_cycle) {
            Ok(a) => a,
            Err(e) => {
                held.release(charged);
                return Err(e.into());
            }
        };
        if before != after {
            held.release(charged);
            continue;
        }
        let published = buckets.iter().any(|(b, _)| !b.record.is_zero());
        let summed_pending = !published;
        if summed_pending {
            // No GC has published anything yet: like MemProfile, sum every
            // pending cycle so that a program with GC off still shows.
            for (b, all) in &mut buckets {
                b.record = *all;
            }
        }
        return Ok(Walk {
            buckets: buckets.into_iter().map(|(b, _)| b).collect(),
            cycle: before >> 1,
            restarts: attempt,
            summed_pending,
        });
    }
    Err(WalkError::Unstable(limits.attempts.max(1)))
}

/// The list from `head`: each bucket with its published record (plus the
/// cycle awaiting its flush, as MemProfile adds it) and the sum of all its
/// cycles; and the bytes charged to `held` for them (released again on error).
fn read_list(
    mem: &mut ProcessMemory,
    layout: &Layout,
    head: u64,
    cycle_value: u32,
    limits: WalkLimits,
    held: &mut HeldBudget,
) -> Result<(Vec<(Bucket, Cycle)>, u64), WalkError> {
    let mut charged = 0;
    let read = read_list_charging(mem, layout, head, cycle_value, limits, held, &mut charged);
    match read {
        Ok(out) => Ok((out, charged)),
        Err(e) => {
            held.release(charged);
            Err(e)
        }
    }
}

fn read_list_charging(
    mem: &mut ProcessMemory,
    layout: &Layout,
    head: u64,
    cycle_value: u32,
    limits: WalkLimits,
    held: &mut HeldBudget,
    charged: &mut u64,
) -> Result<Vec<(Bucket, Cycle)>, WalkError> {
    let cycle = cycle_value >> 1;
    let flushed = cycle_value & 1 == 1;
    let flush_index = (cycle % layout.future_cycles as u32) as usize;
    let mut out = Vec::new();
    // Buckets are never freed or relinked, so a list that meets an address twice loops.
    let mut seen: HashSet<u64> = HashSet::new();
    let mut addr = head;
    let mut header = vec![0u8; layout.bucket_header as usize];
    while addr != 0 {
        if out.len() >= limits.max_buckets {
            return Err(WalkError::TooMany(limits.max_buckets));
        }
        if !seen.insert(addr) {
            return Err(WalkError::Cycle {
                addr,
                after: out.len(),
            });
        }
        let invalid = |reason: String| WalkError::Invalid { addr, reason };
        if !addr.is_multiple_of(8) {
            return Err(invalid("expected an 8-byte aligned address".into()));
        }
        mem.read(addr, &mut header)?;
        let word = |off: u64| {
            let off = off as usize;
            header
                .get(off..off + 8)
                .and_then(|s| s.try_into().ok())
                .map_or(0, u64::from_le_bytes)
        };
        let (allnext, typ, size, nstk) = (
            word(layout.allnext_offset),
            word(layout.typ_offset),
            word(layout.size_offset),
            word(layout.nstk_offset),
        );
        if typ != layout.mem_profile_type {
            return Err(invalid(format!(
                "expected bucket type {} (memProfile), found {typ}",
                layout.mem_profile_type
            )));
        }
        if nstk > layout.max_stack {
            return Err(invalid(format!(
                "expected at most {} stack entries, found {nstk}",
                layout.max_stack
            )));
        }
        let cost = held_bytes(nstk);
        if !held.charge(cost) {
            return Err(WalkError::HeldBudget {
                limit: held.limit(),
                read: out.len(),
            });
        }
        *charged += cost;
        // The pending cycles are written concurrently (allocs, then bytes),
        // so a read can catch a record between its two updates: read again,
        // a few times, before calling the bucket corrupt.
        let mut tries = 0;
        let (stack, record, all) = loop {
            tries += 1;
            let parsed = read_body(mem, layout, addr, nstk, flushed, flush_index)?;
            match check(&parsed.1, &parsed.2, size) {
                Ok(()) => break parsed,
                Err(reason) if tries >= BODY_READS => match settle(parsed, size) {
                    Some(settled) => break settled,
                    None => return Err(invalid(reason)),
                },
                Err(_) => std::thread::yield_now(),
            }
        };
        out.push((
            Bucket {
                size,
                stack,
                record,
            },
            all,
        ));
        addr = allnext;
    }
    Ok(out)
}

/// Times a bucket's body is read before its records are called inconsistent.
const BODY_READS: u32 = 8;

/// Reads the stack and records of the bucket at `addr`: the stack, the
/// published record (plus the cycle awaiting its flush when `!flushed`) and
/// the sum of every cycle.
fn read_body(
    mem: &mut ProcessMemory,
    layout: &Layout,
    addr: u64,
    nstk: u64,
    flushed: bool,
    flush_index: usize,
) -> Result<(Vec<u64>, Cycle, Cycle), WalkError> {
    let mut body = vec![0u8; (nstk * 8 + layout.record_size()) as usize];
    mem.read(addr + layout.bucket_header, &mut body)?;
    let (stack_bytes, record_bytes) = body.split_at(nstk as usize * 8);
    let stack: Vec<u64> = stack_bytes
        .chunks_exact(8)
        .filter_map(|c| c.try_into().ok().map(u64::from_le_bytes))
        .collect();
    let cycles: Vec<Cycle> = record_bytes
        .chunks_exact(layout.cycle_size as usize)
        .map(Cycle::parse)
        .collect();
    let mut record = cycles.first().copied().unwrap_or_default();
    let mut all = record;
    for c in cycles.iter().skip(1) {
        all.add(c);
    }
    if !flushed && let Some(f) = cycles.get(1 + flush_index) {
        record.add(f);
    }
    Ok((stack, record, all))
}

/// Allocations whose two counter updates a read may catch halfway, at most: one per
/// thread allocating in the bucket at that instant.
const IN_FLIGHT: u64 = 64;

/// A bucket read `BODY_READS` times, each time between the two updates of an allocation
/// (a hot allocation site in a busy program, the reader descheduled in between): its
/// records with the allocations in flight left out (allocations and bytes both counted
/// as of the last allocation whose bytes are in), provided at most `IN_FLIGHT` are in
/// flight and the bytes are whole blocks; `None` otherwise (the bucket is corrupt).
fn settle(
    (stack, mut record, mut all): (Vec<u64>, Cycle, Cycle),
    size: u64,
) -> Option<(Vec<u64>, Cycle, Cycle)> {
    for c in [&mut record, &mut all] {
        if size == 0 || c.alloc_bytes % size != 0 {
            return None;
        }
        let whole = c.alloc_bytes / size;
        if c.allocs.abs_diff(whole) > IN_FLIGHT {
            return None;
        }
        c.allocs = c.allocs.min(whole);
        c.alloc_bytes = c.allocs * size;
    }
    check(&record, &all, size).ok()?;
    Some((stack, record, all))
}

/// The invariants of a bucket's records: no more frees than allocations, and
/// allocated bytes = allocations × the bucket's block size (mProf_Malloc
/// adds the bucket's own size per allocation).
fn check(record: &Cycle, all: &Cycle, size: u64) -> Result<(), String> {
    for (what, c) in [("published", record), ("total", all)] {
        if c.frees > c.allocs {
            return Err(format!(
                "{what} frees ({}) exceed allocations ({})",
                c.frees, c.allocs
            ));
        }
        if c.alloc_bytes != c.allocs.wrapping_mul(size) {
            return Err(format!(
                "{what} allocated bytes ({}) are not allocations ({}) × block size ({size})",
                c.alloc_bytes, c.allocs
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capture::heap::goruntime::layout::layout_for;

    /// A bucket laid out as the runtime does, in this process's memory:
    /// header, stack, active cycle, three future cycles.
    fn bucket(typ: u64, size: u64, stack: &[u64], cycles: [[u64; 4]; 4]) -> Box<[u64]> {
        let mut w = vec![0, 0, typ, 0xabc, size, stack.len() as u64];
        w.extend_from_slice(stack);
        for c in cycles {
            w.extend_from_slice(&c);
        }
        w.into_boxed_slice()
    }

    fn link(buckets: &mut [Box<[u64]>]) -> u64 {
        for i in (0..buckets.len().saturating_sub(1)).rev() {
            let next = buckets[i + 1].as_ptr() as u64;
            buckets[i][1] = next;
        }
        buckets.first().map_or(0, |b| b.as_ptr() as u64)
    }

    fn walk_own(head: u64, cycle_value: u32, max_buckets: usize) -> Result<Walk, WalkError> {
        walk_own_held(
            head,
            cycle_value,
            max_buckets,
            &mut HeldBudget::new(1 << 30),
        )
    }

    fn walk_own_held(
        head: u64,
        cycle_value: u32,
        max_buckets: usize,
        held: &mut HeldBudget,
    ) -> Result<Walk, WalkError> {
        let (_, layout) = layout_for("go1.26.0").unwrap();
        let mbuckets = Box::new(head);
        let cycle = Box::new(cycle_value);
        let mut mem = ProcessMemory::open(std::process::id(), 1 << 20).unwrap();
        walk(
            &mut mem,
            layout,
            Globals {
                mbuckets: &*mbuckets as *const u64 as u64,
                mprof_cycle: &*cycle as *const u32 as u64,
            },
            WalkLimits {
                max_buckets,
                attempts: 2,
            },
            held,
        )
    }

    const NONE: [u64; 4] = [0; 4];

    #[test]
    fn reads_published_records_and_the_cycle_awaiting_its_flush() {
        // Cycle 4 (index 1), not yet flushed: future[1] is added like MemProfile does.
        let mut b = vec![
            bucket(
                1,
                1024,
                &[0x401000, 0x402000],
                [[10, 4, 10240, 4096], NONE, NONE, NONE],
            ),
            bucket(
                1,
                64,
                &[0x403000],
                [NONE, NONE, [3, 1, 192, 64], [7, 0, 448, 0]],
            ),
        ];
        let head = link(&mut b);
        let w = walk_own(head, 4 << 1, 100).unwrap();
        assert_eq!(w.cycle, 4);
        assert!(!w.summed_pending);
        assert_eq!(w.buckets.len(), 2);
        assert_eq!(w.buckets[0].stack, [0x401000, 0x402000]);
        assert_eq!(w.buckets[0].record.allocs, 10);
        assert_eq!(w.buckets[0].record.free_bytes, 4096);
        // future[1] (pending flush) counted, future[2] (still accumulating) not.
        assert_eq!(
            w.buckets[1].record,
            Cycle {
                allocs: 3,
                frees: 1,
                alloc_bytes: 192,
                free_bytes: 64
            }
        );
        // Flushed: only active.
        let w = walk_own(head, 4 << 1 | 1, 100).unwrap();
        assert_eq!(w.buckets[1].record, Cycle::default());
    }

    #[test]
    fn sums_pending_cycles_before_the_first_gc() {
        let mut b = vec![bucket(
            1,
            32,
            &[0x401000],
            [NONE, [1, 0, 32, 0], [2, 1, 64, 32], NONE],
        )];
        let head = link(&mut b);
        let w = walk_own(head, 1, 100).unwrap();
        assert!(w.summed_pending);
        assert_eq!(
            w.buckets[0].record,
            Cycle {
                allocs: 3,
                frees: 1,
                alloc_bytes: 96,
                free_bytes: 32
            }
        );
    }

    #[test]
    fn a_record_caught_between_its_two_updates_counts_the_finished_allocations() {
        // Three allocations counted, the bytes of two: one was in flight at every read.
        let mut b = vec![bucket(1, 64, &[1], [[3, 0, 128, 0], NONE, NONE, NONE])];
        let head = link(&mut b);
        let w = walk_own(head, 3, 100).unwrap();
        assert_eq!(w.buckets[0].record.allocs, 2);
        assert_eq!(w.buckets[0].record.alloc_bytes, 128);
        // Far more than threads could have in flight: corrupt.
        let mut b = vec![bucket(1, 64, &[1], [[300, 0, 128, 0], NONE, NONE, NONE])];
        let head = link(&mut b);
        let e = walk_own(head, 3, 100).unwrap_err().to_string();
        assert!(e.contains("block size"), "{e}");
    }

    #[test]
    fn refuses_what_breaks_the_runtime_invariants() {
        let cases: Vec<(Box<[u64]>, &str)> = vec![
            (
                bucket(2, 64, &[1], [[1, 0, 64, 0], NONE, NONE, NONE]),
                "bucket type",
            ),
            (
                bucket(1, 64, &[1], [[1, 0, 65, 0], NONE, NONE, NONE]),
                "block size",
            ),
            (
                bucket(1, 64, &[1], [[1, 2, 64, 128], NONE, NONE, NONE]),
                "exceed",
            ),
        ];
        for (b, want) in cases {
            let mut b = vec![b];
            let head = link(&mut b);
            let e = walk_own(head, 3, 100).unwrap_err().to_string();
            assert!(e.contains(want), "expected {want:?} in {e}");
        }
        // A stack count beyond maxProfStackDepth, read from the header alone.
        let mut b = vec![bucket(1, 64, &[1], [NONE; 4])];
        b[0][5] = 5000;
        let head = link(&mut b);
        let e = walk_own(head, 3, 100).unwrap_err().to_string();
        assert!(e.contains("at most 1024 stack entries"), "{e}");
        // Misaligned and unmapped heads.
        assert!(
            walk_own(head + 1, 3, 100)
                .unwrap_err()
                .to_string()
                .contains("aligned")
        );
        assert!(matches!(walk_own(8, 3, 100), Err(WalkError::Memory(_))));
        // A list that loops is refused at its first repeat, not read to the bucket cap.
        let mut b = vec![
            bucket(1, 8, &[1], [[1, 0, 8, 0], NONE, NONE, NONE]),
            bucket(1, 8, &[2], [[1, 0, 8, 0], NONE, NONE, NONE]),
        ];
        let head = link(&mut b);
        b[1][1] = head;
        let e = walk_own(head, 3, 1000).unwrap_err();
        assert!(
            matches!(e, WalkError::Cycle { addr, after: 2 } if addr == head),
            "{e}"
        );
    }

    #[test]
    fn what_a_capture_keeps_is_bounded_across_processes() {
        let mut b: Vec<Box<[u64]>> = (0..10)
            .map(|i| bucket(1, 8, &[i; 100], [[1, 0, 8, 0], NONE, NONE, NONE]))
            .collect();
        let head = link(&mut b);
        // Room for one walk of the list, not two.
        let mut held = HeldBudget::new(15 * held_bytes(100));
        let first = walk_own_held(head, 3, 1000, &mut held).unwrap();
        assert_eq!(first.buckets.len(), 10);
        assert_eq!(held.used(), 10 * held_bytes(100));
        let e = walk_own_held(head, 3, 1000, &mut held).unwrap_err();
        assert!(matches!(e, WalkError::HeldBudget { read: 5, .. }), "{e}");
        // The failed walk gave back what it had charged.
        assert_eq!(held.used(), 10 * held_bytes(100));
    }
}
