//! The user-space side of a sampler's `targets` map: cgroup ID → index, with
//! reference counts so concurrent captures of the same cgroup share an entry.
//!
//! The kernel matches a task on its cgroup's ancestry and counts it under the
//! *deepest* target covering it (`bpf/targets.bpf.h`). A capture whose target
//! contains another capture's target therefore also owns that nested entry:
//! the outer entry holds a reference on every entry below it, so the nested
//! entry (and its counts) outlive the inner capture for as long as the outer
//! one needs them, and [`TargetTable::covered`] reports nested indices to the
//! outer capture.
//!
//! Every change of the map bumps the map's generation (`target_generation`),
//! which invalidates the kernel's per-cgroup lookup cache.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use libbpf_rs::{MapCore as _, MapFlags, MapHandle};

use super::{CaptureError, CaptureTarget, Result};
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

impl TargetValue for crate::bpf::offcpu::types::ff_target {
    fn new(index: u32, flags: u32) -> Self {
        Self { index, flags }
    }
}

impl TargetValue for crate::bpf::heap::types::ff_target {
    fn new(index: u32, flags: u32) -> Self {
        Self { index, flags }
    }
}

/// The cgroups one capture puts in the table, each once and in order, and for each the
/// position among the capture's targets of the target it belongs to: what the capture
/// gives back when it ends and what its counts are read under.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct CaptureCgroups {
    ids: Vec<u64>,
    owner_of: Vec<usize>,
}

impl CaptureCgroups {
    /// The cgroups of `targets` (each target's own cgroup, without repeats: the kernel
    /// covers their descendants, live), and the same as the table takes them.
    pub(crate) fn of(targets: &[CaptureTarget]) -> (Self, Vec<TargetCgroup>) {
        let mut cgroups: Vec<TargetCgroup> = Vec::new();
        let mut own = Self::default();
        for (i, t) in targets.iter().enumerate() {
            if !own.ids.contains(&t.cgroup.id) {
                cgroups.push(TargetCgroup {
                    id: t.cgroup.id,
                    path: t.cgroup.path.clone(),
                });
                own.ids.push(t.cgroup.id);
                own.owner_of.push(i);
            }
        }
        (own, cgroups)
    }

    /// The cgroup IDs, to release.
    pub(crate) fn ids(&self) -> &[u64] {
        &self.ids
    }

    /// The indices whose counts belong to the capture ([`TargetTable::covered`]).
    pub(crate) fn covered(&self, table: &TargetTable) -> HashSet<u32> {
        table.covered(&self.ids).into_keys().collect()
    }

    /// [`Self::covered`], each index with the capture's target it counts for (indices
    /// nested below a target, another capture's, count for it too).
    pub(crate) fn owners(&self, table: &TargetTable) -> HashMap<u32, usize> {
        table
            .covered(&self.ids)
            .into_iter()
            .filter_map(|(index, pos)| Some((index, *self.owner_of.get(pos)?)))
            .collect()
    }
}

/// One cgroup a capture targets: its ID (the kernel's key) and directory
/// (to tell which targets contain which).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TargetCgroup {
    pub(crate) id: u64,
    pub(crate) path: PathBuf,
}

#[derive(Debug)]
struct Entry {
    index: u32,
    flags: u32,
    refs: u32,
    path: PathBuf,
    /// Entries below this one, each holding one reference from it.
    holds: Vec<u64>,
}

/// The kernel maps a table writes: the targets and their generation.
#[derive(Debug)]
pub(crate) struct TargetMaps<'a> {
    pub(crate) targets: &'a MapHandle,
    pub(crate) generation: &'a MapHandle,
}

/// Reference-counted target entries. Indices are never reused while the
/// sampler lives, so counts left in the kernel by a released target can never
/// be mistaken for a new one's; [`TargetTable::indices_left`] says when a
/// sampler should be replaced by a fresh one.
#[derive(Debug)]
pub(crate) struct TargetTable {
    entries: HashMap<u64, Entry>,
    next_index: u32,
    capacity: u32,
    max_index: u32,
    generation: u64,
}

fn is_below(path: &Path, ancestor: &Path) -> bool {
    path != ancestor && path.starts_with(ancestor)
}

impl TargetTable {
    /// A table for a map of `capacity` cgroups handing out indices
    /// `1..=max_index`.
    pub(crate) fn new(capacity: u32, max_index: u32) -> Self {
        Self {
            entries: HashMap::new(),
            next_index: 1,
            capacity,
            max_index,
            generation: 0,
        }
    }

    /// Indices still available to new entries.
    pub(crate) fn indices_left(&self) -> u32 {
        (self.max_index + 1).saturating_sub(self.next_index)
    }

