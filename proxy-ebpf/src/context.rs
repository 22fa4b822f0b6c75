//! The packet a program works on, as the datapath logic sees it: one trait
//! that TC's and XDP's contexts implement, so parsing, NAT, SCTP, ICMP
//! errors, fragments and rejects are written once for every hook, as
//! Cilium's `ctx_*` overloads serve its skb and XDP programs.
//!
//! What stays outside it is the hook's own business: the skb's mark and
//! `cb`, its socket, redirects (`skb`, `route`, `l2::push_ethernet`), and
//! what a hook does with a translated packet (`hook`).
//!
//! Every method is `#[inline(always)]`: the logic is monomorphised per
//! context and compiles to what direct calls on the context would.

use aya_ebpf::{
    EbpfContext,
    bindings::{BPF_F_MARK_MANGLED_0, __sk_buff},
    helpers::bpf_skb_load_bytes,
    programs::{TcContext, XdpContext},
};
use proxy_common::csum;

/// The `T` at `off` in the packet, if the linear data holds it (direct
/// packet access: no helper call; the packet has no alignment, and the
/// verifier allows unaligned packet reads).
#[inline(always)]
pub fn read<T: Copy>(ctx: &impl PacketContext, off: usize) -> Option<T> {
    let start = ctx.data();
    if start + off + core::mem::size_of::<T>() > ctx.data_end() {
        return None;
    }
    Some(unsafe { core::ptr::read_unaligned((start + off) as *const T) })
}

/// Writes `value` at `off` in the packet, if the linear data holds it
/// (direct packet access, as `read`).
#[inline(always)]
pub fn write<T: Copy>(ctx: &impl PacketContext, off: usize, value: T) -> Option<()> {
    let start = ctx.data();
    if start + off + core::mem::size_of::<T>() > ctx.data_end() {
        return None;
    }
    unsafe { core::ptr::write_unaligned((start + off) as *mut T, value) };
    Some(())
}

/// The largest offset `load_linear_first` and `store_linear_first` try in
/// the linear data (an IP packet is shorter).
const MAX_DIRECT_OFF: usize = 0xffff;

/// The `T` at `off`: straight from the linear data when it holds it (an
/// IPv4 packet's headers, which `parse` pulled in), else with the
/// context's `load` (a helper call in TC, ~20 ns each).
#[inline(always)]
pub fn load_linear_first<C: PacketContext, T: Copy>(ctx: &C, off: usize) -> Result<T, i64> {
    // Bounded first: in a subprogram the offset is an argument the verifier
    // knows nothing of, and it adds no unbounded number to a packet pointer.
    if off > MAX_DIRECT_OFF {
        return ctx.load(off);
    }
    match read(ctx, off) {
        Some(value) => Ok(value),
        None => ctx.load(off),
    }
}

/// Writes `value` at `off` as `load_linear_first` reads.
#[inline(always)]
pub fn store_linear_first<C: PacketContext, T: Copy>(ctx: &C, off: usize, value: T) -> Result<(), i64> {
    if off > MAX_DIRECT_OFF {
        return ctx.store(off, &value, 0);
    }
    match write(ctx, off, value) {
        Some(()) => Ok(()),
        None => ctx.store(off, &value, 0),
    }
}

pub trait PacketContext: EbpfContext {
    /// Whether a packet may hold a partial L4 checksum (CHECKSUM_PARTIAL),
    /// which only the kernel's helper updates right: TC's packets may, XDP's
    /// never do.
    const MAY_BE_PARTIAL: bool;

