//! The datapath: parse -> conntrack -> service lookup -> backend choice ->
//! NAT rewrite -> verdict. One program, attached at TC ingress of every node
//! interface, so the kernel routes the translated packet; the same
//! decisions run in XDP on the external devices (`--xdp-devices`, see
//! `hook` and `xdp`).
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]

#[cfg(target_arch = "bpf")]
mod conntrack;
#[cfg(target_arch = "bpf")]
mod context;
#[cfg(target_arch = "bpf")]
mod family;
#[cfg(target_arch = "bpf")]
mod fragment;
#[cfg(target_arch = "bpf")]
mod headers;
#[cfg(target_arch = "bpf")]
mod hook;
#[cfg(target_arch = "bpf")]
mod icmp;
#[cfg(target_arch = "bpf")]
mod l2;
#[cfg(target_arch = "bpf")]
mod lb;
#[cfg(target_arch = "bpf")]
mod maps;
#[cfg(target_arch = "bpf")]
mod masquerade;
#[cfg(target_arch = "bpf")]
mod nat;
#[cfg(target_arch = "bpf")]
mod packet;
#[cfg(target_arch = "bpf")]
mod parse;
#[cfg(target_arch = "bpf")]
mod reject;
#[cfg(target_arch = "bpf")]
mod route;
#[cfg(target_arch = "bpf")]
mod sctp;
#[cfg(target_arch = "bpf")]
mod skb;
#[cfg(target_arch = "bpf")]
mod sock;
#[cfg(target_arch = "bpf")]
mod trace;
#[cfg(target_arch = "bpf")]
mod xdp;
#[cfg(target_arch = "bpf")]
mod xdp_forward;

#[cfg(target_arch = "bpf")]
mod program {
    use aya_ebpf::{
        bindings::{TC_ACT_OK, TC_ACT_SHOT, TC_ACT_UNSPEC},
        bindings::xdp_action::XDP_PASS,
        macros::{cgroup_sock_addr, classifier, xdp},
        programs::{SockAddrContext, TcContext, XdpContext},
    };
    use aya_ebpf::{bindings::BPF_F_INGRESS, helpers::bpf_redirect};
    use proxy_common::{
        CT_CONFIRM_ON_REPLY, CT_LOOPBACK, CT_MASQUERADE, CT_NODE, CT_ORIGINAL, CT_PENDING, CT_REPLY, Counter,
        FRAGMENT_PROG_EGRESS, FRAGMENT_PROG_EGRESS6, FRAGMENT_PROG_INGRESS, FRAGMENT_PROG_INGRESS6,
        ICMP_PROG_EGRESS, ICMP_PROG_EGRESS6, ICMP_PROG_INGRESS, ICMP_PROG_INGRESS6, IPPROTO_TCP, IPV6_PROG_EGRESS,
        IPV6_PROG_INGRESS, IPV6_PROG_MASQUERADE, IPV6_PROG_TRACE, LOOPBACK_IFINDEX,
        MASQUERADE_MARK, NODE_PROG_EGRESS, NODE_PROG_FLOW, NODE_PROG_INGRESS_REPLY, NODE6_PROG_EGRESS, NODE6_PROG_FLOW,
        NODE6_PROG_INGRESS_REPLY, REJECT_PROG_V4, REJECT_PROG_V6, REVERSE_NAT_MARK, SCOPE_INTERNAL, SVC_DROP_IF_EMPTY, SVC_MASQUERADE,
        SVC_SOURCE_RANGES, reject_limit::RejectBudget,
    };

    use crate::{
        conntrack::{self, Confirming},
        headers::{TCP_SEQ_OFF, TCP_ACK_OFF, TCP_RST},
        family::{Family, V4, V6},
        fragment,
        hook::Hook,
        lb::{self, Miss},
        icmp,
        maps::{
            FRAGMENT_PROGRAMS, ICMP_PROGRAMS, IPV6_PROGRAMS, NODE6_PROGRAMS, NODE_PROGRAMS, REJECT_BUDGETS, REJECT_PROGRAMS,
            count,
        },
        masquerade, nat, packet, parse, reject, route, skb, sock, trace, xdp as xdp_handoff, xdp_forward,
    };

    /// Leaves the packet to whatever runs next (TCX_NEXT / TC_ACT_UNSPEC).
    const NOT_OURS: i32 = TC_ACT_UNSPEC;
    const DROP: i32 = TC_ACT_SHOT as i32;

    #[classifier]
    pub fn tc_ingress(ctx: TcContext) -> i32 {
        // Decided by xdp_ingress already: only its marks are left to set.
        if let Some(marks) = xdp_handoff::translated_marks(&ctx) {
            if marks != 0 {
                set_mark(&ctx, marks);
            }
            return TC_ACT_OK as i32;
        }
        if skb::is_ipv6(&ctx) {
            return to_ipv6::<false>(&ctx, IPV6_PROG_INGRESS);
        }
        ingress::<false, V4, _>(&ctx)
    }

