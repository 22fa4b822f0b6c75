//! The datapath: parse -> conntrack -> service lookup -> backend choice ->
//! NAT rewrite -> verdict. One program, attached at TC ingress of every node
//! interface, so the kernel routes the translated packet.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]

#[cfg(target_arch = "bpf")]
mod conntrack;
#[cfg(target_arch = "bpf")]
mod lb;
#[cfg(target_arch = "bpf")]
mod maps;
#[cfg(target_arch = "bpf")]
mod masquerade;
#[cfg(target_arch = "bpf")]
mod nat;
#[cfg(target_arch = "bpf")]
mod nat6;
#[cfg(target_arch = "bpf")]
mod parse;
#[cfg(target_arch = "bpf")]
mod parse6;
#[cfg(target_arch = "bpf")]
mod reject;
#[cfg(target_arch = "bpf")]
mod reject6;
#[cfg(target_arch = "bpf")]
mod sctp;
#[cfg(target_arch = "bpf")]
mod skb;
#[cfg(target_arch = "bpf")]
mod sock;
#[cfg(target_arch = "bpf")]
mod trace;

#[cfg(target_arch = "bpf")]
mod program {
    use aya_ebpf::{
        bindings::{TC_ACT_OK, TC_ACT_SHOT, TC_ACT_UNSPEC},
        macros::{cgroup_sock_addr, classifier},
        programs::{SockAddrContext, TcContext},
    };
    use proxy_common::{
        CT_CLOSING, CT_MASQUERADE, CT_ORIGINAL, CT_REPLY, Counter, IPPROTO_TCP, IPV6_PROG_EGRESS, IPV6_PROG_INGRESS,
        IPV6_PROG_MASQUERADE, IPV6_PROG_TRACE, MASQUERADE_MARK, REVERSE_NAT_MARK, SVC_DROP_IF_EMPTY, SVC_MASQUERADE,
        SVC_SOURCE_RANGES,
    };

    use crate::{
        conntrack,
        lb::{self, Miss},
        maps::{IPV6_PROGRAMS, count},
        masquerade, nat, nat6, parse, parse6, reject, reject6, skb, sock, trace,
    };

    /// Leaves the packet to whatever runs next (TCX_NEXT / TC_ACT_UNSPEC).
    const NOT_OURS: i32 = TC_ACT_UNSPEC;
    const DROP: i32 = TC_ACT_SHOT as i32;

    #[classifier]
    pub fn tc_ingress(ctx: TcContext) -> i32 {
        if skb::is_ipv6(&ctx) {
            return to_ipv6::<false>(&ctx, IPV6_PROG_INGRESS);
        }
        ingress::<false, false>(&ctx)
    }

    /// `tc_ingress` for IPv6 frames, reached by tail call from it.
    #[classifier]
    pub fn tc_ingress6(ctx: TcContext) -> i32 {
        ingress::<false, true>(&ctx)
    }

    /// `ebpf-proxy trace`: the same decisions on a synthetic packet (run with
    /// BPF_PROG_TEST_RUN), reported instead of counted, and without touching
    /// conntrack or affinity.
    #[classifier]
    pub fn tc_trace(ctx: TcContext) -> i32 {
        if skb::is_ipv6(&ctx) {
            return to_ipv6::<true>(&ctx, IPV6_PROG_TRACE);
        }
        ingress::<true, false>(&ctx)
    }

    #[classifier]
    pub fn tc_trace6(ctx: TcContext) -> i32 {
        ingress::<true, true>(&ctx)
    }

    /// Hands an IPv6 frame to the IPv6 program in `slot`. A tail call, not a
    /// function call: each family's program has the whole 512-byte stack.
    /// Returns only if that program is missing (counted, left alone).
    #[inline(always)]
    fn to_ipv6<const TRACE: bool>(ctx: &TcContext, slot: u32) -> i32 {
        let _ = unsafe { IPV6_PROGRAMS.tail_call(ctx, slot) };
        note::<TRACE>(Counter::Passed);
        NOT_OURS
    }

