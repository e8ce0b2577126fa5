//! Generated libbpf-rs skeletons, one module per `bpf/*.bpf.c` (see build.rs),
//! and the one conversion from raw map bytes to the types they expose.

include!(concat!(env!("OUT_DIR"), "/skeletons.rs"));

/// Plain-old-data types generated from BPF BTF (all fields integers/arrays).
///
/// # Safety
/// Implement only for `#[repr(C)]` types made of integers and arrays of them,
/// for which every bit pattern is valid.
pub unsafe trait Pod: Copy + Default {}

unsafe impl Pod for cpu_sampler::types::cpu_sample_key {}
unsafe impl Pod for cpu_ring::types::ring_entry {}
unsafe impl Pod for cpu_sampler::types::ff_target {}
unsafe impl Pod for cpu_sampler::types::ff_proc_event {}
unsafe impl Pod for runqlat::types::runqlat_key {}
unsafe impl Pod for runqlat::types::runqlat_hist {}
unsafe impl Pod for runqlat::types::ff_target {}
unsafe impl Pod for cpu_sampler::types::cpu_drops {}
unsafe impl Pod for cpu_sampler::types::ff_py_proc {}
unsafe impl Pod for runqlat::types::runqlat_drops {}
unsafe impl Pod for runqlat::types::runqlat_slots {}
unsafe impl Pod for runqlat::types::runqlat_cpu {}
unsafe impl Pod for heap::types::ff_target {}
unsafe impl Pod for offcpu::types::ff_target {}
unsafe impl Pod for offcpu::types::offcpu_key {}
unsafe impl Pod for offcpu::types::offcpu_val {}
unsafe impl Pod for offcpu::types::offcpu_short {}
unsafe impl Pod for offcpu::types::offcpu_cpu {}
unsafe impl Pod for u64 {}
unsafe impl Pod for u32 {}
unsafe impl Pod for i32 {}

/// Reads a `T` from map bytes; `None` when the length does not match.
pub fn from_bytes<T: Pod>(bytes: &[u8]) -> Option<T> {
    if bytes.len() != std::mem::size_of::<T>() {
        return None;
    }
    // SAFETY: length checked; `T: Pod` accepts any bit pattern; unaligned read.
    Some(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<T>()) })
}

/// Every CPU's value of entry `key` of a per-CPU map, as `T`s (a value of another size is
/// left out); none when the map has no such entry.
pub fn per_cpu<T: Pod>(
    map: &impl libbpf_rs::MapCore,
    key: u32,
) -> Result<Vec<T>, libbpf_rs::Error> {
    Ok(map
        .lookup_percpu(&key.to_ne_bytes(), libbpf_rs::MapFlags::ANY)?
        .unwrap_or_default()
        .iter()
        .filter_map(|v| from_bytes::<T>(v))
        .collect())
}

/// The bytes of a `T`, to use as a map key or value.
pub fn as_bytes<T: Pod>(v: &T) -> &[u8] {
    // SAFETY: `T: Pod` is plain data; the slice covers exactly `*v`.
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), std::mem::size_of::<T>()) }
}
