//! Masquerade (SNAT) at TC egress, where routing has chosen the interface and
//! so the node address the flow should leave with. Ingress marks the packets
//! of flows that need it (as kube-proxy's mark-for-masquerade); this side
//! rewrites their source and records where replies go.

use core::num::NonZeroU32;

use aya_ebpf::{
    EbpfContext, Global,
    bindings::{BPF_F_CURRENT_NETNS, bpf_sock_tuple},
    helpers::{bpf_get_prandom_u32, bpf_sk_release, bpf_skc_lookup_tcp},
    programs::TcContext,
};
use proxy_common::{
    Addr, CT_CLOSING, CT_CONFIRM_ON_REPLY, CT_REPLY, Counter, CtEntry, CtKey, DEFAULT_EPHEMERAL_PORTS, DEFAULT_SNAT_PORTS,
    IPPROTO_TCP, SNAT_ADDR_IPV6, SnatEntry, TCP_SNAT_PORT_LOW,
};

use crate::{
    conntrack::{self, SnatTuple},
    family::Family,
    maps::{NODE_SNAT, SNAT_ADDRS, count},
    packet::Packet,
};

/// Random ports tried when the client's own one cannot be kept.
const PORT_TRIES: u32 = 16;

/// The range UDP and SCTP SNAT ports come from (host order, inclusive), set
/// by the agent at load to lie outside the node's ephemeral ports: the
/// node's own sockets (sent straight to backends by the socket hooks) take
/// ephemeral ports the kernel picks without seeing this table, so a
/// masqueraded flow holding one towards the same backend would take that
/// socket's replies.
#[unsafe(no_mangle)]
static SNAT_PORT_MIN: Global<u32> = Global::new(DEFAULT_SNAT_PORTS.0 as u32);
#[unsafe(no_mangle)]
static SNAT_PORT_MAX: Global<u32> = Global::new(DEFAULT_SNAT_PORTS.1 as u32);

/// The node's ephemeral ports (host order, inclusive, at or above
/// TCP_SNAT_PORT_LOW), set by the agent at load: TCP draws around them. TCP
/// can draw from the whole rest of the port space, not only SNAT_PORT_*,
/// because it asks the node's socket table whether a port is in use.
#[unsafe(no_mangle)]
static EPHEMERAL_PORT_MIN: Global<u32> = Global::new(DEFAULT_EPHEMERAL_PORTS.0 as u32);
#[unsafe(no_mangle)]
static EPHEMERAL_PORT_MAX: Global<u32> = Global::new(DEFAULT_EPHEMERAL_PORTS.1 as u32);

/// The source (address, port in network order) this masqueraded flow leaves
/// with out of interface `ifindex`: the one chosen for its first packet,
/// else a new one. (TC egress asks; so does XDP, sending a frame out itself.)
#[inline(always)]
pub fn source_for<F: Family>(ctx: &impl EbpfContext, ifindex: u32, pkt: &Packet) -> Option<(Addr, u16)> {
    let t = &pkt.tuple;
    if let Some(e) = conntrack::snat_choice(t) {
        if pkt.closes_connection() {
            conntrack::close_snat_reply(&snat_key(t, &e.addr, e.port));
        }
        return Some((e.addr, e.port));
    }
    // The flow's plain reply entry, written at ingress, names the frontend.
    // The tries below hold a copy of the frontend, not the reference: it
    // points into one of two tables, and the verifier would walk every try
    // once per table. The entry is looked up again to claim the port.
    let plain_key = conntrack::reply_key(t, &t.dst, t.dport);
    let plain = conntrack::lookup(&plain_key).filter(|e| e.direction == CT_REPLY)?;
    let (frontend, frontend_port) = (plain.nat_addr, plain.nat_port);
    // Each family's addresses under their own keys.
    let family = if F::V6 { SNAT_ADDR_IPV6 } else { 0 };
    let key = ifindex | family;
    let addr = unsafe { SNAT_ADDRS.get(&key).or_else(|| SNAT_ADDRS.get(&family)) }.copied()?;

    // Keep the client's port if its tuple towards the backend is free (as
    // Linux NAT keeps it), else try random ones; the reply entries are the
    // port table. TCP keeps any port no node socket holds and draws outside
    // the ephemeral range; UDP and SCTP, which cannot ask the socket table
    // cheaply, keep and draw only inside SNAT_PORT_*. If every try fails,
    // the client's port after all, counted: a TCP tuple the backend may
    // still hold in TIME_WAIT, a UDP/SCTP one a node socket may share.
    let tcp = pkt.proto == IPPROTO_TCP;
    let ports = if tcp { Ports::tcp()? } else { Ports::outside_ephemeral()? };
    let keep_first = tcp || ports.holds(t.sport);
    // The verifier walks every try once per distinct state that reaches
    // it, so the tries carry as little as they can: they only look for a
    // free port (the key is built once, each try changes its port, and the
    // port found is claimed after the loop), and the first try's port is
    // set before the loop, so `keep_first` is dead inside it. With the
    // frontend copy above, that took tc_egress from 226,000 instructions
    // walked to 68,000 (`RUST_LOG=proxy_user=debug` shows the counts).
    let mut key = snat_key(t, &addr, t.sport);
    if !keep_first {
        key.dport = ports.draw();
    }
    let mut found = None;
    for i in 0..=PORT_TRIES + 1 {
        let last_resort = i == PORT_TRIES + 1;
        if last_resort {
            key.dport = t.sport;
        } else if i > 0 {
            key.dport = ports.draw();
        }
        let usable = match conntrack::snat_tuple(&key, &frontend, frontend_port, &t.src, t.sport) {
            SnatTuple::Free => true,
            SnatTuple::Reserved => last_resort,
            SnatTuple::Held => false,
        };
        if usable && !(tcp && socket_holds::<F>(ctx, &key)) {
            found = Some(last_resort);
            break;
        }
    }
    let last_resort = found?;
    let port = key.dport;
    let plain = conntrack::lookup(&plain_key).filter(|e| e.direction == CT_REPLY)?;
    conntrack::claim_snat_reply(&key, plain, &t.src, t.sport).ok()?;
    if last_resort {
        count(Counter::SnatPortShared);
    }
    if tcp && Ports::ephemeral(port) {
        arm_node_flows();
    }
    let entry = SnatEntry { addr, port, _pad: [0; 6] };
    if conntrack::record_snat_choice(t, &entry).is_err() {
        count(Counter::SnatFailed);
    }
    // The flow's own entry (client -> frontend) under `key`, whose stack
    // slot is free now: the stack has no room for another key.
    key = CtKey { dst: frontend, dport: frontend_port, ..*t };
    conntrack::keep_snat_choice_in_flow(&key, &t.dst, t.dport, &entry);
    Some((addr, port))
}

