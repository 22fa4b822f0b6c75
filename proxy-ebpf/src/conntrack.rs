//! Conntrack: an LRU map with one entry per direction of each flow, plus a
//! third for a masqueraded flow's reply (keyed by the SNAT address and port).

use aya_ebpf::{
    Global,
    bindings::BPF_ANY,
    helpers::{bpf_ktime_get_coarse_ns, bpf_ktime_get_ns},
};
use proxy_common::{
    Addr, Backend, CT_CLOSING, CT_CLOSING_TIMEOUT_NS, CT_LOOPBACK, CT_MASQUERADE, CT_NODE, CT_ORIGINAL, CT_REPLY,
    CT_SNAT_TIME_WAIT_NS, CtEntry, CtKey, ServiceEntry,
};

use crate::{
    maps::{CONNTRACK, SNAT},
    parse::Packet,
};

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

/// The live flow `pkt` belongs to, in either direction. A SYN after the
/// old connection's FIN or RST opens a new one; any other SYN is a
/// retransmission and must reach the same backend.
#[inline(always)]
pub fn lookup_flow(pkt: &Packet) -> Option<&mut CtEntry> {
    let reopens = |ct: &&mut CtEntry| ct.direction == CT_ORIGINAL && ct.flags & CT_CLOSING != 0 && pkt.opens_connection();
    lookup_mut(&pkt.tuple).filter(|ct| !reopens(ct))
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
        // A node client's replies are rewritten whole at ingress.
        flags: flags & (CT_NODE | CT_LOOPBACK),
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

/// Who holds a SNAT reply tuple (backend -> SNAT address:port), as seen by
/// a masqueraded flow that would take it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum SnatTuple {
    /// No flow, or only this flow itself (the same client and frontend: a
    /// retransmission, or the client reopening its closed connection, whose
    /// sequence numbers the backend's TIME_WAIT accepts).
    Free,
    /// Another client's flow closed less than `CT_SNAT_TIME_WAIT_NS` ago:
    /// the backend may hold the tuple in TIME_WAIT.
    Reserved,
    /// Another flow's, open.
    Held,
}

/// The state of `snat_key` for the flow whose plain reply entry is
/// `plain_reply` (it names the frontend) and whose client is
/// `client:client_port`. Reads the raw entry: `lookup` forgets a closed
/// flow after `CT_CLOSING_TIMEOUT_NS`, long before its TIME_WAIT ends.
#[inline(always)]
pub fn snat_tuple(snat_key: &CtKey, plain_reply: &CtEntry, client: &Addr, client_port: u16) -> SnatTuple {
    let Some(held) = (unsafe { CONNTRACK.get(snat_key) }) else { return SnatTuple::Free };
    let same_flow = held.rev_addr == *client
        && held.rev_port == client_port
        && held.nat_addr == plain_reply.nat_addr
        && held.nat_port == plain_reply.nat_port;
    if same_flow {
        SnatTuple::Free
    } else if held.flags & CT_CLOSING == 0 {
        SnatTuple::Held
    } else if now().saturating_sub(held.last_seen_ns) < CT_SNAT_TIME_WAIT_NS {
        SnatTuple::Reserved
    } else {
        SnatTuple::Free
    }
}

/// Whether a masqueraded flow other than `client:client_port`'s holds
/// `snat_key` (open, or closed and reserved): a node socket's connection on
/// that tuple would meet its backend's replies or TIME_WAIT.
#[inline(always)]
pub fn masquerade_holds(snat_key: &CtKey, own_reply: &CtEntry, client: &Addr, client_port: u16) -> bool {
    let masqueraded = unsafe { CONNTRACK.get(snat_key) }.is_some_and(|e| e.flags & CT_MASQUERADE != 0);
    masqueraded && snat_tuple(snat_key, own_reply, client, client_port) != SnatTuple::Free
}

/// Records `snat_key` as the reply tuple of a masqueraded flow: replies go
/// to `client:client_port`; `plain_reply` is the flow's ordinary reply entry.
/// The caller checked `snat_tuple`.
#[inline(always)]
pub fn claim_snat_reply(snat_key: &CtKey, plain_reply: &CtEntry, client: &Addr, client_port: u16) -> Result<(), i32> {
    let now = now();
    let entry = CtEntry {
        rev_addr: *client,
        rev_port: client_port,
        flags: CT_MASQUERADE | (plain_reply.flags & (CT_NODE | CT_LOOPBACK)),
        created_ns: now,
        last_seen_ns: now,
        ..*plain_reply
    };
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
