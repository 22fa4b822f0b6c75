//! `__sk_buff` state aya's TcContext does not expose.

use aya_ebpf::{EbpfContext, bindings::__sk_buff, programs::TcContext};

#[inline(always)]
fn raw(ctx: &TcContext) -> *const __sk_buff {
    ctx.as_ptr() as *const __sk_buff
}

#[inline(always)]
pub fn mark(ctx: &TcContext) -> u32 {
    unsafe { (*raw(ctx)).mark }
}

/// Whether a socket of this host sent the packet (at egress: a local
/// connection, not a forwarded packet).
#[inline(always)]
pub fn from_local_socket(ctx: &TcContext) -> bool {
    unsafe { !(*raw(ctx)).__bindgen_anon_2.sk.is_null() }
}

/// The interface the packet is on: where it arrived at ingress, where it
/// leaves at egress.
#[inline(always)]
pub fn ifindex(ctx: &TcContext) -> u32 {
    unsafe { (*raw(ctx)).ifindex }
}

/// `skb->cb[0]`: scratch the kernel keeps across a tail call.
#[inline(always)]
pub fn cb0(ctx: &TcContext) -> u32 {
    unsafe { (*raw(ctx)).cb[0] }
}

#[inline(always)]
pub fn set_cb0(ctx: &TcContext, value: u32) {
    unsafe { (*(ctx.as_ptr() as *mut __sk_buff)).cb[0] = value };
}

/// An IPv6 frame, by `skb->protocol` (set by the kernel from the Ethernet
/// header): one context load, so the IPv4 path pays no packet read for it.
#[inline(always)]
pub fn is_ipv6(ctx: &TcContext) -> bool {
    const ETH_P_IPV6: u16 = 0x86dd;
    unsafe { (*raw(ctx)).protocol == ETH_P_IPV6.to_be() as u32 }
}