    /// The first byte of the packet's linear data, and one past its last
    /// (direct packet access; the verifier wants every read checked
    /// against the end).
    fn data(&self) -> usize;
    fn data_end(&self) -> usize;
    /// Whether the packet is at least `end` bytes long, also counting what
    /// lies outside the linear data.
    fn holds(&self, end: usize) -> bool;
    /// Makes the first `max` bytes linear (all of a shorter packet), for
    /// direct access.
    fn pull_upto(&self, max: usize) -> Result<(), i64>;
    /// A copy of the `T` at `off`, wherever it lies.
    fn load<T: Copy>(&self, off: usize) -> Result<T, i64>;
    /// `dst.len()` bytes from `off` into `dst`.
    fn load_bytes(&self, off: usize, dst: &mut [u8]) -> Result<(), i64>;
    fn store<T: Copy>(&self, off: usize, value: &T, flags: u64) -> Result<(), i64>;
    /// Updates the L4 checksum at `off` for a field that changed from `from`
    /// to `to` (`flags`: the field's size, BPF_F_PSEUDO_HDR for a
    /// pseudo-header field, BPF_F_MARK_MANGLED_0 for UDP's "no checksum").
    /// TC's must keep a CHECKSUM_PARTIAL packet's partial sum right, which
    /// only the kernel's helper knows how to do.
    fn l4_csum_replace(&self, off: usize, from: u64, to: u64, flags: u64) -> Result<(), i64>;
    /// Grows or shrinks the packet to `len` bytes (a reject's reply).
    fn change_tail(&self, len: u32, flags: u64) -> Result<(), i64>;
    /// Whether the packet's L4 checksum is only partial (CHECKSUM_PARTIAL:
    /// the rest is computed on the way out), judged by the checksum field
    /// at `off`, which the caller overwrites afterwards. `linear`: the field
    /// is read and written in the linear data where it lies there (IPv4,
    /// whose headers `parse` pulled in), not only with helpers.
    fn checksum_is_partial(&self, off: usize, linear: bool) -> Result<bool, i64>;
    /// The network protocol (an Ethernet type, network order in the low 16
    /// bits) the packet carries by the hook's metadata: what a device
    /// without Ethernet headers says in place of one.
    fn protocol(&self) -> u32;
}

impl PacketContext for TcContext {
    const MAY_BE_PARTIAL: bool = true;

    #[inline(always)]
    fn data(&self) -> usize {
        TcContext::data(self)
    }

    #[inline(always)]
    fn data_end(&self) -> usize {
        TcContext::data_end(self)
    }

    #[inline(always)]
    fn holds(&self, end: usize) -> bool {
        end <= TcContext::len(self) as usize
    }

    #[inline(always)]
    fn pull_upto(&self, max: usize) -> Result<(), i64> {
        let want = core::cmp::min(TcContext::len(self) as usize, max);
        if TcContext::data(self) + want > TcContext::data_end(self) {
            TcContext::pull_data(self, want as u32)?;
        }
        Ok(())
    }

    #[inline(always)]
    fn load<T: Copy>(&self, off: usize) -> Result<T, i64> {
        TcContext::load(self, off)
    }

    #[inline(always)]
    fn load_bytes(&self, off: usize, dst: &mut [u8]) -> Result<(), i64> {
        // Not aya's load_bytes, which clamps the length to the packet's: a
        // short packet is an error here, and the verifier sees a constant.
        let ret = unsafe { bpf_skb_load_bytes(self.as_ptr(), off as u32, dst.as_mut_ptr() as *mut _, dst.len() as u32) };
        if ret == 0 { Ok(()) } else { Err(ret) }
    }

    #[inline(always)]
    fn store<T: Copy>(&self, off: usize, value: &T, flags: u64) -> Result<(), i64> {
        TcContext::store(self, off, value, flags)
    }

    #[inline(always)]
    fn l4_csum_replace(&self, off: usize, from: u64, to: u64, flags: u64) -> Result<(), i64> {
        TcContext::l4_csum_replace(self, off, from, to, flags)
    }

    #[inline(always)]
    fn change_tail(&self, len: u32, flags: u64) -> Result<(), i64> {
        TcContext::change_tail(self, len, flags)
    }

    /// TC programs cannot read `ip_summed`, but the kernel's l4 checksum
    /// helper leaves a partial packet's field untouched unless the
    /// pseudo-header changes: change a test value and look.
    #[inline(always)]
    fn checksum_is_partial(&self, off: usize, linear: bool) -> Result<bool, i64> {
        const PROBE: u16 = 0x1234;
        if linear {
            store_linear_first(self, off, PROBE)?;
        } else {
            TcContext::store(self, off, &PROBE, 0)?;
        }
        TcContext::l4_csum_replace(self, off, 0, 1, 2)?;
        let seen = if linear { load_linear_first::<_, u16>(self, off)? } else { TcContext::load::<u16>(self, off)? };
        Ok(seen == PROBE)
    }

