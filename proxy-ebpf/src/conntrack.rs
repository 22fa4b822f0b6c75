//! Conntrack: an LRU map with one entry per direction of each flow, plus a
//! third for a masqueraded flow's reply (keyed by the SNAT address and port).

use aya_ebpf::{
    Global,
    bindings::BPF_ANY,
    helpers::{bpf_ktime_get_coarse_ns, bpf_ktime_get_ns},
};
use proxy_common::{
    Addr, Backend, CT_CLOSING, CT_CLOSING_TIMEOUT_NS, CT_MASQUERADE, CT_ORIGINAL, CT_REPLY, CT_SNAT_REUSE_IDLE_NS, CtEntry,
    CtKey, ServiceEntry,
};

use crate::maps::{CONNTRACK, SNAT};

/// CLOCK_MONOTONIC at the kernel tick's resolution (a few ms): conntrack's
/// timeouts are seconds, and the fine clock (a TSC read) cost as much as a
/// checksum update on every established packet. `dump` reads the same clock.
/// Before Linux 5.11 (no coarse helper) the fine one: the same clock, to
/// the nanosecond.
#[inline(always)]
fn now() -> u64 {
    if HAS_COARSE_CLOCK.load() != 0 { unsafe { bpf_ktime_get_coarse_ns() } } else { unsafe { bpf_ktime_get_ns() } }
}

/// Set by the agent at load: 1 where bpf_ktime_get_coarse_ns exists. A
/// read-only constant, so the verifier drops the call a kernel lacks.
#[unsafe(no_mangle)]
static HAS_COARSE_CLOCK: Global<u32> = Global::new(1);

/// The entry of a live flow: an entry whose connection closed and then went
/// quiet counts as gone (TCP flows have no other end in an LRU map).
#[inline(always)]
pub fn lookup(tuple: &CtKey) -> Option<&CtEntry> {
    unsafe { CONNTRACK.get(tuple) }.filter(|e| is_live(e))
}

/// As `lookup`, writable, so the packet's path can `touch` the entry it found
/// without a second lookup.
#[inline(always)]
pub fn lookup_mut(tuple: &CtKey) -> Option<&mut CtEntry> {
    CONNTRACK.get_ptr_mut(tuple).map(|e| unsafe { &mut *e }).filter(|e| is_live(e))
}

#[inline(always)]
fn is_live(e: &CtEntry) -> bool {
    e.flags & CT_CLOSING == 0 || now().saturating_sub(e.last_seen_ns) < CT_CLOSING_TIMEOUT_NS
}

/// Another packet of the flow; `closing` when it carries a FIN or RST.
#[inline(always)]
pub fn touch(e: &mut CtEntry, closing: bool) {
    e.last_seen_ns = now();
    if closing {
        e.flags |= CT_CLOSING;
    }
}

/// The tuple a reply from `backend` to the original sender carries.
#[inline(always)]
pub fn reply_key(tuple: &CtKey, backend: &Addr, backend_port: u16) -> CtKey {
    CtKey { src: *backend, dst: tuple.src, sport: backend_port, dport: tuple.sport, proto: tuple.proto, _pad: [0; 3] }
}

/// Records both directions: the original (client -> frontend, translated to
/// the backend) and the reply (backend -> client, translated back).
/// `epoch`: lb::backends_epoch() as read before the backend was chosen.
#[inline(always)]
pub fn create(
    tuple: &CtKey,
    service: &ServiceEntry,
    backend_id: u32,
    backend: &Backend,
    flags: u8,
    epoch: u32,
) -> Result<(), i32> {
    let now = now();
    // One value on the stack, reused: the BPF stack is small.
    let mut entry = CtEntry {
        nat_addr: tuple.dst,
        nat_port: tuple.dport,
        direction: CT_REPLY,
        service_id: service.service_id,
        backend_id,
        backends_epoch: epoch,
        created_ns: now,
        last_seen_ns: now,
        ..Default::default()
    };
    // The reply entry first, so a reply can never miss its translation.
    CONNTRACK.insert(&reply_key(tuple, &backend.addr, backend.port), &entry, BPF_ANY as u64)?;
    entry.nat_addr = backend.addr;
    entry.nat_port = backend.port;
    entry.direction = CT_ORIGINAL;
    entry.flags = flags;
    CONNTRACK.insert(tuple, &entry, BPF_ANY as u64)?;
    if flags & CT_MASQUERADE != 0 {
        // A SNAT choice left by an earlier flow with this tuple would send
        // this one's replies to that flow's frontend: egress chooses afresh.
        let after_dnat = CtKey { dst: backend.addr, dport: backend.port, ..*tuple };
        let _ = SNAT.remove(&after_dnat);
    }
    Ok(())
}

/// Claims `snat_key` (backend -> SNAT address:port) for a masqueraded flow's
/// replies; fails if another flow holds it, so the caller tries another port.
/// `plain_reply` is the flow's ordinary reply entry (it names the frontend);
/// `client` is where the replies really go. A new TCP connection (`opens`)
/// may take the port of a flow that closed and went quiet
/// (`CT_SNAT_REUSE_IDLE_NS`).
#[inline(always)]
pub fn claim_snat_reply(
    snat_key: &CtKey,
    plain_reply: &CtEntry,
    client: &Addr,
    client_port: u16,
    opens: bool,
) -> Result<(), i32> {
    let now = now();
    let entry = CtEntry {
        rev_addr: *client,
        rev_port: client_port,
        flags: CT_MASQUERADE,
        created_ns: now,
        last_seen_ns: now,
        ..*plain_reply
    };
    // The reply entries are the port table: a live one is another flow's.
    let reusable = |held: &CtEntry| {
        held.flags & CT_CLOSING != 0 && now.saturating_sub(held.last_seen_ns) >= CT_SNAT_REUSE_IDLE_NS
    };
    if lookup(snat_key).is_some_and(|held| !(opens && reusable(held))) {
        return Err(-1);
    }
    CONNTRACK.insert(snat_key, &entry, BPF_ANY as u64)
}

/// A masqueraded flow's client sent a FIN or RST: its SNAT port closes too
/// (replies mark it themselves), so a new connection can take it.
#[inline(always)]
pub fn close_snat_reply(snat_key: &CtKey) {
    if let Some(held) = lookup_mut(snat_key) {
        touch(held, true);
    }
}