    /// `tc_ingress` for IPv6 frames, reached by tail call from it.
    #[classifier]
    pub fn tc_ingress6(ctx: TcContext) -> i32 {
        ingress::<false, V6, _>(&ctx)
    }

    /// Ingress's decisions in XDP, on the external devices: what it
    /// translates goes up the stack with its marks for TC (see `xdp`); what
    /// it cannot finish, untouched to TC. IPv4 only: IPv6 frames go to TC
    /// (in XDP, LLVM spills IPv6's byte-wise address copies into a frame
    /// of 584 bytes, past the kernel's 512).
    #[xdp]
    pub fn xdp_ingress(ctx: XdpContext) -> u32 {
        // The handoff first, for every frame: it replaces any stale one.
        if !xdp_handoff::reserve_handoff(&ctx) || !xdp_handoff::is_ipv4(&ctx) {
            return XDP_PASS;
        }
        let verdict = ingress::<false, V4, _>(&ctx) as u32;
        // (A translated frame was counted before xdp_send_out's tail call.)
        if verdict != XDP_PASS {
            count(Counter::XdpFinished);
        }
        verdict
    }

    /// A frame xdp_ingress translated, by tail call from it: sent out by
    /// XDP where it can be, else up the stack (see `xdp_forward`).
    #[xdp]
    pub fn xdp_send_out(ctx: XdpContext) -> u32 {
        xdp_forward::send_out(&ctx)
    }

    /// `ebpf-proxy trace`: the same decisions on a synthetic packet (run with
    /// BPF_PROG_TEST_RUN), reported instead of counted, and without touching
    /// conntrack or affinity.
    #[classifier]
    pub fn tc_trace(ctx: TcContext) -> i32 {
        if skb::is_ipv6(&ctx) {
            return to_ipv6::<true>(&ctx, IPV6_PROG_TRACE);
        }
        ingress::<true, V4, _>(&ctx)
    }

