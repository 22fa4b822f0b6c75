//! Frontend lookup and backend choice: hash lookups only, so the cost per
//! packet does not grow with the number of services.

use aya_ebpf::helpers::bpf_get_prandom_u32;
use proxy_common::{Backend, CtEntry, CtKey, FrontendKey, SCOPE_INTERNAL, ServiceEntry, SlotKey};

use crate::maps::{BACKEND_SLOTS, BACKENDS, FRONTENDS};

#[inline(always)]
pub fn lookup_frontend(tuple: &CtKey) -> Option<ServiceEntry> {
    let key = FrontendKey {
        addr: tuple.dst,
        port: tuple.dport,
        proto: tuple.proto,
        // Every client is in-cluster until source classification lands with
        // the traffic policies.
        scope: SCOPE_INTERNAL,
    };
    unsafe { FRONTENDS.get(&key) }.copied()
}

/// A random slot of the service's backend set.
#[inline(always)]
pub fn choose_backend(service: &ServiceEntry) -> Option<(u32, Backend)> {
    if service.backend_count == 0 {
        return None;
    }
    let slot = unsafe { bpf_get_prandom_u32() } % service.backend_count;
    let backend_id = *unsafe { BACKEND_SLOTS.get(&SlotKey { service_id: service.service_id, slot }) }?;
    let backend = *unsafe { BACKENDS.get(&backend_id) }?;
    Some((backend_id, backend))
}

/// A conntrack entry is only as good as its backend: if the agent removed or
/// reused the backend ID, the flow must be balanced again.
#[inline(always)]
pub fn backend_still_matches(ct: &CtEntry) -> bool {
    match unsafe { BACKENDS.get(&ct.backend_id) } {
        Some(b) => b.addr == ct.nat_addr && b.port == ct.nat_port,
        None => false,
    }
}