    /// Adds (or shares) the entries for `cgroups` and returns their indices.
    /// `merge` combines the flags of an existing entry with the new request,
    /// or refuses the combination. All-or-nothing: on error nothing changed.
    pub(crate) fn acquire<V: TargetValue>(
        &mut self,
        maps: &TargetMaps<'_>,
        cgroups: &[TargetCgroup],
        flags: u32,
        merge: impl Fn(u32, u32) -> Result<u32>,
    ) -> Result<Vec<u32>> {
        let new: HashSet<u64> = cgroups
            .iter()
            .map(|c| c.id)
            .filter(|id| !self.entries.contains_key(id))
            .collect();
        if self.entries.len() + new.len() > self.capacity as usize {
            return Err(CaptureError::TooManyTargets {
                capacity: self.capacity,
                wanted: self.entries.len() + new.len(),
            });
        }
        if new.len() as u64 > u64::from(self.indices_left()) {
            return Err(CaptureError::IndicesExhausted {
                left: self.indices_left(),
                wanted: new.len(),
            });
        }
        for c in cgroups {
            if let Some(e) = self.entries.get(&c.id) {
                merge(e.flags, flags)?;
            }
        }
        let mut out = Vec::with_capacity(cgroups.len());
        let mut acquired = Vec::with_capacity(cgroups.len());
        for c in cgroups {
            let index = match self.entries.get_mut(&c.id) {
                Some(e) => {
                    e.refs += 1;
                    // Checked above: merging cannot fail here.
                    e.flags = merge(e.flags, flags).unwrap_or(e.flags);
                    e.index
                }
                None => self.insert(c, flags),
            };
            acquired.push(c.id);
            out.push(index);
            let Some(e) = self.entries.get(&c.id) else {
                continue;
            };
            let value = V::new(e.index, e.flags);
            if let Err(err) =
                maps.targets
                    .update(&c.id.to_ne_bytes(), as_bytes(&value), MapFlags::ANY)
            {
                self.release(maps, &acquired);
                return Err(CaptureError::bpf("adding a cgroup to the target map", err));
            }
        }
        self.bump(maps);
        Ok(out)
    }

    fn insert(&mut self, c: &TargetCgroup, flags: u32) -> u32 {
        let index = self.next_index;
        self.next_index += 1;
        let mut entry = Entry {
            index,
            flags,
            refs: 1,
            path: c.path.clone(),
            holds: Vec::new(),
        };
        let mut held_by = Vec::new();
        for (&id, e) in &mut self.entries {
            if is_below(&c.path, &e.path) {
                held_by.push(id);
            } else if is_below(&e.path, &c.path) {
                e.refs += 1;
                entry.holds.push(id);
            }
        }
        for id in held_by {
            if let Some(e) = self.entries.get_mut(&id) {
                e.holds.push(c.id);
                entry.refs += 1;
            }
        }
        self.entries.insert(c.id, entry);
        index
    }

    fn bump(&mut self, maps: &TargetMaps<'_>) {
        self.generation += 1;
        // The kernel compares generations for equality only; if this write
        // failed, cached lookups would lag until the next change, so say so.
        if let Err(e) = maps.generation.update(
            &0u32.to_ne_bytes(),
            &self.generation.to_ne_bytes(),
            MapFlags::ANY,
        ) {
            tracing::warn!(error = %e, "bumping the target map generation failed");
        }
    }

    /// Drops one reference per cgroup; returns the indices that were removed
    /// from the map (their kernel counts may now be deleted).
    pub(crate) fn release(&mut self, maps: &TargetMaps<'_>, cgroup_ids: &[u64]) -> HashSet<u32> {
        let mut removed = HashSet::new();
        let mut pending: Vec<u64> = cgroup_ids.to_vec();
        while let Some(id) = pending.pop() {
            let Some(e) = self.entries.get_mut(&id) else {
                continue;
            };
            e.refs -= 1;
            if e.refs == 0 {
                if let Some(e) = self.entries.remove(&id) {
                    removed.insert(e.index);
                    pending.extend(e.holds);
                }
                // Already gone is fine: the entry is not needed any more.
                let _ = maps.targets.delete(&id.to_ne_bytes());
            }
        }
        if !removed.is_empty() {
            self.bump(maps);
        }
        removed
    }

    /// The indices whose counts belong to a capture of `cgroup_ids` (in that
    /// order): each target's own index and those of the entries nested below
    /// it, with the position in `cgroup_ids` of the target they count for.
    pub(crate) fn covered(&self, cgroup_ids: &[u64]) -> HashMap<u32, usize> {
        let mut out = HashMap::new();
        for (pos, id) in cgroup_ids.iter().enumerate() {
            let Some(e) = self.entries.get(id) else {
                continue;
            };
            out.entry(e.index).or_insert(pos);
            for held in &e.holds {
                if let Some(h) = self.entries.get(held) {
                    out.entry(h.index).or_insert(pos);
                }
            }
        }
        out
    }

    /// Number of cgroups in the map.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }
}

/// Deletes the entries of a per-target map (key type `K`) whose target index
/// is in `removed`, so released targets leave nothing behind in the kernel.
/// The entries of `map` (keys `K`, values `V`) whose key belongs to one of the target
/// indices `targets`, keyed by their raw key bytes; `what` names the map in errors.
pub(crate) fn read_target_entries<K: Pod, V: Pod>(
    map: &MapHandle,
    targets: &HashSet<u32>,
    target_of: impl Fn(&K) -> u32,
    what: &str,
) -> Result<HashMap<Vec<u8>, V>> {
    let mut out = HashMap::new();
    for key in map.keys() {
        if !from_bytes::<K>(&key).is_some_and(|k| targets.contains(&target_of(&k))) {
            continue;
        }
        let value = map
            .lookup(&key, MapFlags::ANY)
            .map_err(|e| CaptureError::bpf(format!("reading {what}"), e))?;
        if let Some(v) = value.as_deref().and_then(from_bytes::<V>) {
            out.insert(key, v);
        }
    }
    Ok(out)
}

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
