//! The IDs of the BPF programs and maps the kernel holds, read without
//! opening any of them.
//!
//! Opening a map by ID (as aya's `loaded_maps` and bpftool do) takes and
//! drops a user reference. On a program array whose last user reference has
//! just gone, dropping it again queues the kernel's deferred clearing while
//! the first is still queued, and the map reference that clearing takes is
//! then never given back: the empty array stays loaded until reboot. Seen
//! on 6.18: after `cleanup`, polling with `loaded_maps` left an empty
//! REJECT_PROGRAMS now and then; 200 quick polls in each of five runs left
//! seven of our program arrays. A test that waits for our objects to go must not be what
//! keeps them, so this lists IDs with BPF_{PROG,MAP}_GET_NEXT_ID, which
//! takes no reference.

use std::collections::BTreeSet;

use anyhow::Result;

const BPF_PROG_GET_NEXT_ID: libc::c_long = 11;
const BPF_MAP_GET_NEXT_ID: libc::c_long = 12;

/// The `start_id`/`next_id` pair of `union bpf_attr` for the GET_NEXT_ID commands.
#[repr(C)]
#[derive(Default)]
struct NextId {
    start_id: u32,
    next_id: u32,
    open_flags: u32,
}

fn ids(cmd: libc::c_long) -> Result<BTreeSet<u32>> {
    let mut found = BTreeSet::new();
    let mut attr = NextId::default();
    loop {
        // SAFETY: attr is a valid, initialised bpf_attr prefix of the size passed.
        let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, &mut attr as *mut NextId, std::mem::size_of::<NextId>()) };
        if r < 0 {
            let err = std::io::Error::last_os_error();
            // ENOENT: no ID after start_id.
            if err.raw_os_error() == Some(libc::ENOENT) {
                return Ok(found);
            }
            return Err(err.into());
        }
        found.insert(attr.next_id);
        attr.start_id = attr.next_id;
    }
}

/// IDs of every program loaded.
pub fn program_ids() -> Result<BTreeSet<u32>> {
    ids(BPF_PROG_GET_NEXT_ID)
}

/// IDs of every map loaded.
pub fn map_ids() -> Result<BTreeSet<u32>> {
    ids(BPF_MAP_GET_NEXT_ID)
}
