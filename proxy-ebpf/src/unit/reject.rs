//! REJECT's reply, built from the packet by `reject` (either family):
//! OK with the reply frame (which the datapath then redirects back out),
//! SHOT if it could not be built.

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    macros::classifier,
    programs::TcContext,
};

use super::{NOT_RUN, start};
use crate::{
    family::{V4, V6},
    reject, skb,
};

#[classifier]
pub fn unit_reject(ctx: TcContext) -> i32 {
    let v6 = skb::is_ipv6(&ctx);
    let started = if v6 { start::<V6>(&ctx) } else { start::<V4>(&ctx) };
    let Some((pkt, _, report)) = started else { return NOT_RUN };
    let built = if v6 { reject::reject::<V6>(&ctx, &pkt) } else { reject::reject::<V4>(&ctx, &pkt) };
    // Only Ok or Err: `reject` is a subprogram, and a BPF call returns one
    // register, the discriminant (the verifier refuses a read of the error).
    report.rc = if built.is_ok() { 0 } else { -1 };
    report.ran = 1;
    if report.rc == 0 { TC_ACT_OK as i32 } else { TC_ACT_SHOT as i32 }
}