/// Ports to draw from (host order): `span` ports from `low`, skipping the
/// `hole_len` ports from `hole_at`.
struct Ports {
    low: u32,
    // NonZero: a division the verifier can see has no panic path.
    span: NonZeroU32,
    hole_at: u32,
    hole_len: u32,
}

impl Ports {
    /// TCP's: from TCP_SNAT_PORT_LOW up, around the ephemeral ports.
    #[inline(always)]
    fn tcp() -> Option<Ports> {
        let (hole_at, hole_len) = Self::ephemeral_range();
        let low = TCP_SNAT_PORT_LOW as u32;
        Some(Ports { low, span: NonZeroU32::new(65536 - low - hole_len)?, hole_at, hole_len })
    }

    /// UDP's and SCTP's: SNAT_PORT_*.
    #[inline(always)]
    fn outside_ephemeral() -> Option<Ports> {
        let low = SNAT_PORT_MIN.load();
        let span = NonZeroU32::new(SNAT_PORT_MAX.load().wrapping_sub(low).wrapping_add(1))?;
        Some(Ports { low, span, hole_at: u32::MAX, hole_len: 0 })
    }

    #[inline(always)]
    fn ephemeral_range() -> (u32, u32) {
        let (min, max) = (EPHEMERAL_PORT_MIN.load(), EPHEMERAL_PORT_MAX.load());
        (min, max.wrapping_sub(min).wrapping_add(1))
    }

    /// Whether `port` (network order) is one of the node's ephemeral ports.
    #[inline(always)]
    fn ephemeral(port: u16) -> bool {
        let (min, len) = Self::ephemeral_range();
        (u16::from_be(port) as u32).wrapping_sub(min) < len
    }

    /// Whether `port` (network order) lies in the span (a hole aside).
    #[inline(always)]
    fn holds(&self, port: u16) -> bool {
        (u16::from_be(port) as u32).wrapping_sub(self.low) < self.span.get()
    }

    /// A random one, in network order.
    #[inline(always)]
    fn draw(&self) -> u16 {
        let mut p = self.low + unsafe { bpf_get_prandom_u32() } % self.span;
        if p >= self.hole_at {
            p += self.hole_len;
        }
        (p as u16).to_be()
    }
}

/// Whether a node socket's connection may meet a masqueraded flow's tuple:
/// only once masquerade kept a TCP client port inside the node's ephemeral
/// range (the kernel may hand the same port to a node socket later). Until
/// then egress never looks at node sockets' packets.
#[inline(always)]
pub fn node_flows_armed() -> bool {
    NODE_SNAT.get(0).is_some_and(|armed| *armed != 0)
}

#[inline(always)]
fn arm_node_flows() {
    if let Some(armed) = NODE_SNAT.get_ptr_mut(0) {
        unsafe { *armed = 1 };
    }
}