    #[inline(always)]
    fn ingress<const TRACE: bool, const V6: bool>(ctx: &TcContext) -> i32 {
        let parsed = if V6 { parse6::parse(ctx) } else { parse::parse(ctx) };
        let pkt = match parsed {
            Ok(pkt) => pkt,
            Err(reason) => {
                note::<TRACE>(reason);
                return NOT_OURS;
            }
        };

        // A known flow: one lookup finds its translation in either direction.
        // A SYN after the old connection's FIN or RST opens a new one; any
        // other SYN is a retransmission and must reach the same backend.
        let reopens = |ct: &&mut proxy_common::CtEntry| ct.direction == CT_ORIGINAL && ct.flags & CT_CLOSING != 0 && pkt.opens_connection();
        let known = conntrack::lookup_mut(&pkt.tuple).filter(|ct| !reopens(ct));
        if let Some(ct) = known {
            trace::record::<TRACE>(ct.service_id, ct.backend_id, trace::FROM_CONNTRACK);
            let direction = ct.direction;
            match direction {
                CT_REPLY => {
                    if !TRACE {
                        conntrack::touch(ct, pkt.closes_connection());
                    }
                    let mut done = Ok(());
                    if ct.flags & CT_MASQUERADE != 0 {
                        // Addressed to the SNAT address and port: back to the client.
                        done = nat::rewrite_dst(ctx, &pkt, &ct.rev_addr, ct.rev_port);
                    }
                    // The source becomes the frontend at egress, after routing.
                    set_mark(ctx, REVERSE_NAT_MARK);
                    return verdict::<TRACE>(done, Counter::Reply);
                }
                CT_ORIGINAL if lb::backend_still_matches(ct, !TRACE) => {
                    if !TRACE {
                        conntrack::touch(ct, pkt.closes_connection());
                    }
                    if ct.flags & CT_MASQUERADE != 0 {
                        set_mark(ctx, MASQUERADE_MARK);
                    }
                    return verdict::<TRACE>(nat::rewrite_dst(ctx, &pkt, &ct.nat_addr, ct.nat_port), Counter::Established);
                }
                // The backend is gone: choose again below, so the flow moves to a
                // live backend instead of black-holing.
                _ => note::<TRACE>(Counter::Rebalanced),
            }
        }

        let scope = lb::scope_of(&pkt.tuple.src);
        let service = match lb::lookup_frontend(&pkt.tuple, scope) {
            Ok(service) => service,
            Err(Miss::NotOurs) => {
                note::<TRACE>(Counter::Passed);
                return NOT_OURS;
            }
            Err(Miss::Reject) => return reject_packet::<TRACE, V6>(ctx, &pkt),
            Err(Miss::DropUnallocated) => {
                note::<TRACE>(Counter::DropUnallocated);
                return DROP;
            }
        };
        trace::record::<TRACE>(service.service_id, 0, scope as u32);
        if service.flags & SVC_SOURCE_RANGES != 0 && !lb::source_allowed(&service, &pkt.tuple.src) {
            note::<TRACE>(Counter::DropSourceRange);
            return DROP;
        }
        let epoch = lb::backends_epoch();
        let Some((backend_id, backend, sticky)) = lb::choose_backend(&service, &pkt.tuple.src, !TRACE) else {
            if service.flags & SVC_DROP_IF_EMPTY != 0 {
                note::<TRACE>(Counter::DropNoLocal);
                return DROP;
            }
            note::<TRACE>(Counter::NoBackend);
            return reject_packet::<TRACE, V6>(ctx, &pkt);
        };
        if sticky {
            note::<TRACE>(Counter::AffinityHit);
        }
        // Hairpin: a pod reaching itself through its Service must see the
        // node as the source, or its reply would skip the reverse NAT.
        let masquerade = service.flags & SVC_MASQUERADE != 0 || backend.addr == pkt.tuple.src;
        trace::record::<TRACE>(service.service_id, backend_id, scope as u32);
        if !TRACE {
            let ct_flags = if masquerade { CT_MASQUERADE } else { 0 };
            if conntrack::create(&pkt.tuple, &service, backend_id, &backend, ct_flags, epoch).is_err() {
                count(Counter::CtFull);
            }
        }
        if masquerade {
            note::<TRACE>(Counter::Masqueraded);
            set_mark(ctx, MASQUERADE_MARK);
        }
        verdict::<TRACE>(nat::rewrite_dst(ctx, &pkt, &backend.addr, backend.port), Counter::NewFlow)
    }

