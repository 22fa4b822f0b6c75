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
mod nat;
#[cfg(target_arch = "bpf")]
mod parse;
#[cfg(target_arch = "bpf")]
mod sctp;

#[cfg(target_arch = "bpf")]
mod program {
    use aya_ebpf::{
        bindings::{TC_ACT_OK, TC_ACT_SHOT, TC_ACT_UNSPEC},
        macros::classifier,
        programs::TcContext,
    };
    use proxy_common::{CT_ORIGINAL, CT_REPLY, Counter};

    use crate::{conntrack, lb, maps::count, nat, parse};

    /// Leaves the packet to whatever runs next (TCX_NEXT / TC_ACT_UNSPEC).
    const NOT_OURS: i32 = TC_ACT_UNSPEC;

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
                    return verdict(nat::rewrite_src(&ctx, &pkt, &ct.nat_addr, ct.nat_port), Counter::Reply);
                }
                CT_ORIGINAL if lb::backend_still_matches(&ct) => {
                    conntrack::touch(&pkt.tuple);
                    return verdict(nat::rewrite_dst(&ctx, &pkt, &ct.nat_addr, ct.nat_port), Counter::Established);
                }
                // The backend is gone: choose again below, so the flow moves to a
                // live backend instead of black-holing.
                _ => count(Counter::Rebalanced),
            }
        }

        let Some(service) = lb::lookup_frontend(&pkt.tuple) else {
            count(Counter::Passed);
            return NOT_OURS;
        };
        let Some((backend_id, backend)) = lb::choose_backend(&service) else {
            count(Counter::NoBackend);
            return TC_ACT_SHOT as i32;
        };
        if conntrack::create(&pkt.tuple, &service, backend_id, &backend).is_err() {
            count(Counter::CtFull);
        }
        verdict(nat::rewrite_dst(&ctx, &pkt, &backend.addr, backend.port), Counter::NewFlow)
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
