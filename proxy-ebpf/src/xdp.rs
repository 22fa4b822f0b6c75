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

use proxy_common::{Addr, XDP_HANDOFF_LEN, XDP_HANDOFF_MAGIC, XDP_HANDOFF_TRANSLATED, XDP_PROG_SEND_OUT};

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

/// After the handoff, for xdp_send_out: the masquerade source of the
/// frame's flow, as xdp_ingress found it in the flow's conntrack entry, so
/// that sending the frame out takes no SNAT lookup (two hash-table walks,
/// in tables too large for the cache).
#[repr(C)]
#[derive(Clone, Copy)]
struct MasqueradeSource {
    addr: [u8; 4],
    /// Network order; 0: none (xdp_send_out looks the choice up).
    port: u16,
    _pad: u16,
}

const MAGIC: u32 = XDP_HANDOFF_MAGIC;
/// XDP translated the frame: TC sets the marks and decides nothing.
const TRANSLATED: u32 = XDP_HANDOFF_TRANSLATED;
const HANDOFF_LEN: usize = XDP_HANDOFF_LEN;
const SOURCE_OFF: usize = core::mem::size_of::<Handoff>();
const _: () = assert!(SOURCE_OFF + core::mem::size_of::<MasqueradeSource>() == HANDOFF_LEN);

/// Puts an empty handoff in front of the frame, as its whole metadata.
/// False if the driver has no room for metadata: XDP must then leave every
/// frame to TC.
///
/// A frame may arrive with metadata already, even with a handoff of ours
/// in it: veth carries a frame's metadata along, and a frame this program
/// sent out can come back in (BPF_PROG_TEST_RUN's live frames do, their
/// pages recycled with it). Another handoff stacked in front would soon
/// pass the kernel's 32 bytes, and the stale one would then reach TC, which
/// would take the frame for translated. So the metadata is cut or grown to
/// exactly one handoff, and a stale magic that cannot be replaced is wiped.
#[inline(always)]
pub fn reserve_handoff(ctx: &XdpContext) -> bool {
    let held = ctx.data() as i64 - ctx.metadata() as i64;
    if unsafe { bpf_xdp_adjust_meta(ctx.ctx, (held - HANDOFF_LEN as i64) as i32) } != 0 {
        update(ctx, |h| h.magic = 0);
        return false;
    }
    set_masquerade_source(ctx, MasqueradeSource { addr: [0; 4], port: 0, _pad: 0 })
        && update(ctx, |h| *h = Handoff { magic: MAGIC, marks: 0 })
}

/// Where the frame's handoff starts, if its metadata holds a whole one (the
/// verifier wants that bound checked before each access).
#[inline(always)]
fn handoff_start(ctx: &XdpContext) -> Option<usize> {
    let meta = ctx.metadata();
    (meta + HANDOFF_LEN <= ctx.data()).then_some(meta)
}

#[inline(always)]
fn set_masquerade_source(ctx: &XdpContext, source: MasqueradeSource) -> bool {
    let Some(meta) = handoff_start(ctx) else {
        return false;
    };
    unsafe { core::ptr::write_unaligned((meta + SOURCE_OFF) as *mut MasqueradeSource, source) };
    true
}

/// The masquerade source xdp_ingress found for the frame's flow, if any
/// (an IPv4 address: XDP translates IPv4 only).
#[inline(always)]
pub fn masquerade_source(ctx: &XdpContext) -> Option<(Addr, u16)> {
    let meta = handoff_start(ctx)?;
    let s = unsafe { core::ptr::read_unaligned((meta + SOURCE_OFF) as *const MasqueradeSource) };
    (s.port != 0).then(|| (Addr::from_v4_octets(s.addr), s.port))
}

#[inline(always)]
fn update(ctx: &XdpContext, change: impl FnOnce(&mut Handoff)) -> bool {
    let Some(meta) = handoff_start(ctx) else {
        return false;
    };
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

    /// For xdp_send_out, in the handoff. Only IPv4 flows reach XDP's
    /// decisions, so the address is an IPv4 one.
    #[inline(always)]
    fn masquerade_source_known(&self, addr: &Addr, port: u16) {
        set_masquerade_source(self, MasqueradeSource { addr: addr.v4_octets(), port, _pad: 0 });
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
