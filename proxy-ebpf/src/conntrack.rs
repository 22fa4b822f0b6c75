//! Conntrack: one entry per direction of each flow, plus a third for a
//! masqueraded flow's reply (keyed by the SNAT address and port), in two
//! LRU maps. A new flow's entries go to CT_UNCONFIRMED; its first reply
//! moves them to CONNTRACK (`confirm`). A flood of flows that are never
//! answered (spoofed SYNs) so turns over the unconfirmed table only, and
//! its entries lapse after `CT_UNCONFIRMED_TIMEOUT_NS` idle, masquerade
//! ports with them. Lookups try CONNTRACK first: established traffic pays
//! one lookup, as before.

use aya_ebpf::{
    Global,
    bindings::BPF_ANY,
    helpers::{bpf_jiffies64, bpf_ktime_get_coarse_ns, bpf_ktime_get_ns},
    macros::map,
    maps::{Array, PerCpuArray},
};
use proxy_common::{
    Addr, Backend, CT_CLOSING, CT_CLOSING_TIMEOUT_NS, CT_LOOPBACK, CT_MASQUERADE, CT_NODE, CT_ORIGINAL, CT_REPLY,
    CT_CONFIRM_ON_REPLY, CT_SNAT_TIME_WAIT_NS, CT_PENDING, CT_UNCONFIRMED_TIMEOUT_NS, Counter, CtEntry, CtKey,
    IPPROTO_TCP, ServiceEntry, SnatEntry,
};

use crate::{
    maps::{CONNTRACK, CT_UNCONFIRMED as UNCONFIRMED, SNAT, SNAT_UNCONFIRMED, count},
    packet::Packet,
};

/// `Confirming`'s room, per CPU.
#[map]
static CONFIRMING: PerCpuArray<Confirming> = PerCpuArray::with_max_entries(1, 0);

/// CLOCK_MONOTONIC at the kernel tick's resolution (a few ms): conntrack's
/// timeouts are seconds. `dump` reads the same clock. Before Linux 5.11 (no
/// coarse helper) the fine one, which `now` reads at most once a tick too.
///
/// A helper call costs ~20 ns on an established packet (call and return,
/// with the return-stack mitigations of today's CPUs), and the coarse
/// clock only moves with the tick: so the clock is read once per tick and
/// kept in `CLOCK`, and a packet compares the tick it sees (jiffies, which
/// the verifier inlines into a plain load on 64-bit JITs) with the one the
/// kept reading was taken in. The kernel moves jiffies and the coarse clock
/// together (timekeeping's tick update), so the kept reading is the coarse
/// clock itself but for a tick either way while the two are written: no
/// timeout is near a tick. CPUs share the cache; whoever sees a new tick
/// first writes it.
#[inline(always)]
fn now() -> u64 {
    let tick = unsafe { bpf_jiffies64() };
    let Some(kept) = CLOCK.get_ptr_mut(0) else { return clock() };
    let kept = unsafe { &mut *kept };
    if kept.tick == tick {
        return kept.ns;
    }
    let ns = clock();
    kept.ns = ns;
    kept.tick = tick;
    ns
}

#[inline(always)]
fn clock() -> u64 {
    if HAS_COARSE_CLOCK.load() != 0 { unsafe { bpf_ktime_get_coarse_ns() } } else { unsafe { bpf_ktime_get_ns() } }
}

/// The clock as last read, and the tick (jiffies) it was read in: see `now`.
#[repr(C)]
struct KeptClock {
    tick: u64,
    ns: u64,
}

#[map]
static CLOCK: Array<KeptClock> = Array::with_max_entries(1, 0);

/// Set by the agent at load: 1 where bpf_ktime_get_coarse_ns exists. A
/// read-only constant, so the verifier drops the call a kernel lacks.
#[unsafe(no_mangle)]
static HAS_COARSE_CLOCK: Global<u32> = Global::new(1);

/// The entry of `tuple` in either table, live or not.
#[inline(always)]
fn raw(tuple: &CtKey) -> Option<&mut CtEntry> {
    CONNTRACK.get_ptr_mut(tuple).or_else(|| UNCONFIRMED.get_ptr_mut(tuple)).map(|e| unsafe { &mut *e })
}

