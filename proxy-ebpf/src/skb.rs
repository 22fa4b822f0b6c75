//! `__sk_buff` fields aya's TcContext does not expose.

use aya_ebpf::{EbpfContext, bindings::__sk_buff, programs::TcContext};

#[inline(always)]
fn raw(ctx: &TcContext) -> *const __sk_buff {
    ctx.as_ptr() as *const __sk_buff
}

#[inline(always)]
pub fn mark(ctx: &TcContext) -> u32 {
    unsafe { (*raw(ctx)).mark }
}

/// The interface the packet is on: where it arrived at ingress, where it
/// leaves at egress.
#[inline(always)]
pub fn ifindex(ctx: &TcContext) -> u32 {
    unsafe { (*raw(ctx)).ifindex }
}
