//! SCTP: the common header and the CRC32c-aware port rewrite.
//!
//! SCTP's checksum is a CRC32c over the SCTP packet only (no IP
//! pseudo-header), so address rewrites leave it alone (see `nat`) and a port
//! rewrite folds the change into the stored CRC with `update_port`: a fixed
//! number of GF(2) multiplications, whatever the packet length. The update
//! only adds the difference, so a corrupt CRC stays exactly as corrupt.
//!
//! A packet whose CRC the kernel (or the NIC) computes later —
//! `skb->ip_summed == CHECKSUM_PARTIAL`, as with SCTP CRC offload on a
//! locally sent packet — carries no CRC yet, and that later computation
//! runs over the field as it stands: patching it would plant an error. The
//! `__sk_buff` context does not expose `ip_summed` and no helper reports
//! CHECKSUM_PARTIAL. But a TC program's context pointer is the kernel's
//! `struct sk_buff *`, so `bpf_probe_read_kernel` reads the field at the
//! offset the agent found in this kernel's BTF (/sys/kernel/btf/vmlinux) and
//! passed in the read-only globals below. (The kfunc `bpf_cast_to_kern_ctx`
//! would let the verifier check the access, but bpf-linker 0.13 emits no
//! `.ksyms` BTF for extern functions, so aya cannot resolve it.)

use aya_ebpf::{EbpfContext as _, Global, helpers::bpf_probe_read_kernel, programs::TcContext};
use proxy_common::crc32c::update_port;

use crate::parse::Packet;

/// Source port, destination port, verification tag, checksum.
pub const COMMON_HEADER_LEN: usize = 12;
pub const CHECKSUM_OFF: usize = 8;

/// `ip_summed` value (include/linux/skbuff.h).
const CHECKSUM_PARTIAL: u8 = 3;
/// Set in `SKB_IP_SUMMED_OFF` when the layout is unknown: the CRC is then
/// always updated in software.
pub const LAYOUT_UNKNOWN: u32 = u32::MAX;

/// Byte offset of the byte holding `sk_buff::ip_summed`, and the bit shift
/// of the 2-bit field within it, set by the loader (`EbpfLoader::override_global`).
#[unsafe(no_mangle)]
static SKB_IP_SUMMED_OFF: Global<u32> = Global::new(LAYOUT_UNKNOWN);
#[unsafe(no_mangle)]
static SKB_IP_SUMMED_SHIFT: Global<u32> = Global::new(0);

/// Whether the kernel will compute this packet's checksum itself later.
#[inline(always)]
pub fn checksum_left_to_kernel(ctx: &TcContext) -> bool {
    let off = SKB_IP_SUMMED_OFF.load();
    if off == LAYOUT_UNKNOWN {
        return false;
    }
    let shift = SKB_IP_SUMMED_SHIFT.load();
    let skb = ctx.as_ptr() as *const u8;
    // A failed read (never expected) counts as "not offloaded": the CRC is
    // then updated in software, which is right for all but offloaded packets.
    match unsafe { bpf_probe_read_kernel(skb.wrapping_add(off as usize)) } {
        Ok(byte) => (byte >> shift) & 3 == CHECKSUM_PARTIAL,
        Err(_) => false,
    }
}

/// Writes `new_port` at `port_field` (0: source, 2: destination) of the
/// SCTP header and updates the CRC32c by the change, unless the kernel will
/// compute the CRC later.
#[inline(always)]
pub fn rewrite_port(ctx: &TcContext, pkt: &Packet, port_field: usize, old_port: u16, new_port: u16) -> Result<(), i64> {
    if !checksum_left_to_kernel(ctx) {
        // A plain little-endian load of the field is the CRC value itself
        // (SCTP sends it least significant byte first).
        let stored: u32 = ctx.load(pkt.l4_csum_off)?;
        let after_port = pkt.l4_off + port_field + 2;
        let dist = pkt.l4_end.checked_sub(after_port).ok_or(-1i64)?;
        let crc = update_port(stored, old_port.to_ne_bytes(), new_port.to_ne_bytes(), dist as u16);
        ctx.store(pkt.l4_csum_off, &crc, 0)?;
    }
    ctx.store(pkt.l4_off + port_field, &new_port, 0)?;
    Ok(())
}
