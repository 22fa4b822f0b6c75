//! Conntrack: an LRU map with one entry per direction of each flow.

use aya_ebpf::{bindings::BPF_ANY, helpers::bpf_ktime_get_ns};
use proxy_common::{Backend, CT_ORIGINAL, CT_REPLY, CtEntry, CtKey, ServiceEntry};

use crate::maps::CONNTRACK;

#[inline(always)]
pub fn lookup(tuple: &CtKey) -> Option<CtEntry> {
    unsafe { CONNTRACK.get(tuple) }.copied()
}

#[inline(always)]
pub fn touch(tuple: &CtKey) {
    if let Some(e) = CONNTRACK.get_ptr_mut(tuple) {
        unsafe { (*e).last_seen_ns = bpf_ktime_get_ns() };
    }
}

/// Records both directions: the original (client -> frontend, translated to
/// the backend) and the reply (backend -> client, translated back).
#[inline(always)]
pub fn create(tuple: &CtKey, service: &ServiceEntry, backend_id: u32, backend: &Backend) -> Result<(), i32> {
    let now = unsafe { bpf_ktime_get_ns() };
    let original = CtEntry {
        nat_addr: backend.addr,
        nat_port: backend.port,
        direction: CT_ORIGINAL,
        service_id: service.service_id,
        backend_id,
        created_ns: now,
        last_seen_ns: now,
        ..Default::default()
    };
    let reply_key = CtKey {
        src: backend.addr,
        dst: tuple.src,
        sport: backend.port,
        dport: tuple.sport,
        proto: tuple.proto,
        _pad: [0; 3],
    };
    let reply = CtEntry {
        nat_addr: tuple.dst,
        nat_port: tuple.dport,
        direction: CT_REPLY,
        ..original
    };
    CONNTRACK.insert(&reply_key, &reply, BPF_ANY as u64)?;
    CONNTRACK.insert(tuple, &original, BPF_ANY as u64)
}
