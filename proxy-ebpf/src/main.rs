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
mod parse;
#[cfg(target_arch = "bpf")]
mod reject;
#[cfg(target_arch = "bpf")]
mod skb;

#[cfg(target_arch = "bpf")]
mod program {
    use aya_ebpf::{
        bindings::{TC_ACT_OK, TC_ACT_SHOT, TC_ACT_UNSPEC},
        macros::classifier,
        programs::TcContext,
    };
    use proxy_common::{
        CT_MASQUERADE, CT_ORIGINAL, CT_REPLY, Counter, MASQUERADE_MARK, SVC_DROP_IF_EMPTY, SVC_MASQUERADE,
        SVC_SOURCE_RANGES,
    };

    use crate::{
        conntrack,
        lb::{self, Miss},
        maps::count,
        masquerade, nat, parse, reject,
    };

    /// Leaves the packet to whatever runs next (TCX_NEXT / TC_ACT_UNSPEC).
    const NOT_OURS: i32 = TC_ACT_UNSPEC;
    const DROP: i32 = TC_ACT_SHOT as i32;

    #[classifier]
    pub fn tc_ingress(ctx: TcContext) -> i32 {
        let pkt = match parse::parse(&ctx) {
            Ok(pkt) => pkt,
            Err(reason) => {
                count(reason);
                return NOT_OURS;
            }
        };

        // A known flow: one lookup finds its translation in either direction.
        if let Some(ct) = conntrack::lookup(&pkt.tuple) {
            match ct.direction {
                CT_REPLY => {
                    conntrack::touch(&pkt.tuple);
                    let mut done = Ok(());
                    if ct.flags & CT_MASQUERADE != 0 {
                        // Addressed to the SNAT address and port: back to the client.
                        done = nat::rewrite_dst(&ctx, &pkt, &ct.rev_addr, ct.rev_port);
                    }
                    let done = done.and_then(|()| nat::rewrite_src(&ctx, &pkt, &ct.nat_addr, ct.nat_port));
                    return verdict(done, Counter::Reply);
                }
                CT_ORIGINAL if lb::backend_still_matches(&ct) => {
                    conntrack::touch(&pkt.tuple);
                    if ct.flags & CT_MASQUERADE != 0 {
                        mark_for_masquerade(&ctx);
                    }
                    return verdict(nat::rewrite_dst(&ctx, &pkt, &ct.nat_addr, ct.nat_port), Counter::Established);
                }
                // The backend is gone: choose again below, so the flow moves to a
                // live backend instead of black-holing.
                _ => count(Counter::Rebalanced),
            }
        }

        let service = match lb::lookup_frontend(&pkt.tuple, lb::scope_of(&pkt.tuple.src)) {
            Ok(service) => service,
            Err(Miss::NotOurs) => {
                count(Counter::Passed);
                return NOT_OURS;
            }
            Err(Miss::Reject) => return reject_packet(&ctx, &pkt),
            Err(Miss::DropUnallocated) => {
                count(Counter::DropUnallocated);
                return DROP;
            }
        };
        if service.flags & SVC_SOURCE_RANGES != 0 && !lb::source_allowed(&service, &pkt.tuple.src) {
            count(Counter::DropSourceRange);
            return DROP;
        }
        let Some((backend_id, backend, sticky)) = lb::choose_backend(&service, &pkt.tuple.src) else {
            if service.flags & SVC_DROP_IF_EMPTY != 0 {
                count(Counter::DropNoLocal);
                return DROP;
            }
            count(Counter::NoBackend);
            return reject_packet(&ctx, &pkt);
        };
        if sticky {
            count(Counter::AffinityHit);
        }
        // Hairpin: a pod reaching itself through its Service must see the
        // node as the source, or its reply would skip the reverse NAT.
        let masquerade = service.flags & SVC_MASQUERADE != 0 || backend.addr == pkt.tuple.src;
        let ct_flags = if masquerade { CT_MASQUERADE } else { 0 };
        if conntrack::create(&pkt.tuple, &service, backend_id, &backend, ct_flags).is_err() {
            count(Counter::CtFull);
        }
        if masquerade {
            count(Counter::Masqueraded);
            mark_for_masquerade(&ctx);
        }
        verdict(nat::rewrite_dst(&ctx, &pkt, &backend.addr, backend.port), Counter::NewFlow)
    }

    /// SNAT for the flows ingress marked, now that routing chose the interface.
    #[classifier]
    pub fn tc_egress(ctx: TcContext) -> i32 {
        let mark = crate::skb::mark(&ctx);
        if mark & MASQUERADE_MARK == 0 {
            return NOT_OURS;
        }
        ctx.set_mark(mark & !MASQUERADE_MARK);
        let Ok(pkt) = parse::parse(&ctx) else { return NOT_OURS };
        match masquerade::source_for(&ctx, &pkt) {
            Some((addr, port)) => match nat::rewrite_src(&ctx, &pkt, &addr, port) {
                Ok(()) => TC_ACT_OK as i32,
                Err(_) => {
                    count(Counter::RewriteFailed);
                    DROP
                }
            },
            None => {
                count(Counter::SnatFailed);
                NOT_OURS
            }
        }
    }

    #[inline(always)]
    fn mark_for_masquerade(ctx: &TcContext) {
        let mark = crate::skb::mark(ctx);
        ctx.set_mark(mark | MASQUERADE_MARK);
    }

    #[inline(always)]
    fn reject_packet(ctx: &TcContext, pkt: &parse::Packet) -> i32 {
        match reject::reject(ctx, pkt) {
            Ok(redirect) => {
                count(Counter::Rejected);
                redirect
            }
            Err(_) => {
                count(Counter::RejectFailed);
                DROP
            }
        }
    }

    /// A failed rewrite may have left the packet half-changed: drop it rather
    /// than send it on with a wrong address or checksum.
    #[inline(always)]
    fn verdict(rewrite: Result<(), i64>, counter: Counter) -> i32 {
        match rewrite {
            Ok(()) => {
                count(counter);
                TC_ACT_OK as i32
            }
            Err(_) => {
                count(Counter::RewriteFailed);
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