/// The entry of a live flow: an entry whose connection closed and then went
/// quiet counts as gone (TCP flows have no other end in an LRU map), and so
/// does an unanswered one gone quiet.
#[inline(always)]
pub fn lookup(tuple: &CtKey) -> Option<&CtEntry> {
    lookup_mut(tuple).map(|e| &*e)
}

/// As `lookup`, writable, so the packet's path can `touch` the entry it found
/// without a second lookup.
#[inline(always)]
pub fn lookup_mut(tuple: &CtKey) -> Option<&mut CtEntry> {
    raw(tuple).filter(|e| is_live(e))
}

/// Only an unconfirmed or closing entry can lapse, so only those read the
/// clock.
#[inline(always)]
fn is_live(e: &CtEntry) -> bool {
    if e.flags & (CT_PENDING | CT_CLOSING) == 0 {
        return true;
    }
    let idle = now().saturating_sub(e.last_seen_ns);
    let lapsed = e.flags & CT_PENDING != 0 && idle >= CT_UNCONFIRMED_TIMEOUT_NS;
    !lapsed && (e.flags & CT_CLOSING == 0 || idle < CT_CLOSING_TIMEOUT_NS)
}

/// A new entry, in the unconfirmed table. An entry left in CONNTRACK under
/// the same key (a closed flow's) goes: lookups would find it first.
#[inline(always)]
fn insert_unconfirmed(key: &CtKey, entry: &CtEntry) -> Result<(), i32> {
    if CONNTRACK.remove(key).is_ok() {
        count(Counter::CtReleased);
    }
    UNCONFIRMED.insert(key, entry, BPF_ANY as u64)
}

/// A flow being confirmed, as its entries name it, and room for the keys
/// of its entries. A per-CPU map value, not the stack: the ingress
/// programs have almost none left.
pub struct Confirming {
    client: Addr,
    frontend: Addr,
    backend: Addr,
    client_port: u16,
    frontend_port: u16,
    backend_port: u16,
    proto: u8,
    key: CtKey,
    snat_reply: CtKey,
}

impl Confirming {
    /// The flow of a reply entry found under `key`: backend -> client, or,
    /// for a masqueraded flow, backend -> SNAT address:port (the entry names
    /// the client).
    #[inline(always)]
    pub fn of_reply(key: &CtKey, e: &CtEntry) -> Option<&'static mut Confirming> {
        let c = unsafe { &mut *CONFIRMING.get_ptr_mut(0)? };
        if e.flags & CT_MASQUERADE != 0 {
            c.client = e.rev_addr;
            c.client_port = e.rev_port;
        } else {
            c.client = key.dst;
            c.client_port = key.dport;
        }
        c.frontend = e.nat_addr;
        c.frontend_port = e.nat_port;
        c.backend = key.src;
        c.backend_port = key.sport;
        c.proto = key.proto;
        Some(c)
    }

    /// The flow of an original entry found under `key` (client -> frontend).
    #[inline(always)]
    pub fn of_original(key: &CtKey, e: &CtEntry) -> Option<&'static mut Confirming> {
        let c = unsafe { &mut *CONFIRMING.get_ptr_mut(0)? };
        c.client = key.src;
        c.client_port = key.sport;
        c.frontend = key.dst;
        c.frontend_port = key.dport;
        c.backend = e.nat_addr;
        c.backend_port = e.nat_port;
        c.proto = key.proto;
        Some(c)
    }

    /// Moves the flow's entries and masquerade choice to the confirmed
    /// tables, where a flood of new flows cannot evict them. The caller
    /// looks its entry up again: it moved.
    #[inline(always)]
    pub fn confirm(&mut self) {
        self.set_key(self.client, self.client_port, self.frontend, self.frontend_port);
        promote(&self.key);
        self.set_key(self.backend, self.backend_port, self.client, self.client_port);
        promote(&self.key);
        // Masqueraded: the choice (keyed client -> backend), and the reply
        // entry of the SNAT tuple it names (also when the choice was
        // confirmed before and only its port claimed again).
        self.set_key(self.client, self.client_port, self.backend, self.backend_port);
        if let Some(pending) = unsafe { SNAT_UNCONFIRMED.get(&self.key) } {
            if SNAT.insert(&self.key, pending, BPF_ANY as u64).is_ok() {
                let _ = SNAT_UNCONFIRMED.remove(&self.key);
            }
        }
        let Some(choice) = snat_choice(&self.key) else { return };
        self.snat_reply =
            CtKey { src: self.backend, dst: choice.addr, sport: self.backend_port, dport: choice.port, ..self.key };
        promote(&self.snat_reply);
    }

    /// The backend's SYN-ACK (`seq`: its sequence number, network order):
    /// the client's ACK of it will confirm the flow.
    #[inline(always)]
    pub fn expect_handshake_ack(&mut self, seq: u32) {
        self.set_key(self.client, self.client_port, self.frontend, self.frontend_port);
        if let Some(e) = UNCONFIRMED.get_ptr_mut(&self.key) {
            unsafe { (*e).handshake_ack = u32::from_be(seq).wrapping_add(1).to_be() };
        }
    }

    #[inline(always)]
    fn set_key(&mut self, src: Addr, sport: u16, dst: Addr, dport: u16) {
        self.key = CtKey { src, dst, sport, dport, proto: self.proto, _pad: [0; 3] };
    }
}