    /// Counts, or in a trace notes the counter in the result.
    #[inline(always)]
    fn note<const TRACE: bool>(counter: Counter) {
        if TRACE { trace::note(counter) } else { count(counter) }
    }

    /// The source rewrites ingress marked, now that routing chose the
    /// interface: SNAT of masqueraded flows, and replies' frontend address.
    #[classifier]
    pub fn tc_egress(ctx: TcContext) -> i32 {
        egress::<false>(&ctx)
    }

    /// `tc_egress` for IPv6 frames, reached by tail call from it.
    #[classifier]
    pub fn tc_egress6(ctx: TcContext) -> i32 {
        egress::<true>(&ctx)
    }

    /// IPv6 masquerade, reached by tail call from `tc_egress6` (mark already
    /// cleared): the IPv6 packet cannot live in registers, and with the
    /// reverse-NAT path in the same frame the stack would pass 512 bytes.
    #[classifier]
    pub fn tc_masquerade6(ctx: TcContext) -> i32 {
        let Ok(pkt) = parse6::parse_in_place(&ctx) else { return NOT_OURS };
        let Some((addr, port)) = masquerade::source_for(&ctx, &pkt) else {
            count(Counter::SnatFailed);
            return NOT_OURS;
        };
        match nat6::rewrite_src(&ctx, &pkt, &addr, port) {
            Ok(()) => TC_ACT_OK as i32,
            Err(_) => {
                count(Counter::RewriteFailed);
                DROP
            }
        }
    }

    #[inline(always)]
    fn egress<const V6: bool>(ctx: &TcContext) -> i32 {
        let mark = crate::skb::mark(ctx);
        if mark & (MASQUERADE_MARK | REVERSE_NAT_MARK) == 0 {
            // A node socket's own connection: translated only if it met a
            // masqueraded flow's tuple (see masquerade::node_source_for).
            if skb::from_local_socket(ctx) && masquerade::node_flows_armed() {
                if !V6 && skb::is_ipv6(ctx) {
                    return to_ipv6::<false>(ctx, IPV6_PROG_EGRESS);
                }
                return node_flow::<V6>(ctx);
            }
            return NOT_OURS;
        }
        if !V6 && skb::is_ipv6(ctx) {
            return to_ipv6::<false>(ctx, IPV6_PROG_EGRESS);
        }
        ctx.set_mark(mark & !(MASQUERADE_MARK | REVERSE_NAT_MARK));
        if V6 && mark & MASQUERADE_MARK != 0 {
            let _ = unsafe { IPV6_PROGRAMS.tail_call(ctx, IPV6_PROG_MASQUERADE) };
            count(Counter::SnatFailed);
            return NOT_OURS;
        }
        let parsed = if V6 { parse6::parse(ctx) } else { parse::parse(ctx) };
        let Ok(pkt) = parsed else { return NOT_OURS };
        let source = if mark & MASQUERADE_MARK != 0 {
            masquerade::source_for(ctx, &pkt)
        } else {
            conntrack::lookup(&pkt.tuple).filter(|e| e.direction == CT_REPLY).map(|e| (e.nat_addr, e.nat_port))
        };
        let Some((addr, port)) = source else {
            count(Counter::SnatFailed);
            return NOT_OURS;
        };
        match nat::rewrite_src(ctx, &pkt, &addr, port) {
            Ok(()) => TC_ACT_OK as i32,
            Err(_) => {
                count(Counter::RewriteFailed);
                DROP
            }
        }
    }