    #[classifier]
    pub fn tc_trace6(ctx: TcContext) -> i32 {
        ingress::<true, V6, _>(&ctx)
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

    /// A later fragment of a UDP datagram, from `tc_ingress(6)` by tail call
    /// (see `fragment`): it follows the flow its first fragment found, or
    /// made, and gets the same translation, addresses only. Its first was
    /// translated by ingress itself, so this needs no more than conntrack
    /// (a small program, cheap to verify).
    #[classifier]
    pub fn tc_ingress_fragment(ctx: TcContext) -> i32 {
        later_fragment_in::<V4>(&ctx)
    }

    #[classifier]
    pub fn tc_ingress_fragment6(ctx: TcContext) -> i32 {
        later_fragment_in::<V6>(&ctx)
    }

    #[inline(always)]
    fn later_fragment_in<F: Family>(ctx: &TcContext) -> i32 {
        let parsed = parse::parse_fragment::<F>(ctx);
        let pkt = match parsed {
            Ok(pkt) => pkt,
            Err(reason) => {
                count(reason);
                return NOT_OURS;
            }
        };
        // No flow (its first was dropped, or not ours), or a node socket's
        // (not followed): left alone.
        let Some(ct) = conntrack::lookup(&pkt.tuple).filter(|ct| ct.flags & CT_NODE == 0) else {
            count(Counter::Fragment);
            return NOT_OURS;
        };
        let masquerade = ct.flags & CT_MASQUERADE != 0;
        if ct.direction == CT_REPLY {
            let done = if masquerade { nat::rewrite_dst_address::<F>(ctx, &pkt, &ct.rev_addr) } else { Ok(()) };
            set_mark(ctx, REVERSE_NAT_MARK);
            return verdict::<false>(done, Counter::Reply);
        }
        if masquerade {
            set_mark(ctx, MASQUERADE_MARK);
        }
        verdict::<false>(nat::rewrite_dst_address::<F>(ctx, &pkt, &ct.nat_addr), Counter::Established)
    }

    #[inline(always)]
    fn ingress<const TRACE: bool, F: Family, H: Hook>(ctx: &H) -> i32 {
        let parsed = parse::parse::<F>(ctx);
        let pkt = match parsed {
            Ok(pkt) => pkt,
            Err(_) if !H::FINISHES_ALL => return H::NOT_OURS,
            Err(reason) => {
                if !TRACE && reason == Counter::Passed && icmp::ip_protocol::<F>(ctx).is_some() {
                    // An IP protocol parse leaves alone (ICMP, GRE, ESP...):
                    // tc_icmp_error_in(6), which counts.
                    let _ = unsafe { ICMP_PROGRAMS.tail_call(ctx, if F::V6 { ICMP_PROG_INGRESS6 } else { ICMP_PROG_INGRESS }) };
                }
                if !TRACE && reason == Counter::Fragment {
                    // tc_ingress_fragment(6), which counts.
                    let slot = if F::V6 { FRAGMENT_PROG_INGRESS6 } else { FRAGMENT_PROG_INGRESS };
                    let _ = unsafe { FRAGMENT_PROGRAMS.tail_call(ctx, slot) };
                }
                note::<TRACE>(reason);
                return NOT_OURS;
            }
        };
        if !H::FINISHES_ALL && pkt.fragment != fragment::NOT_FRAGMENT {
            return H::NOT_OURS;
        }
        if !TRACE && pkt.fragment == fragment::FIRST {
            fragment::remember_first::<F>(ctx, &pkt);
        }

        // A known flow: one lookup finds its translation in either direction.
        if let Some(mut ct) = conntrack::lookup_flow(&pkt) {
            trace::record::<TRACE>(ct.service_id, ct.backend_id, trace::FROM_CONNTRACK);
            let direction = ct.direction;
            match direction {
                CT_REPLY => {
                    if !H::FINISHES_ALL && ct.flags & CT_NODE != 0 {
                        return H::NOT_OURS;
                    }
                    if !TRACE && ct.flags & CT_PENDING != 0 {
                        let Some(seen) = see_unconfirmed_reply(ctx, &pkt, ct) else { return H::NOT_OURS };
                        ct = seen;
                    }
                    if !TRACE {
                        conntrack::touch(ct, pkt.closes_connection());
                    }
                    // (Const first: an XDP program must not even name TC's
                    // program arrays, or the kernel refuses it after the
                    // verifier, EINVAL with no log.)
                    if H::FINISHES_ALL && !TRACE && ct.flags & CT_NODE != 0 {
                        // To a node socket: tc_ingress_node_reply(6).
                        let _ = if F::V6 {
                            unsafe { NODE6_PROGRAMS.tail_call(ctx, NODE6_PROG_INGRESS_REPLY) }
                        } else {
                            unsafe { NODE_PROGRAMS.tail_call(ctx, NODE_PROG_INGRESS_REPLY) }
                        };
                        note::<TRACE>(Counter::RewriteFailed);
                        return H::DROP;
                    }
                    let mut done = Ok(());
                    if ct.flags & CT_MASQUERADE != 0 {
                        // Addressed to the SNAT address and port: back to the client.
                        done = nat::rewrite_dst::<F>(ctx, &pkt, &ct.rev_addr, ct.rev_port);
                    }
                    // The source becomes the frontend at egress, after routing.
                    ctx.add_mark(REVERSE_NAT_MARK);
                    return finish::<TRACE, F, H>(ctx, done, Counter::Reply);
                }
                CT_ORIGINAL if lb::backend_still_matches(ct, !TRACE) => {
                    let acked = || ctx.load::<u32>(pkt.l4_off + TCP_ACK_OFF).ok();
                    if !TRACE && ct.flags & CT_PENDING != 0 && conntrack::completes_handshake(ct, &pkt, acked) {
                        if let Some(flow) = Confirming::of_original(&pkt.tuple, ct) {
                            flow.confirm();
                            let Some(moved) = conntrack::lookup_mut(&pkt.tuple) else { return H::NOT_OURS };
                            ct = moved;
                        }
                    }
                    if !TRACE {
                        conntrack::touch(ct, pkt.closes_connection());
                    }
                    if ct.flags & CT_MASQUERADE != 0 {
                        ctx.add_mark(MASQUERADE_MARK);
                        if ct.rev_port != 0 {
                            ctx.masquerade_source_known(&ct.rev_addr, ct.rev_port);
                        }
                    }
                    let done = nat::rewrite_dst::<F>(ctx, &pkt, &ct.nat_addr, ct.nat_port);
                    return finish::<TRACE, F, H>(ctx, done, Counter::Established);
                }
                // The backend is gone: choose again below, so the flow moves to a
                // live backend instead of black-holing.
                _ => {
                    let verdict = new_flow::<TRACE, F, false, H>(ctx, &pkt, true);
                    // XDP's pass is TC's to count (it decides again).
                    if H::FINISHES_ALL || verdict != H::NOT_OURS {
                        note::<TRACE>(Counter::Rebalanced);
                    }
                    return verdict;
                }
            }
        }

        new_flow::<TRACE, F, false, H>(ctx, &pkt, false)
    }

    /// A reply of an unconfirmed flow: it confirms the flow if it may (see
    /// `conntrack`), and the entry to go on with is returned (None: gone).
    #[inline(always)]
    fn see_unconfirmed_reply<'a>(
        ctx: &impl Hook,
        pkt: &'a packet::Packet,
        ct: &'a mut proxy_common::CtEntry,
    ) -> Option<&'a mut proxy_common::CtEntry> {
        let Some(flow) = Confirming::of_reply(&pkt.tuple, ct) else { return Some(ct) };
        // A TCP server sends a plain ACK only once its handshake completed:
        // that confirms too (the client's ACK may have gone unseen).
        if ct.flags & CT_CONFIRM_ON_REPLY != 0 || pkt.acks_only() {
            flow.confirm();
            return conntrack::lookup_mut(&pkt.tuple);
        }
        if pkt.answers_opening() {
            if let Ok(seq) = ctx.load::<u32>(pkt.l4_off + TCP_SEQ_OFF) {
                flow.expect_handshake_ack(seq);
            }
        }
        Some(ct)
    }

    /// The first packet of a flow, or one whose backend went away: the
    /// frontend's verdict, and for a new flow the backend chosen, recorded
    /// and written into the packet. `NODE`: a node socket's packet met at
    /// egress (in-cluster scope, as kube-proxy treats the node; always
    /// masqueraded, as its OUTPUT chain marks node traffic; a REJECT goes
    /// back into the node's own stack). `known`: the flow has an entry,
    /// whose backend went away.
    #[inline(always)]
    fn new_flow<const TRACE: bool, F: Family, const NODE: bool, H: Hook>(
        ctx: &H,
        pkt: &packet::Packet,
        known: bool,
    ) -> i32 {
        let scope = if NODE { SCOPE_INTERNAL } else { lb::scope_of(&pkt.tuple.src) };
        let service = match lb::lookup_frontend(&pkt.tuple, scope) {
            Ok(service) => service,
            Err(Miss::NotOurs) => {
                // Ingress counts what it passes; a node's own packets are not
                // counted twice.
                if !NODE && H::FINISHES_ALL {
                    note::<TRACE>(Counter::Passed);
                }
                return H::NOT_OURS;
            }
            Err(Miss::Reject) => return ctx.reject::<TRACE, F, NODE>(pkt),
            Err(Miss::DropUnallocated) => {
                note::<TRACE>(Counter::DropUnallocated);
                return H::DROP;
            }
        };
        trace::record::<TRACE>(service.service_id, 0, scope as u32);
        if service.flags & SVC_SOURCE_RANGES != 0 && !lb::source_allowed(&service, &pkt.tuple.src) {
            note::<TRACE>(Counter::DropSourceRange);
            return H::DROP;
        }
        // Only a connection's opening (or any UDP datagram) starts a flow:
        // a stray segment never gets a backend, nor evicts anything. (To a
        // Service without endpoints it is rejected below, as netfilter's
        // REJECT rule sees it too.)
        if !known && !pkt.may_open_flow() && service.backend_count != 0 {
            note::<TRACE>(Counter::CtOutOfState);
            return H::DROP;
        }
        let epoch = lb::backends_epoch();
        let Some(lb::Choice { backend_id, backend, sticky, maglev_cell }) = lb::choose_backend(&service, &pkt.tuple, !TRACE) else {
            if service.flags & SVC_DROP_IF_EMPTY != 0 {
                note::<TRACE>(Counter::DropNoLocal);
                return H::DROP;
            }
            if !H::FINISHES_ALL {
                // TC rejects it, and counts.
                return H::NOT_OURS;
            }
            note::<TRACE>(Counter::NoBackend);
            return ctx.reject::<TRACE, F, NODE>(pkt);
        };
        if sticky {
            note::<TRACE>(Counter::AffinityHit);
        }
        // Hairpin: a pod reaching itself through its Service must see the
        // node as the source, or its reply would skip the reverse NAT.
        let masquerade = NODE || service.flags & SVC_MASQUERADE != 0 || backend.addr == pkt.tuple.src;
        trace::record::<TRACE>(service.service_id, backend_id, scope as u32);
        trace::record_maglev_cell::<TRACE>(maglev_cell);
        if !TRACE {
            let mut ct_flags = if masquerade { CT_MASQUERADE } else { 0 };
            if NODE {
                ct_flags |= CT_NODE;
                if ctx.ifindex() == LOOPBACK_IFINDEX {
                    ct_flags |= CT_LOOPBACK;
                }
            }
            if conntrack::create(&pkt.tuple, &service, backend_id, &backend, ct_flags, epoch).is_err() {
                count(Counter::CtFull);
            }
        }
        if NODE {
            note::<TRACE>(Counter::NodeEgress);
        }
        if masquerade {
            note::<TRACE>(Counter::Masqueraded);
            ctx.add_mark(MASQUERADE_MARK);
        }
        finish::<TRACE, F, H>(ctx, nat::rewrite_dst::<F>(ctx, pkt, &backend.addr, backend.port), Counter::NewFlow)
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
        // ICMP errors, whatever their mark or sender (the node itself sends
        // some): tc_icmp_error_out(6).
        let v6 = skb::is_ipv6(&ctx);
        if if v6 { icmp::is_icmp::<V6>(&ctx) } else { icmp::is_icmp::<V4>(&ctx) } {
            let _ = unsafe { ICMP_PROGRAMS.tail_call(&ctx, if v6 { ICMP_PROG_EGRESS6 } else { ICMP_PROG_EGRESS }) };
            return NOT_OURS;
        }
        egress::<V4>(&ctx)
    }

    /// An ICMP error met at ingress: one about a masqueraded flow goes back
    /// to the flow's client (see `icmp`). Reached by tail call from
    /// `tc_ingress(6)` for every IP packet that is not TCP, UDP or SCTP;
    /// counts for them, and drops those to an unallocated service address.
    #[classifier]
    pub fn tc_icmp_error_in(ctx: TcContext) -> i32 {
        icmp_error::<V4, true>(&ctx)
    }

    #[classifier]
    pub fn tc_icmp_error_in6(ctx: TcContext) -> i32 {
        icmp_error::<V6, true>(&ctx)
    }

    /// An ICMP error met at egress: the quote names the frontend again.
    /// Reached by tail call from `tc_egress` for ICMP packets.
    #[classifier]
    pub fn tc_icmp_error_out(ctx: TcContext) -> i32 {
        icmp_error::<V4, false>(&ctx)
    }

    #[classifier]
    pub fn tc_icmp_error_out6(ctx: TcContext) -> i32 {
        icmp_error::<V6, false>(&ctx)
    }

    #[inline(always)]
    fn icmp_error<F: Family, const INGRESS: bool>(ctx: &TcContext) -> i32 {
        match icmp::translate::<F, INGRESS>(ctx) {
            Some(done) => verdict::<false>(done, Counter::IcmpErrorTranslated),
            None if INGRESS => {
                // An echo request, or any other protocol, to an unallocated
                // service address is dropped, as anything sent there is
                // (kube-proxy's rule matches every protocol).
                if icmp::destination::<F>(ctx).is_some_and(|dst| lb::is_unallocated(&dst)) {
                    count(Counter::DropUnallocated);
                    return DROP;
                }
                count(Counter::Passed);
                NOT_OURS
            }
            // Egress counts only what it translates.
            None => NOT_OURS,
        }
    }

    /// `tc_egress` for IPv6 frames, reached by tail call from it.
    #[classifier]
    pub fn tc_egress6(ctx: TcContext) -> i32 {
        egress::<V6>(&ctx)
    }

    /// IPv6 masquerade, reached by tail call from `tc_egress6` (mark already
    /// cleared): the IPv6 packet cannot live in registers, and with the
    /// reverse-NAT path in the same frame the stack would pass 512 bytes.
    #[classifier]
    pub fn tc_masquerade6(ctx: TcContext) -> i32 {
        let pkt = match parse::parse_in_place::<V6>(&ctx) {
            Ok(pkt) => pkt,
            Err(Counter::Fragment) => {
                // tc_egress_fragment6, which starts over: with the mark.
                ctx.set_mark(skb::mark(&ctx) | MASQUERADE_MARK);
                let _ = unsafe { FRAGMENT_PROGRAMS.tail_call(&ctx, FRAGMENT_PROG_EGRESS6) };
                return NOT_OURS;
            }
            Err(_) => return NOT_OURS,
        };
        if pkt.fragment == fragment::FIRST {
            fragment::remember_first::<V6>(&ctx, &pkt);
        }
        let Some((addr, port)) = masquerade::source_for::<V6>(&ctx, skb::ifindex(&ctx), &pkt) else {
            count(Counter::SnatFailed);
            return NOT_OURS;
        };
        match nat::rewrite_src::<V6>(&ctx, &pkt, &addr, port) {
            Ok(()) => TC_ACT_OK as i32,
            Err(_) => {
                count(Counter::RewriteFailed);
                DROP
            }
        }
    }

    /// A later fragment of a UDP datagram, from `tc_egress(6)` (or
    /// `tc_masquerade6`) by tail call with its mark: the source its first
    /// fragment got, found, never chosen (see `tc_ingress_fragment`).
    #[classifier]
    pub fn tc_egress_fragment(ctx: TcContext) -> i32 {
        later_fragment_out::<V4>(&ctx)
    }

    #[classifier]
    pub fn tc_egress_fragment6(ctx: TcContext) -> i32 {
        later_fragment_out::<V6>(&ctx)
    }

    #[inline(always)]
    fn later_fragment_out<F: Family>(ctx: &TcContext) -> i32 {
        let mark = crate::skb::mark(ctx);
        if mark & (MASQUERADE_MARK | REVERSE_NAT_MARK) == 0 {
            return NOT_OURS;
        }
        ctx.set_mark(mark & !(MASQUERADE_MARK | REVERSE_NAT_MARK));
        let parsed = parse::parse_fragment::<F>(ctx);
        let Ok(pkt) = parsed else { return NOT_OURS };
        let source = if mark & MASQUERADE_MARK != 0 {
            conntrack::snat_choice(&pkt.tuple).map(|e| e.addr)
        } else {
            conntrack::lookup(&pkt.tuple).filter(|e| e.direction == CT_REPLY).map(|e| e.nat_addr)
        };
        let Some(addr) = source else {
            count(Counter::SnatFailed);
            return NOT_OURS;
        };
        match nat::rewrite_src_address::<F>(ctx, &pkt, &addr) {
            Ok(()) => TC_ACT_OK as i32,
            Err(_) => {
                count(Counter::RewriteFailed);
                DROP
            }
        }
    }

    #[inline(always)]
    fn egress<F: Family>(ctx: &TcContext) -> i32 {
        let mark = crate::skb::mark(ctx);
        if mark & (MASQUERADE_MARK | REVERSE_NAT_MARK) == 0 {
            // A node socket's packet.
            if !skb::from_local_socket(ctx) {
                return NOT_OURS;
            }
            if !F::V6 && skb::is_ipv6(ctx) {
                return to_ipv6::<false>(ctx, IPV6_PROG_EGRESS);
            }
            // tc_egress_node(6) (and tc_egress_node_flow), each with a stack
            // of its own (inline, egress's would pass what older verifiers
            // allow).
            let _ = if F::V6 {
                unsafe { NODE6_PROGRAMS.tail_call(ctx, NODE6_PROG_EGRESS) }
            } else {
                unsafe { NODE_PROGRAMS.tail_call(ctx, NODE_PROG_EGRESS) }
            };
            return NOT_OURS;
        }
        if !F::V6 && skb::is_ipv6(ctx) {
            return to_ipv6::<false>(ctx, IPV6_PROG_EGRESS);
        }
        ctx.set_mark(mark & !(MASQUERADE_MARK | REVERSE_NAT_MARK));
        if F::V6 && mark & MASQUERADE_MARK != 0 {
            let _ = unsafe { IPV6_PROGRAMS.tail_call(ctx, IPV6_PROG_MASQUERADE) };
            count(Counter::SnatFailed);
            return NOT_OURS;
        }
        let parsed = parse::parse::<F>(ctx);
        let pkt = match parsed {
            Ok(pkt) => pkt,
            Err(Counter::Fragment) => {
                // tc_egress_fragment(6), which starts over: with the mark.
                ctx.set_mark(mark);
                let slot = if F::V6 { FRAGMENT_PROG_EGRESS6 } else { FRAGMENT_PROG_EGRESS };
                let _ = unsafe { FRAGMENT_PROGRAMS.tail_call(ctx, slot) };
                return NOT_OURS;
            }
            Err(_) => return NOT_OURS,
        };
        if pkt.fragment == fragment::FIRST {
            fragment::remember_first::<F>(ctx, &pkt);
        }
        let source = if mark & MASQUERADE_MARK != 0 {
            masquerade::source_for::<F>(ctx, skb::ifindex(ctx), &pkt)
        } else {
            conntrack::lookup(&pkt.tuple).filter(|e| e.direction == CT_REPLY).map(|e| (e.nat_addr, e.nat_port))
        };
        let Some((addr, port)) = source else {
            count(Counter::SnatFailed);
            return NOT_OURS;
        };
        match nat::rewrite_src::<F>(ctx, &pkt, &addr, port) {
            Ok(()) => TC_ACT_OK as i32,
            Err(_) => {
                count(Counter::RewriteFailed);
                DROP
            }
        }
    }

    /// A reply to a node socket's flow that egress translated (CT_NODE), from
    /// `tc_ingress` by tail call. It is delivered locally and no egress runs
    /// after, so its destination (if masqueraded) and its source (back to
    /// the frontend) are both restored here. A program of its own: inline,
    /// it would grow tc_ingress's stack frame past what older verifiers
    /// accept beside the reject subprogram (Linux 6.1: 256 bytes).
    #[classifier]
    pub fn tc_ingress_node_reply(ctx: TcContext) -> i32 {
        node_reply::<V4>(&ctx)
    }

    /// `tc_ingress_node_reply` for IPv6, from `tc_ingress6`.
    #[classifier]
    pub fn tc_ingress_node_reply6(ctx: TcContext) -> i32 {
        node_reply::<V6>(&ctx)
    }

    #[inline(always)]
    fn node_reply<F: Family>(ctx: &TcContext) -> i32 {
        let parsed = parse::parse::<F>(ctx);
        let Ok(pkt) = parsed else { return NOT_OURS };
        let Some(ct) = conntrack::lookup(&pkt.tuple).filter(|ct| ct.direction == CT_REPLY && ct.flags & CT_NODE != 0) else {
            return NOT_OURS;
        };
        let ct = *ct;
        let mut done = Ok(());
        if ct.flags & CT_MASQUERADE != 0 {
            done = nat::rewrite_dst::<F>(ctx, &pkt, &ct.rev_addr, ct.rev_port);
        }
        let done = done.and_then(|()| nat::rewrite_src::<F>(ctx, &pkt, &ct.nat_addr, ct.nat_port));
        match verdict::<false>(done, Counter::Reply) {
            ok if ok == TC_ACT_OK as i32 && ct.flags & CT_LOOPBACK != 0 => to_loopback(ctx),
            verdict => verdict,
        }
    }

    /// Delivers the packet as if it had come through loopback: addressed to
    /// loopback's all-zero MAC, or the stack would take it for another
    /// host's (from an L3 device, with an Ethernet header put in front).
    #[inline(always)]
    fn to_loopback(ctx: &TcContext) -> i32 {
        if crate::l2::push_ethernet(ctx).is_err() || ctx.store(0, &[0u8; 6], 0).is_err() {
            note::<false>(Counter::RewriteFailed);
            return DROP;
        }
        unsafe { bpf_redirect(LOOPBACK_IFINDEX, BPF_F_INGRESS as u64) as i32 }
    }

    /// A node socket's IPv4 packet, from `tc_egress` by tail call: see
    /// `node_to_service`.
    #[classifier]
    pub fn tc_egress_node(ctx: TcContext) -> i32 {
        if let Some(done) = node_to_service::<V4>(&ctx) {
            return done;
        }
        if masquerade::node_flows_armed() {
            let _ = unsafe { NODE_PROGRAMS.tail_call(&ctx, NODE_PROG_FLOW) };
        }
        NOT_OURS
    }

    /// `tc_egress_node` for IPv6, from `tc_egress6`.
    #[classifier]
    pub fn tc_egress_node6(ctx: TcContext) -> i32 {
        if let Some(done) = node_to_service::<V6>(&ctx) {
            return done;
        }
        if masquerade::node_flows_armed() {
            let _ = unsafe { NODE6_PROGRAMS.tail_call(&ctx, NODE6_PROG_FLOW) };
        }
        NOT_OURS
    }

    /// `tc_egress_node_flow` for IPv6, from `tc_egress_node6`.
    #[classifier]
    pub fn tc_egress_node_flow6(ctx: TcContext) -> i32 {
        node_flow::<V6>(&ctx)
    }

    /// A node socket's IPv4 connection that may have met a masqueraded
    /// flow's tuple (see masquerade::node_source_for), from `tc_egress_node`.
    #[classifier]
    pub fn tc_egress_node_flow(ctx: TcContext) -> i32 {
        node_flow::<V4>(&ctx)
    }

    /// The node's own packet to a frontend, which no socket hook pointed at
    /// a backend: a raw socket's, one of a process outside --cgroup-root,
    /// or SCTP's (the hooks never see its connect). Translated as kube-proxy's
    /// OUTPUT chain translates it, then sent on towards the backend, whose
    /// interface's egress masquerades it. None: not such a packet.
    ///
    /// A packet from a loopback address is left alone: its reply would come
    /// back on another interface to a loopback address, which Linux drops
    /// as a martian (kube-proxy sets route_localnet for that; we don't).
    #[inline(always)]
    fn node_to_service<F: Family>(ctx: &TcContext) -> Option<i32> {
        let parsed = parse::parse::<F>(ctx);
        let pkt = parsed.ok()?;
        if is_loopback::<F>(&pkt.tuple.src) {
            return None;
        }
        let mut known = false;
        if let Some(ct) = conntrack::lookup_flow(&pkt) {
            if ct.direction == CT_REPLY && ct.flags & CT_NODE == 0 {
                return Some(local_endpoint_reply::<F>(ctx, &pkt, ct));
            }
            if ct.flags & CT_NODE == 0 || ct.direction != CT_ORIGINAL {
                return None;
            }
            if lb::backend_still_matches(ct, true) {
                conntrack::touch(ct, pkt.closes_connection());
                set_mark(ctx, MASQUERADE_MARK);
                let done = nat::rewrite_dst::<F>(ctx, &pkt, &ct.nat_addr, ct.nat_port);
                return Some(forward::<F>(ctx, &pkt, verdict::<false>(done, Counter::Established)));
            }
            known = true;
        }
        // New, or its backend went away.
        match new_flow::<false, F, true, _>(ctx, &pkt, known) {
            NOT_OURS => None,
            verdict => Some(forward::<F>(ctx, &pkt, verdict)),
        }
    }

    /// A reply from a server of the node (a hostNetwork endpoint) to a
    /// client whose packets ingress translated to it: delivered locally,
    /// they never reached egress, and the reply never passes ingress, so its
    /// source goes back to the frontend here (and it confirms its flow).
    #[inline(always)]
    fn local_endpoint_reply<'a, F: Family>(ctx: &TcContext, pkt: &'a packet::Packet, mut ct: &'a mut proxy_common::CtEntry) -> i32 {
        if ct.flags & CT_PENDING != 0 {
            let Some(seen) = see_unconfirmed_reply(ctx, pkt, ct) else { return NOT_OURS };
            ct = seen;
        }
        conntrack::touch(ct, pkt.closes_connection());
        verdict::<false>(nat::rewrite_src::<F>(ctx, pkt, &ct.nat_addr, ct.nat_port), Counter::Reply)
    }

    /// 127.0.0.0/8 or ::1.
    #[inline(always)]
    fn is_loopback<F: Family>(addr: &proxy_common::Addr) -> bool {
        if F::V6 { *addr == proxy_common::Addr(core::net::Ipv6Addr::LOCALHOST.octets()) } else { addr.0[12] == 127 }
    }

    /// A node packet's verdict at egress: translated (TC_ACT_OK), it goes on
    /// towards its backend; dropped or rejected, as it is.
    #[inline(always)]
    fn forward<F: Family>(ctx: &TcContext, pkt: &packet::Packet, verdict: i32) -> i32 {
        if verdict != TC_ACT_OK as i32 {
            return verdict;
        }
        route::to_destination::<F>(ctx, pkt.l3_off, pkt.proto).unwrap_or_else(|counter| {
            count(counter);
            DROP
        })
    }

    #[inline(always)]
    fn node_flow<F: Family>(ctx: &TcContext) -> i32 {
        let parsed = parse::parse::<F>(ctx);
        let Ok(pkt) = parsed else { return NOT_OURS };
        if pkt.proto != IPPROTO_TCP {
            return NOT_OURS;
        }
        let Some((addr, port)) = masquerade::node_source_for::<F>(ctx, &pkt) else { return NOT_OURS };
        match nat::rewrite_src::<F>(ctx, &pkt, &addr, port) {
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

    /// TC finishes every packet: what needs another of its programs goes
    /// there by tail call (see `hook`).
    impl Hook for TcContext {
        const NOT_OURS: i32 = NOT_OURS;
        const DROP: i32 = DROP;
        const FINISHES_ALL: bool = true;

        #[inline(always)]
        fn ifindex(&self) -> u32 {
            skb::ifindex(self)
        }

        #[inline(always)]
        fn add_mark(&self, bits: u32) {
            set_mark(self, bits);
        }

        /// On through the stack, which routes it.
        #[inline(always)]
        fn translated<F: Family>(&self) -> i32 {
            TC_ACT_OK as i32
        }

        #[inline(always)]
        fn reject<const TRACE: bool, F: Family, const NODE: bool>(&self, pkt: &packet::Packet) -> i32 {
            reject_packet::<TRACE, F, NODE>(self, pkt)
        }
    }

    /// REJECT: a RST is never answered; anything else goes to tc_reject(6)
    /// (a trace builds the reject inline, unlimited).
    #[inline(always)]
    fn reject_packet<const TRACE: bool, F: Family, const NODE: bool>(ctx: &TcContext, pkt: &packet::Packet) -> i32 {
        // A first fragment (later ones never get here, see `fragment`): a
        // reject built from it would quote part of a datagram netfilter
        // rejects whole, after reassembly.
        if pkt.tcp_flags & TCP_RST != 0 || pkt.fragment != fragment::NOT_FRAGMENT {
            note::<TRACE>(Counter::RejectSuppressed);
            return DROP;
        }
        if TRACE {
            return send_reject::<true, F>(ctx, pkt, NODE);
        }
        skb::set_cb0(ctx, NODE as u32);
        let _ = unsafe { REJECT_PROGRAMS.tail_call(ctx, if F::V6 { REJECT_PROG_V6 } else { REJECT_PROG_V4 }) };
        count(Counter::RejectFailed);
        DROP
    }

    /// A REJECT, by tail call from any program that decides one (each its
    /// own stack): within its source's budget (`reject_limit`), the packet
    /// becomes the reject and goes back; over it, dropped and counted.
    #[classifier]
    pub fn tc_reject(ctx: TcContext) -> i32 {
        limited_reject::<V4>(&ctx)
    }

    #[classifier]
    pub fn tc_reject6(ctx: TcContext) -> i32 {
        limited_reject::<V6>(&ctx)
    }

    #[inline(always)]
    fn limited_reject<F: Family>(ctx: &TcContext) -> i32 {
        let parsed = parse::parse::<F>(ctx);
        let Ok(pkt) = parsed else {
            count(Counter::RejectFailed);
            return DROP;
        };
        if !reject_budget_allows(&pkt.tuple.src) {
            count(Counter::RejectLimited);
            return DROP;
        }
        send_reject::<false, F>(ctx, &pkt, skb::cb0(ctx) != 0)
    }

    #[inline(always)]
    fn reject_budget_allows(source: &proxy_common::Addr) -> bool {
        let now = unsafe { aya_ebpf::helpers::bpf_ktime_get_ns() };
        if let Some(budget) = REJECT_BUDGETS.get_ptr_mut(source) {
            // Per-CPU races between two rejects of one source only blur the
            // count by one.
            return unsafe { (*budget).allow(now) };
        }
        let mut budget = RejectBudget::full(now);
        let allowed = budget.allow(now);
        let _ = REJECT_BUDGETS.insert(source, &budget, 0);
        allowed
    }

    #[inline(always)]
    fn send_reject<const TRACE: bool, F: Family>(ctx: &TcContext, pkt: &packet::Packet, node: bool) -> i32 {
        let rejected = reject::reject::<F>(ctx, pkt);
        match rejected {
            Ok(()) => {
                note::<TRACE>(Counter::Rejected);
                // Back out of the interface, to a client behind it; for a node
                // socket's packet met at egress, into the node's own stack.
                let flags = if node { BPF_F_INGRESS as u64 } else { 0 };
                unsafe { bpf_redirect(skb::ifindex(ctx), flags) as i32 }
            }
            Err(_) => {
                note::<TRACE>(Counter::RejectFailed);
                DROP
            }
        }
    }

    /// `verdict` for ingress's decisions, in either hook: a translated packet
    /// goes on as the hook sends it.
    #[inline(always)]
    fn finish<const TRACE: bool, F: Family, H: Hook>(ctx: &H, rewrite: Result<(), i64>, counter: Counter) -> i32 {
        match rewrite {
            Ok(()) => {
                note::<TRACE>(counter);
                ctx.translated::<F>()
            }
            Err(_) => {
                note::<TRACE>(Counter::RewriteFailed);
                H::DROP
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