/// The source a node socket's TCP packet leaves with, if not its own: Linux
/// NAT gives a local connection whose tuple a NATed flow already holds
/// another source port, and so does this. A SYN whose tuple towards the
/// backend is a masqueraded flow's (open, or closed and still reserved for
/// the backend's TIME_WAIT) gets a port drawn as for a masqueraded flow,
/// with a reply entry sending the backend's replies back to the socket's
/// own port; the connection's later packets find it in SNAT. The address
/// stays the socket's.
#[inline(always)]
pub fn node_source_for<F: Family>(ctx: &TcContext, pkt: &Packet) -> Option<(Addr, u16)> {
    let t = &pkt.tuple;
    // The replies as the socket expects them: from the backend itself.
    // A node socket's connection: its first reply confirms it.
    let own = CtEntry {
        nat_addr: t.dst,
        nat_port: t.dport,
        direction: CT_REPLY,
        flags: CT_CONFIRM_ON_REPLY,
        ..Default::default()
    };
    let ours = conntrack::snat_choice(t).filter(|e| e.addr == t.src).copied();
    if let Some(e) = ours {
        let key = snat_key(t, &e.addr, e.port);
        // A SYN on a tuple whose earlier connection closed is a new
        // connection: it is looked at afresh below.
        let current = !pkt.opens_connection() || conntrack::lookup(&key).is_some_and(|r| r.flags & CT_CLOSING == 0);
        if current {
            if pkt.closes_connection() {
                conntrack::close_snat_reply(&key);
            }
            return Some((e.addr, e.port));
        }
    }
    if !pkt.opens_connection() {
        return None;
    }
    if !conntrack::masquerade_holds(&snat_key(t, &t.src, t.sport), &own, &t.src, t.sport) {
        if ours.is_some() {
            // A SNAT choice left by an earlier connection on this tuple.
            conntrack::forget_snat_choice(t);
        }
        return None;
    }
    if ours.is_some() {
        // The earlier connection's choice, confirmed: this one draws afresh.
        conntrack::forget_snat_choice(t);
    }
    let ports = Ports::tcp()?;
    let mut key = snat_key(t, &t.src, t.sport);
    for _ in 0..PORT_TRIES {
        key.dport = ports.draw();
        if conntrack::snat_tuple(&key, &own.nat_addr, own.nat_port, &t.src, t.sport) != SnatTuple::Free
            || socket_holds::<F>(ctx, &key)
        {
            continue;
        }
        let port = key.dport;
        conntrack::claim_snat_reply(&key, &own, &t.src, t.sport).ok()?;
        let entry = SnatEntry { addr: t.src, port, _pad: [0; 6] };
        if conntrack::record_snat_choice(t, &entry).is_err() {
            count(Counter::SnatFailed);
        }
        count(Counter::NodeSnat);
        return Some((t.src, port));
    }
    count(Counter::SnatFailed);
    None
}

/// Whether a node socket holds the tuple of `reply` (backend -> node
/// address:port): a connection, a TIME_WAIT, or a listener on that port.
/// Its replies would meet the masqueraded flow's. Looked up in the netns of
/// the interface, the node's.
#[inline(always)]
fn socket_holds<F: Family>(ctx: &impl EbpfContext, reply: &CtKey) -> bool {
    let mut tuple: bpf_sock_tuple = unsafe { core::mem::zeroed() };
    let size = unsafe {
        if F::V6 {
            let t = &mut tuple.__bindgen_anon_1.ipv6;
            t.saddr = core::mem::transmute::<[u8; 16], [u32; 4]>(reply.src.0);
            t.daddr = core::mem::transmute::<[u8; 16], [u32; 4]>(reply.dst.0);
            t.sport = reply.sport;
            t.dport = reply.dport;
            core::mem::size_of_val(t)
        } else {
            let t = &mut tuple.__bindgen_anon_1.ipv4;
            t.saddr = u32::from_ne_bytes(reply.src.v4_octets());
            t.daddr = u32::from_ne_bytes(reply.dst.v4_octets());
            t.sport = reply.sport;
            t.dport = reply.dport;
            core::mem::size_of_val(t)
        }
    };
    let sk = unsafe { bpf_skc_lookup_tcp(ctx.as_ptr(), &mut tuple, size as u32, BPF_F_CURRENT_NETNS as u64, 0) };
    if sk.is_null() {
        return false;
    }
    unsafe { bpf_sk_release(sk as *mut _) };
    true
}

/// The tuple the replies of flow `t` (after DNAT) carry once its source is
/// `addr:port`: the key of its SNAT reply entry.
#[inline(always)]
fn snat_key(t: &CtKey, addr: &Addr, port: u16) -> CtKey {
    CtKey { src: t.dst, dst: *addr, sport: t.dport, dport: port, proto: t.proto, _pad: [0; 3] }
}