    #[inline(always)]
    fn node_flow<const V6: bool>(ctx: &TcContext) -> i32 {
        let parsed = if V6 { parse6::parse(ctx) } else { parse::parse(ctx) };
        let Ok(pkt) = parsed else { return NOT_OURS };
        if pkt.proto != IPPROTO_TCP {
            return NOT_OURS;
        }
        let Some((addr, port)) = masquerade::node_source_for(ctx, &pkt) else { return NOT_OURS };
        match nat::rewrite_src(ctx, &pkt, &addr, port) {
            Ok(()) => TC_ACT_OK as i32,
            Err(_) => {
                count(Counter::RewriteFailed);
                DROP
            }
        }
    }

    #[cgroup_sock_addr(connect4)]
    pub fn sock_connect4(ctx: SockAddrContext) -> i32 {
        sock::learn_node_netns(&ctx);
        sock::translate(&ctx, sock::Family::V4)
    }

    #[cgroup_sock_addr(sendmsg4)]
    pub fn sock_sendmsg4(ctx: SockAddrContext) -> i32 {
        sock::translate(&ctx, sock::Family::V4)
    }

    #[cgroup_sock_addr(recvmsg4)]
    pub fn sock_recvmsg4(ctx: SockAddrContext) -> i32 {
        sock::reverse(&ctx, sock::Family::V4)
    }

    #[cgroup_sock_addr(getpeername4)]
    pub fn sock_getpeername4(ctx: SockAddrContext) -> i32 {
        sock::reverse(&ctx, sock::Family::V4)
    }

    #[cgroup_sock_addr(connect6)]
    pub fn sock_connect6(ctx: SockAddrContext) -> i32 {
        sock::translate(&ctx, sock::Family::V6)
    }

    #[cgroup_sock_addr(sendmsg6)]
    pub fn sock_sendmsg6(ctx: SockAddrContext) -> i32 {
        sock::translate(&ctx, sock::Family::V6)
    }

    #[cgroup_sock_addr(recvmsg6)]
    pub fn sock_recvmsg6(ctx: SockAddrContext) -> i32 {
        sock::reverse(&ctx, sock::Family::V6)
    }

    #[cgroup_sock_addr(getpeername6)]
    pub fn sock_getpeername6(ctx: SockAddrContext) -> i32 {
        sock::reverse(&ctx, sock::Family::V6)
    }

    #[inline(always)]
    fn set_mark(ctx: &TcContext, bits: u32) {
        ctx.set_mark(crate::skb::mark(ctx) | bits);
    }

    #[inline(always)]
    fn reject_packet<const TRACE: bool, const V6: bool>(ctx: &TcContext, pkt: &parse::Packet) -> i32 {
        if pkt.tcp_flags & parse::TCP_RST != 0 {
            note::<TRACE>(Counter::RejectSuppressed);
            return DROP;
        }
        let rejected = if V6 { reject6::reject(ctx, pkt) } else { reject::reject(ctx, pkt) };
        match rejected {
            Ok(redirect) => {
                note::<TRACE>(Counter::Rejected);
                redirect
            }
            Err(_) => {
                note::<TRACE>(Counter::RejectFailed);
                DROP
            }
        }
    }

    /// A failed rewrite may have left the packet half-changed: drop it rather
    /// than send it on with a wrong address or checksum.
    #[inline(always)]
    fn verdict<const TRACE: bool>(rewrite: Result<(), i64>, counter: Counter) -> i32 {
        match rewrite {
            Ok(()) => {
                note::<TRACE>(counter);
                TC_ACT_OK as i32
            }
            Err(_) => {
                note::<TRACE>(Counter::RewriteFailed);
                TC_ACT_SHOT as i32
            }
        }
    }

    #[panic_handler]
    fn panic(_info: &core::panic::PanicInfo) -> ! {
        loop {}
    }

    #[unsafe(link_section = "license")]
    #[unsafe(no_mangle)]
    static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
}

#[cfg(not(target_arch = "bpf"))]
fn main() {}