    #[inline(always)]
    fn protocol(&self) -> u32 {
        unsafe { (*(self.as_ptr() as *const __sk_buff)).protocol }
    }
}

/// XDP sees a frame as the driver received it: all of it linear (no
/// fragments: the agent attaches without multi-buffer support, so the
/// kernel refuses frames larger than a page), with full checksums (nothing
/// is CHECKSUM_PARTIAL before the stack), and no helper is needed to read or
/// write it: every access is a direct one, checked against the end. Kernel
/// 5.10 has no bpf_xdp_load_bytes/store_bytes.
impl PacketContext for XdpContext {
    const MAY_BE_PARTIAL: bool = false;

    #[inline(always)]
    fn data(&self) -> usize {
        XdpContext::data(self)
    }

    #[inline(always)]
    fn data_end(&self) -> usize {
        XdpContext::data_end(self)
    }

    /// By pointers (the verifier allows no arithmetic on the end pointer,
    /// so the length is never a number here), with `end` bounded first as
    /// the verifier wants an offset added to a packet pointer. `end` goes
    /// through a black box: knowing it, LLVM would drop the checks of later
    /// reads before it, which the verifier, knowing `end` only as a range,
    /// cannot follow.
    #[inline(always)]
    fn holds(&self, end: usize) -> bool {
        let end = core::hint::black_box(end);
        end <= 0xffff && XdpContext::data(self) + end <= XdpContext::data_end(self)
    }

    /// Everything is linear already.
    #[inline(always)]
    fn pull_upto(&self, _max: usize) -> Result<(), i64> {
        Ok(())
    }

    #[inline(always)]
    fn load<T: Copy>(&self, off: usize) -> Result<T, i64> {
        read(self, off).ok_or(-1)
    }

    #[inline(always)]
    fn load_bytes(&self, off: usize, dst: &mut [u8]) -> Result<(), i64> {
        let start = XdpContext::data(self);
        if start + off + dst.len() > XdpContext::data_end(self) {
            return Err(-1);
        }
        // Constant lengths after inlining (addresses, MACs): plain moves.
        unsafe { core::ptr::copy_nonoverlapping((start + off) as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    #[inline(always)]
    fn store<T: Copy>(&self, off: usize, value: &T, _flags: u64) -> Result<(), i64> {
        write(self, off, *value).ok_or(-1)
    }

    /// RFC 1624's incremental update in place, as the kernel's helper does
    /// for a full checksum: the pseudo-header flag changes nothing there.
    /// UDP's "no checksum" (0) stays 0, and a sum that comes out 0 is sent
    /// as 0xffff.
    #[inline(always)]
    fn l4_csum_replace(&self, off: usize, from: u64, to: u64, flags: u64) -> Result<(), i64> {
        let field: [u8; 2] = PacketContext::load(self, off)?;
        let mangled_0 = flags & BPF_F_MARK_MANGLED_0 as u64 != 0;
        if mangled_0 && field == [0, 0] {
            return Ok(());
        }
        // The helper takes the values as they lie in the packet (network
        // order in memory): the same bytes here.
        let updated = if flags & 0xf == 4 {
            csum::replace4(field, (from as u32).to_ne_bytes(), (to as u32).to_ne_bytes())
        } else {
            csum::replace2(field, (from as u16).to_ne_bytes(), (to as u16).to_ne_bytes())
        };
        let updated = if mangled_0 && updated == [0, 0] { [0xff, 0xff] } else { updated };
        PacketContext::store(self, off, &updated, 0)
    }

    /// XDP cannot resize a frame's tail here (rejects are left to TC).
    #[inline(always)]
    fn change_tail(&self, _len: u32, _flags: u64) -> Result<(), i64> {
        Err(-1)
    }

    #[inline(always)]
    fn checksum_is_partial(&self, _off: usize, _linear: bool) -> Result<bool, i64> {
        Ok(false)
    }

    /// The Ethernet header's type (XDP runs on Ethernet devices only).
    #[inline(always)]
    fn protocol(&self) -> u32 {
        PacketContext::load::<u16>(self, crate::headers::ETH_TYPE_OFF).map(u32::from).unwrap_or(0)
    }
}
