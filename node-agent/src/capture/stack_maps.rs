//! The stack maps both samplers share a layout for: a hash map from a 64-bit hash of a
//! stack's frames to the frames (`ff_store_stack`, bpf/unwind.bpf.h), leaf first, ending
//! at the first 0 or at the map's value size.

use std::collections::HashSet;
use std::hash::{BuildHasher as _, RandomState};
use std::sync::OnceLock;

use libbpf_rs::{MapCore as _, MapFlags, MapHandle};

use crate::bpf::from_bytes;

/// The secret seed of the stack hash (`ff_stack_seed`), random per agent process and
/// the same for every BPF object it loads. Without one, a tenant, whose frames are its
/// own, could build a stack whose key is another tenant's.
pub(crate) fn seed() -> u64 {
    static SEED: OnceLock<u64> = OnceLock::new();
    // RandomState draws its keys from the OS's random source.
    *SEED.get_or_init(|| RandomState::new().hash_one(0x666c_616d_6566_6c74_u64))
}

/// The stack stored under `key`; empty when `key` is 0 (no stack was stored) or the entry
/// is gone.
pub(crate) fn read(map: &MapHandle, key: u64) -> Vec<u64> {
    if key == 0 {
        return Vec::new();
    }
    let Ok(Some(raw)) = map.lookup(&key.to_ne_bytes(), MapFlags::ANY) else {
        return Vec::new();
    };
    raw.chunks_exact(8)
        .filter_map(|c| c.try_into().ok().map(u64::from_ne_bytes))
        .take_while(|&a| a != 0)
        .collect()
}

/// The words of a stack of two-word entries (`py_stacks`: code object, instruction),
/// which ends at the first entry whose first word is 0 (its second may be 0 anywhere).
pub(crate) fn read_pairs(map: &MapHandle, key: u64) -> Vec<u64> {
    if key == 0 {
        return Vec::new();
    }
    let Ok(Some(raw)) = map.lookup(&key.to_ne_bytes(), MapFlags::ANY) else {
        return Vec::new();
    };
    let words: Vec<u64> = raw
        .chunks_exact(8)
        .filter_map(|c| c.try_into().ok().map(u64::from_ne_bytes))
        .collect();
    words
        .chunks_exact(2)
        .take_while(|p| p[0] != 0)
        .flatten()
        .copied()
        .collect()
}

/// Deletes the entries whose key is not in `keep`; returns how many it deleted.
pub(crate) fn delete_keys_not_in(map: &MapHandle, keep: &HashSet<u64>) -> usize {
    let doomed: Vec<Vec<u8>> = map
        .keys()
        .filter(|k| from_bytes::<u64>(k).is_some_and(|key| !keep.contains(&key)))
        .collect();
    doomed.into_iter().filter(|k| map.delete(k).is_ok()).count()
}

/// The Python frames of `tgid`'s `py_stacks` entry `py_stack` (none for 0 or without a
/// Python registry), resolved once per capture through `cache`: the CPU and off-CPU
/// captures both splice them.
pub(crate) fn python_frames(
    python: Option<&std::sync::Arc<crate::python::PythonRegistry>>,
    cache: &mut std::collections::HashMap<(u32, u64), Vec<crate::python::PyFrame>>,
    map: &MapHandle,
    tgid: u32,
    py_stack: u64,
) -> Vec<crate::python::PyFrame> {
    match python {
        Some(py) if py_stack != 0 => cache
            .entry((tgid, py_stack))
            .or_insert_with(|| py.resolve(tgid, &read_pairs(map, py_stack)))
            .clone(),
        _ => Vec::new(),
    }
}
