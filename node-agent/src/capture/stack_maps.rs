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

/// Deletes the entries whose key is not in `keep`; returns how many it deleted.
pub(crate) fn delete_keys_not_in(map: &MapHandle, keep: &HashSet<u64>) -> usize {
    let doomed: Vec<Vec<u8>> = map
        .keys()
        .filter(|k| from_bytes::<u64>(k).is_some_and(|key| !keep.contains(&key)))
        .collect();
    doomed.into_iter().filter(|k| map.delete(k).is_ok()).count()
}
