//! Forwarding a node packet translated at TC egress. Routing chose its
//! interface for the frontend before the translation; the backend may be
//! behind another one (a pod's veth, a second uplink). The FIB says which,
//! and the packet is redirected there, where egress runs again (and
//! masquerades it to that interface's address, as kube-proxy's POSTROUTING
//! does after its OUTPUT chain's DNAT).
//! A packet met on an L3 device gets an Ethernet header first: the
//! redirect needs one towards an Ethernet device, and strips it towards
//! another L3 device.

use aya_ebpf::{
    bindings::{BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS, bpf_fib_lookup},
    helpers::{bpf_fib_lookup as fib_lookup, bpf_redirect, bpf_redirect_neigh},
    programs::TcContext,
};
use proxy_common::Counter;

use crate::{
    context::{PacketContext, read},
    family::Family,
    headers::{ETH_ALEN, IPV4_DST_OFF, IPV4_SRC_OFF, IPV6_DST_OFF, IPV6_SRC_OFF},
    l2,
    maps::FIB_SCRATCH,
};

const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;

/// The FIB's answer for the IPv4 (`V6`: IPv6) packet at `l3_off`, as for a
/// packet arriving on `ingress` (the output variant would bind the route to
/// it): the lookup's return code and its filled-in struct (out interface,
/// MAC addresses). A non-zero `tot_len` also checks it against the route's
/// MTU. The struct is the per-CPU `FIB_SCRATCH` entry, in map memory: the
/// callers' stacks are nearly full. (TC egress and XDP both ask here.)
#[inline(always)]
pub fn lookup<F: Family>(
    ctx: &impl PacketContext,
    l3_off: usize,
    ingress: u32,
    proto: u8,
    tot_len: u16,
) -> Result<(u32, &'static bpf_fib_lookup), Counter> {
    let fib = unsafe { &mut *FIB_SCRATCH.get_ptr_mut(0).ok_or(Counter::NodeRouteFailed)? };
    clear(fib);
    if F::V6 {
        fib.family = AF_INET6;
        fib.__bindgen_anon_3.ipv6_src = read(ctx, l3_off + IPV6_SRC_OFF).ok_or(Counter::Malformed)?;
        fib.__bindgen_anon_4.ipv6_dst = read(ctx, l3_off + IPV6_DST_OFF).ok_or(Counter::Malformed)?;
    } else {
        fib.family = AF_INET;
        fib.__bindgen_anon_3.ipv4_src = read(ctx, l3_off + IPV4_SRC_OFF).ok_or(Counter::Malformed)?;
        fib.__bindgen_anon_4.ipv4_dst = read(ctx, l3_off + IPV4_DST_OFF).ok_or(Counter::Malformed)?;
    }
    fib.l4_protocol = proto;
    fib.ifindex = ingress;
    fib.__bindgen_anon_1.tot_len = tot_len;
    let size = core::mem::size_of::<bpf_fib_lookup>() as i32;
    let rc = unsafe { fib_lookup(ctx.as_ptr(), fib, size, 0) } as u32;
    Ok((rc, fib))
}

/// Zeroes the struct a word at a time. `*fib = zeroed()` compiles to a call
/// of the BPF object's byte-wise `memset`: 64 rounds of a loop, on every
/// packet XDP or TC forwards.
#[inline(always)]
fn clear(fib: &mut bpf_fib_lookup) {
    const WORDS: usize = core::mem::size_of::<bpf_fib_lookup>() / 4;
    const _: () = assert!(core::mem::size_of::<bpf_fib_lookup>() % 4 == 0 && core::mem::align_of::<bpf_fib_lookup>() >= 4);
    let words = (fib as *mut bpf_fib_lookup).cast::<u32>();
    for i in 0..WORDS {
        // SAFETY: within the struct, aligned (asserted above); zero is a
        // valid value of every field. Volatile, or LLVM folds the stores
        // back into the memset call.
        unsafe { words.add(i).write_volatile(0) };
    }
}

/// Redirects the IPv4 (`V6`: IPv6) packet at `l3_off` to the interface the
/// FIB routes its (already translated) destination through. `Err` with the
/// counter to note when there is no such route to forward on: a backend on
/// the node itself, or forwarding disabled.
#[inline(always)]
pub fn to_destination<F: Family>(ctx: &TcContext, l3_off: usize, proto: u8) -> Result<i32, Counter> {
    // No MTU check: a TC packet may be a GSO one, segmented later.
    let (rc, fib) = lookup::<F>(ctx, l3_off, crate::skb::ifindex(ctx), proto, 0)?;
    let ifindex = fib.ifindex;
    match rc {
        BPF_FIB_LKUP_RET_SUCCESS => {
            // SAFETY: the lookup filled the MAC addresses.
            let macs = unsafe { fib.__bindgen_anon_6.__bindgen_anon_2 };
            l2::push_ethernet(ctx).map_err(|_| Counter::RewriteFailed)?;
            ctx.store(0, &macs.dmac, 0).map_err(|_| Counter::RewriteFailed)?;
            ctx.store(ETH_ALEN, &macs.smac, 0).map_err(|_| Counter::RewriteFailed)?;
            Ok(unsafe { bpf_redirect(ifindex, 0) } as i32)
        }
        // The neighbour is not resolved yet: the kernel resolves it and
        // fills the MAC addresses (Linux 5.10).
        BPF_FIB_LKUP_RET_NO_NEIGH => {
            l2::push_ethernet(ctx).map_err(|_| Counter::RewriteFailed)?;
            Ok(unsafe { bpf_redirect_neigh(ifindex, core::ptr::null_mut(), 0, 0) } as i32)
        }
        _ => Err(Counter::NodeRouteFailed),
    }
}
