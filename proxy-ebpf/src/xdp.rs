//! XDP's side of the datapath. `xdp_ingress` runs ingress's decisions on
//! the external devices (`--xdp-devices`), before an skb exists; what it
//! cannot finish goes on to TC untouched (see `hook`).
//!
//! A frame XDP translated still passes TC ingress on the same device, and
//! may need TC egress's source rewrite (masquerade, reverse NAT) once
//! routing chose its interface. XDP cannot mark an skb, so it leaves a
//! `Handoff` in the frame's metadata (which the kernel hands on to the
//! skb): TC ingress sees it, sets the marks, and lets the frame go on
//! without deciding it again.
//!
//! Before going up the stack, a translated frame is offered to
//! `xdp_send_out` (see `xdp_forward`), which may send it out itself.

use aya_ebpf::{
    EbpfContext,
    bindings::{__sk_buff, xdp_action},
    helpers::bpf_xdp_adjust_meta,
    programs::{TcContext, XdpContext},
};

use proxy_common::{XDP_HANDOFF_LEN, XDP_HANDOFF_MAGIC, XDP_HANDOFF_TRANSLATED, XDP_PROG_SEND_OUT};

use crate::{family::Family, headers::ETH_P_IP, hook::Hook, maps::XDP_PROGRAMS, packet::Packet};

/// What XDP tells TC ingress about a frame, in front of it.
#[repr(C)]
#[derive(Clone, Copy)]
struct Handoff {
    /// `MAGIC`: the metadata is ours (another XDP program's, or none,
    /// is never taken for a handoff).
    magic: u32,
    /// The skb marks TC sets, and `TRANSLATED`.
    marks: u32,
}

const MAGIC: u32 = XDP_HANDOFF_MAGIC;
/// XDP translated the frame: TC sets the marks and decides nothing.
const TRANSLATED: u32 = XDP_HANDOFF_TRANSLATED;
const HANDOFF_LEN: usize = XDP_HANDOFF_LEN;
const _: () = assert!(core::mem::size_of::<Handoff>() == HANDOFF_LEN);

/// Puts an empty handoff in front of the frame. False if the driver has no
/// room for metadata: XDP must then leave every frame to TC.
#[inline(always)]
pub fn reserve_handoff(ctx: &XdpContext) -> bool {
    if unsafe { bpf_xdp_adjust_meta(ctx.ctx, -(HANDOFF_LEN as i32)) } != 0 {
        return false;
    }
    update(ctx, |h| *h = Handoff { magic: MAGIC, marks: 0 })
}

#[inline(always)]
fn update(ctx: &XdpContext, change: impl FnOnce(&mut Handoff)) -> bool {
    let meta = ctx.metadata();
    if meta + HANDOFF_LEN > ctx.data() {
        return false;
    }
    let mut h = unsafe { core::ptr::read_unaligned(meta as *const Handoff) };
    change(&mut h);
    unsafe { core::ptr::write_unaligned(meta as *mut Handoff, h) };
    true
}

/// The marks of a frame this program translated (its handoff), or None.
#[inline(always)]
pub fn handoff_marks(ctx: &XdpContext) -> Option<u32> {
    let mut marks = None;
    update(ctx, |h| {
        if h.magic == MAGIC && h.marks & TRANSLATED != 0 {
            marks = Some(h.marks & !TRANSLATED);
        }
    });
    marks
}

/// At TC ingress: the marks of a frame XDP translated, or None (not
/// translated, or not through our XDP program).
#[inline(always)]
pub fn translated_marks(ctx: &TcContext) -> Option<u32> {
    let skb = ctx.as_ptr() as *const __sk_buff;
    let (meta, data) = unsafe { ((*skb).data_meta as usize, (*skb).data as usize) };
    if meta + HANDOFF_LEN > data {
        return None;
    }
    let h = unsafe { core::ptr::read_unaligned(meta as *const Handoff) };
    (h.magic == MAGIC && h.marks & TRANSLATED != 0).then_some(h.marks & !TRANSLATED)
}

/// An IPv4 frame, by its Ethernet type (XDP runs on Ethernet devices).
#[inline(always)]
pub fn is_ipv4(ctx: &XdpContext) -> bool {
    crate::context::read::<u16>(ctx, crate::headers::ETH_TYPE_OFF) == Some(ETH_P_IP.to_be())
}

impl Hook for XdpContext {
    const NOT_OURS: i32 = xdp_action::XDP_PASS as i32;
    const DROP: i32 = xdp_action::XDP_DROP as i32;
    const FINISHES_ALL: bool = false;

    #[inline(always)]
    fn ifindex(&self) -> u32 {
        self.ingress_ifindex() as u32
    }

    #[inline(always)]
    fn add_mark(&self, bits: u32) {
        update(self, |h| h.marks |= bits);
    }

    /// Out by `xdp_send_out` if it can; else up the stack, which routes
    /// it, and TC ingress only sets its marks.
    #[inline(always)]
    fn translated<F: Family>(&self) -> i32 {
        update(self, |h| h.marks |= TRANSLATED);
        // Counted now: a tail call does not come back.
        crate::maps::count(proxy_common::Counter::XdpFinished);
        if !F::V6 {
            let _ = unsafe { XDP_PROGRAMS.tail_call(self, XDP_PROG_SEND_OUT) };
        }
        Self::NOT_OURS
    }

    /// TC rejects it, deciding the packet again.
    #[inline(always)]
    fn reject<const TRACE: bool, F: Family, const NODE: bool>(&self, _pkt: &Packet) -> i32 {
        Self::NOT_OURS
    }
}
