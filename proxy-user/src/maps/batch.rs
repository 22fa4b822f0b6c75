//! Many entries of one hash map in one bpf() call (BPF_MAP_UPDATE_BATCH,
//! Linux 5.6). aya 0.16 writes one entry per call, and at 10,000 Services
//! the first sync's ~240,000 calls spent most of their time entering and
//! leaving the kernel.

use std::os::fd::{AsFd, AsRawFd};

use aya::{
    Pod,
    maps::{HashMap, IterableMap, MapData, MapError},
};
use aya_obj::generated::{bpf_attr, bpf_cmd};

/// Entries per call: the kernel copies them one by one either way; this
/// bounds the contiguous copies made here.
const CHUNK: usize = 8192;

/// Writes `entries` in order and returns how many were written, with the
/// error that stopped it. Whatever the batch call could not write (a kernel
/// without batch support for this map, a full map, anything) is written one
/// entry at a time from where it stopped, so an error is the single write's
/// own, exactly as without batching.
pub fn insert_all<K: Pod, V: Pod>(map: &mut HashMap<MapData, K, V>, entries: &[(K, V)]) -> (usize, Result<(), MapError>) {
    let mut written = 0;
    for chunk in entries.chunks(CHUNK) {
        let done = update_batch(map.map(), chunk);
        written += done;
        if done < chunk.len() {
            for (key, value) in &chunk[done..] {
                if let Err(e) = map.insert(key, value, 0) {
                    return (written, Err(e));
                }
                written += 1;
            }
        }
    }
    (written, Ok(()))
}

/// One BPF_MAP_UPDATE_BATCH call; how many entries it surely wrote. On an
/// element's error the kernel sets `count` to the entries before it; a
/// refusal of the whole call (no batch support) leaves `count` as it was,
/// so an error with `count` untouched counts as none written (rewriting an
/// entry is harmless: these are insert-or-replace writes).
fn update_batch<K: Pod, V: Pod>(map: &MapData, entries: &[(K, V)]) -> usize {
    let keys: Vec<K> = entries.iter().map(|(k, _)| *k).collect();
    let values: Vec<V> = entries.iter().map(|(_, v)| *v).collect();
    // SAFETY: bpf_attr is plain data; all-zero is its "no options" state.
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    // SAFETY: `batch` is the member BPF_MAP_UPDATE_BATCH reads; the key and
    // value arrays outlive the call and hold `count` entries each, laid out
    // as the map's key_size and value_size (the Pod types it was opened as).
    let batch = unsafe { &mut attr.batch };
    batch.keys = keys.as_ptr() as u64;
    batch.values = values.as_ptr() as u64;
    batch.count = entries.len() as u32;
    batch.map_fd = map.fd().as_fd().as_raw_fd() as u32;
    // SAFETY: the kernel reads the attr and the arrays it points at, and
    // writes only `count` back into the attr.
    let rc = unsafe {
        libc::syscall(libc::SYS_bpf, bpf_cmd::BPF_MAP_UPDATE_BATCH as libc::c_int, &mut attr as *mut bpf_attr, size_of::<bpf_attr>() as libc::c_uint)
    };
    if rc == 0 {
        entries.len()
    } else {
        // SAFETY: as above; the kernel may have set `count`.
        let count = unsafe { attr.batch.count } as usize;
        if count < entries.len() { count } else { 0 }
    }
}
