//! The packet a program works on, as the datapath logic sees it: one trait
//! that TC's context implements (and XDP's will), so parsing, NAT, SCTP,
//! ICMP errors, fragments and rejects are written once for every hook, as
//! Cilium's `ctx_*` overloads serve its skb and XDP programs.
//!
//! What stays outside it is the hook's own business: the skb's mark and
//! `cb`, its socket, redirects (`skb`, `route`, `l2::push_ethernet`).
//!
//! Every method is `#[inline(always)]`: the logic is monomorphised per
//! context and compiles to what direct calls on the context would.

use aya_ebpf::{EbpfContext, bindings::__sk_buff, helpers::bpf_skb_load_bytes, programs::TcContext};

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

pub trait PacketContext: EbpfContext {
    /// The first byte of the packet's linear data, and one past its last
    /// (direct packet access; the verifier wants every read checked
    /// against the end).
    fn data(&self) -> usize;
    fn data_end(&self) -> usize;
    /// The whole packet's length, also what lies outside the linear data.
    fn len(&self) -> u32;
    /// Makes the first `len` bytes linear, for direct access.
    fn pull_data(&self, len: u32) -> Result<(), i64>;
    /// A copy of the `T` at `off`, wherever it lies.
    fn load<T>(&self, off: usize) -> Result<T, i64>;
    /// `dst.len()` bytes from `off` into `dst`.
    fn load_bytes(&self, off: usize, dst: &mut [u8]) -> Result<(), i64>;
    fn store<T>(&self, off: usize, value: &T, flags: u64) -> Result<(), i64>;
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
    /// at `off`, which the caller overwrites afterwards.
    fn checksum_is_partial(&self, off: usize) -> Result<bool, i64>;
    /// The network protocol (an Ethernet type, network order in the low 16
    /// bits) the packet carries by the hook's metadata: what a device
    /// without Ethernet headers says in place of one.
    fn protocol(&self) -> u32;
}

impl PacketContext for TcContext {
    #[inline(always)]
    fn data(&self) -> usize {
        TcContext::data(self)
    }

    #[inline(always)]
    fn data_end(&self) -> usize {
        TcContext::data_end(self)
    }

    #[inline(always)]
    fn len(&self) -> u32 {
        TcContext::len(self)
    }

    #[inline(always)]
    fn pull_data(&self, len: u32) -> Result<(), i64> {
        TcContext::pull_data(self, len).map(|_| ())
    }

    #[inline(always)]
    fn load<T>(&self, off: usize) -> Result<T, i64> {
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
    fn store<T>(&self, off: usize, value: &T, flags: u64) -> Result<(), i64> {
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
    fn checksum_is_partial(&self, off: usize) -> Result<bool, i64> {
        const PROBE: u16 = 0x1234;
        TcContext::store(self, off, &PROBE, 0)?;
        TcContext::l4_csum_replace(self, off, 0, 1, 2)?;
        Ok(TcContext::load::<u16>(self, off)? == PROBE)
    }

    #[inline(always)]
    fn protocol(&self) -> u32 {
        unsafe { (*(self.as_ptr() as *const __sk_buff)).protocol }
    }
}
