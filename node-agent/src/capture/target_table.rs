//! The user-space side of a sampler's `targets` map: cgroup ID → index, with
//! reference counts so concurrent captures of the same cgroup share an entry.

use std::collections::{HashMap, HashSet};

use libbpf_rs::{MapCore as _, MapFlags, MapHandle};

use super::{CaptureError, Result};
use crate::bpf::{Pod, as_bytes, from_bytes};

/// Mirror of `struct ff_target`, generic over the skeleton's generated type.
pub(crate) trait TargetValue: Pod {
    /// Builds the value.
    fn new(index: u32, flags: u32) -> Self;
}

impl TargetValue for crate::bpf::cpu_sampler::types::ff_target {
    fn new(index: u32, flags: u32) -> Self {
        Self { index, flags }
    }
}

impl TargetValue for crate::bpf::runqlat::types::ff_target {
    fn new(index: u32, flags: u32) -> Self {
        Self { index, flags }
    }
}

#[derive(Debug)]
struct Entry {
    index: u32,
    flags: u32,
    refs: u32,
}

/// Reference-counted target entries. Indices are never reused while the
/// sampler lives, so counts left in the kernel by a released target can never
/// be mistaken for a new one's.
#[derive(Debug)]
pub(crate) struct TargetTable {
    entries: HashMap<u64, Entry>,
    next_index: u32,
    capacity: u32,
}

impl TargetTable {
    pub(crate) fn new(capacity: u32) -> Self {
        Self {
            entries: HashMap::new(),
            next_index: 1,
            capacity,
        }
    }

    /// Adds (or shares) the entries for `cgroup_ids` and returns their indices.
    /// `merge` combines the flags of an existing entry with the new request,
    /// or refuses the combination. All-or-nothing: on error nothing changed.
    pub(crate) fn acquire<V: TargetValue>(
        &mut self,
        map: &MapHandle,
        cgroup_ids: &[u64],
        flags: u32,
        merge: impl Fn(u32, u32) -> Result<u32>,
    ) -> Result<Vec<u32>> {
        let new = cgroup_ids
            .iter()
            .filter(|id| !self.entries.contains_key(id))
            .count();
        if self.entries.len() + new > self.capacity as usize {
            return Err(CaptureError::TooManyTargets {
                capacity: self.capacity,
                wanted: self.entries.len() + new,
            });
        }
        for id in cgroup_ids {
            if let Some(e) = self.entries.get(id) {
                merge(e.flags, flags)?;
            }
        }
        let mut out = Vec::with_capacity(cgroup_ids.len());
        for &id in cgroup_ids {
            let entry = match self.entries.get_mut(&id) {
                Some(e) => {
                    e.refs += 1;
                    e.flags = merge(e.flags, flags)?;
                    e
                }
                None => {
                    let index = self.next_index;
                    self.next_index += 1;
                    self.entries.entry(id).or_insert(Entry {
                        index,
                        flags,
                        refs: 1,
                    })
                }
            };
            let value = V::new(entry.index, entry.flags);
            map.update(&id.to_ne_bytes(), as_bytes(&value), MapFlags::ANY)
                .map_err(|e| CaptureError::bpf("adding a cgroup to the target map", e))?;
            out.push(entry.index);
        }
        Ok(out)
    }

    /// Drops one reference per cgroup; returns the indices that were removed
    /// from the map (their kernel counts may now be deleted).
    pub(crate) fn release(&mut self, map: &MapHandle, cgroup_ids: &[u64]) -> HashSet<u32> {
        let mut removed = HashSet::new();
        for id in cgroup_ids {
            let Some(e) = self.entries.get_mut(id) else {
                continue;
            };
            e.refs -= 1;
            if e.refs == 0 {
                removed.insert(e.index);
                self.entries.remove(id);
                // Already gone is fine: the entry is not needed any more.
                let _ = map.delete(&id.to_ne_bytes());
            }
        }
        removed
    }

    /// Number of cgroups in the map.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }
}

/// Deletes the entries of a per-target map (key type `K`) whose target index
/// is in `removed`, so released targets leave nothing behind in the kernel.
pub(crate) fn delete_target_entries<K: Pod>(
    map: &MapHandle,
    removed: &HashSet<u32>,
    target_of: impl Fn(&K) -> u32,
) {
    if removed.is_empty() {
        return;
    }
    let doomed: Vec<Vec<u8>> = map
        .keys()
        .filter(|k| from_bytes::<K>(k).is_some_and(|k| removed.contains(&target_of(&k))))
        .collect();
    for k in doomed {
        // Only a stale entry is left if this fails; nothing else depends on it.
        let _ = map.delete(&k);
    }
}
