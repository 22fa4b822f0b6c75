//! NAT's rewrites, one program each: the destination (client -> frontend
//! becomes client -> backend, and a reply's reverse) and the source, to the
//! setup's `backend` address and port. The frame that comes out is the
//! test's result: its checksums are recomputed on the host.

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    macros::classifier,
    programs::TcContext,
};

use super::{NOT_RUN, rc, start};
use crate::{
    family::{Family, V4, V6},
    nat, skb,
};

#[classifier]
pub fn unit_nat_dst(ctx: TcContext) -> i32 {
    if skb::is_ipv6(&ctx) { rewrite::<V6, true>(&ctx) } else { rewrite::<V4, true>(&ctx) }
}

#[classifier]
pub fn unit_nat_src(ctx: TcContext) -> i32 {
    if skb::is_ipv6(&ctx) { rewrite::<V6, false>(&ctx) } else { rewrite::<V4, false>(&ctx) }
}

/// OK with the rewritten frame, SHOT if the rewrite failed (the report
/// holds its error).
#[inline(always)]
fn rewrite<F: Family, const DST: bool>(ctx: &TcContext) -> i32 {
    let Some((pkt, setup, report)) = start::<F>(ctx) else { return NOT_RUN };
    let (addr, port) = (&setup.backend.addr, setup.backend.port);
    let done = if DST {
        nat::rewrite_dst::<F>(ctx, &pkt, addr, port)
    } else {
        nat::rewrite_src::<F>(ctx, &pkt, addr, port)
    };
    report.rc = rc(done);
    report.ran = 1;
    if report.rc == 0 { TC_ACT_OK as i32 } else { TC_ACT_SHOT as i32 }
}