/// The entry under `key`, if unconfirmed, moved to CONNTRACK.
#[inline(always)]
fn promote(key: &CtKey) {
    let Some(entry) = UNCONFIRMED.get_ptr_mut(key) else { return };
    let entry = unsafe { &mut *entry };
    entry.flags &= !CT_PENDING;
    if CONNTRACK.insert(key, entry, BPF_ANY as u64).is_ok() {
        count(Counter::CtPromoted);
        let _ = UNCONFIRMED.remove(key);
    } else {
        entry.flags |= CT_PENDING;
    }
}

/// Whether a client packet of an unconfirmed flow completes its handshake:
/// an ACK (no SYN, no RST) of the SYN-ACK recorded, `ack` its
/// acknowledgement number (network order).
#[inline(always)]
pub fn completes_handshake(e: &CtEntry, pkt: &Packet, ack: impl FnOnce() -> Option<u32>) -> bool {
    e.handshake_ack != 0 && pkt.acks_only() && ack() == Some(e.handshake_ack)
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

/// Records both directions, unconfirmed: the original (client -> frontend,
/// translated to the backend) and the reply (backend -> client, translated
/// back).
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
    let confirm_on_reply = if tuple.proto != IPPROTO_TCP || flags & CT_NODE != 0 { CT_CONFIRM_ON_REPLY } else { 0 };
    let flags = flags | CT_PENDING | confirm_on_reply;
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
        flags: flags & (CT_NODE | CT_LOOPBACK | CT_PENDING | CT_CONFIRM_ON_REPLY),
        ..Default::default()
    };
    // The reply entry first, so a reply can never miss its translation.
    insert_unconfirmed(&reply_key(tuple, &backend.addr, backend.port), &entry)?;
    entry.nat_addr = backend.addr;
    entry.nat_port = backend.port;
    entry.direction = CT_ORIGINAL;
    entry.flags = flags;
    insert_unconfirmed(tuple, &entry)?;
    if flags & CT_MASQUERADE != 0 {
        // A SNAT choice left by an earlier flow with this tuple would send
        // this one's replies to that flow's frontend: egress chooses afresh.
        let after_dnat = CtKey { dst: backend.addr, dport: backend.port, ..*tuple };
        forget_snat_choice(&after_dnat);
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

/// The state of `snat_key` for the flow from `client:client_port` to the
/// frontend `frontend:frontend_port` (as its plain reply entry names it).
/// Reads the raw entry: `lookup` forgets a closed flow after
/// `CT_CLOSING_TIMEOUT_NS`, long before its TIME_WAIT ends. An unanswered
/// flow's port is free once its entry lapsed.
#[inline(always)]
pub fn snat_tuple(snat_key: &CtKey, frontend: &Addr, frontend_port: u16, client: &Addr, client_port: u16) -> SnatTuple {
    let Some(held) = raw(snat_key) else { return SnatTuple::Free };
    // Every answer is its own return, and the times are compared as
    // `now >= last_seen + timeout` rather than through a saturated idle
    // time: a boolean or a clamp computed here becomes a register that is
    // 0 on one path and 1 on another, which the verifier then walks apart
    // through the rest of every port try (masquerade::source_for).
    if held.rev_addr == *client
        && held.rev_port == client_port
        && held.nat_addr == *frontend
        && held.nat_port == frontend_port
    {
        return SnatTuple::Free;
    }
    let now = now();
    if held.flags & CT_PENDING != 0 && now >= held.last_seen_ns.wrapping_add(CT_UNCONFIRMED_TIMEOUT_NS) {
        return SnatTuple::Free;
    }
    if held.flags & CT_CLOSING == 0 {
        return SnatTuple::Held;
    }
    if now < held.last_seen_ns.wrapping_add(CT_SNAT_TIME_WAIT_NS) { SnatTuple::Reserved } else { SnatTuple::Free }
}

/// Whether a masqueraded flow other than `client:client_port`'s holds
/// `snat_key` (open, or closed and reserved): a node socket's connection on
/// that tuple would meet its backend's replies or TIME_WAIT.
#[inline(always)]
pub fn masquerade_holds(snat_key: &CtKey, own_reply: &CtEntry, client: &Addr, client_port: u16) -> bool {
    let masqueraded = raw(snat_key).is_some_and(|e| e.flags & CT_MASQUERADE != 0);
    masqueraded && snat_tuple(snat_key, &own_reply.nat_addr, own_reply.nat_port, client, client_port) != SnatTuple::Free
}

/// Records `snat_key` as the reply tuple of a masqueraded flow: replies go
/// to `client:client_port`; `plain_reply` is the flow's ordinary reply entry.
/// The caller checked `snat_tuple`. Unconfirmed until the first reply.
#[inline(always)]
pub fn claim_snat_reply(snat_key: &CtKey, plain_reply: &CtEntry, client: &Addr, client_port: u16) -> Result<(), i32> {
    let now = now();
    let entry = CtEntry {
        rev_addr: *client,
        rev_port: client_port,
        flags: CT_MASQUERADE | CT_PENDING | (plain_reply.flags & (CT_NODE | CT_LOOPBACK | CT_CONFIRM_ON_REPLY)),
        created_ns: now,
        last_seen_ns: now,
        ..*plain_reply
    };
    insert_unconfirmed(snat_key, &entry)
}

/// The masquerade source chosen for the flow `after_dnat` (client ->
/// backend), in either table.
#[inline(always)]
pub fn snat_choice(after_dnat: &CtKey) -> Option<&SnatEntry> {
    unsafe { SNAT.get(after_dnat).or_else(|| SNAT_UNCONFIRMED.get(after_dnat)) }
}

/// Records the masquerade source of a new flow (unconfirmed, as its
/// entries). No confirmed choice is left under its key: `create` forgot it.
#[inline(always)]
pub fn record_snat_choice(after_dnat: &CtKey, choice: &SnatEntry) -> Result<(), i32> {
    SNAT_UNCONFIRMED.insert(after_dnat, choice, 0)
}

/// Keeps a masqueraded flow's source in its ORIGINAL entry too (`original`:
/// client -> frontend, translated to `backend:backend_port`), where XDP
/// finds it with the flow's first lookup. A new entry under that key (a
/// new flow, a new backend) starts without it.
#[inline(always)]
pub fn keep_snat_choice_in_flow(original: &CtKey, backend: &Addr, backend_port: u16, choice: &SnatEntry) {
    let Some(e) = lookup_mut(original) else { return };
    if e.direction == CT_ORIGINAL && e.flags & CT_MASQUERADE != 0 && e.nat_port == backend_port && e.nat_addr == *backend {
        e.rev_addr = choice.addr;
        e.rev_port = choice.port;
    }
}

#[inline(always)]
pub fn forget_snat_choice(after_dnat: &CtKey) {
    let _ = SNAT.remove(after_dnat);
    let _ = SNAT_UNCONFIRMED.remove(after_dnat);
}

/// A masqueraded flow's client sent a FIN or RST: its SNAT port closes too
/// (replies mark it themselves), so a new connection can take it.
#[inline(always)]
pub fn close_snat_reply(snat_key: &CtKey) {
    if let Some(held) = lookup_mut(snat_key) {
        touch(held, true);
    }
}
