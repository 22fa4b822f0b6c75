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
//! runs over the field as it stands: patching it would plant an error. TC
//! programs cannot read `ip_summed`; `PacketContext::checksum_is_partial` tells by
//! the l4 checksum helper's behaviour (it leaves a partial packet's field
//! alone), on the CRC field itself, which is restored or rewritten after.

use proxy_common::crc32c::update_port;

use crate::{
    context::{PacketContext, load_linear_first, store_linear_first},
    family::Family,
    headers::TCP_SYN,
    packet::Packet,
};

/// Source port, destination port, verification tag, checksum.
pub const COMMON_HEADER_LEN: usize = 12;
pub const CHECKSUM_OFF: usize = 8;
/// The chunk that opens an association (RFC 9260 3.3.2): the only one
/// that may start a flow.
const CHUNK_INIT: u8 = 1;

/// The opening of an association as TCP flags, given the packet's first
/// chunk type: TCP_SYN for an INIT, so `Packet::opens_connection` reads the
/// same for both protocols.
#[inline(always)]
pub fn opening_flags(first_chunk: Option<u8>) -> u8 {
    if first_chunk == Some(CHUNK_INIT) { TCP_SYN } else { 0 }
}

/// Writes `new_port` at `port_field` (0: source, 2: destination) of the
/// SCTP header and updates the CRC32c by the change, unless the kernel will
/// compute the CRC later.
///
/// The helper calls live in two small subprograms, called one after the
/// other: a subprogram's stack frame adds to its caller's, and tc_egress's
/// own frame leaves little of the kernel's 512 bytes.
///
/// IPv4's fields are read and written in the linear data (`parse` pulled the
/// headers in), which saves five helper calls; IPv6's with helpers, as
/// everything of IPv6 (`LINEAR`: a constant per subprogram, so the verifier
/// of an IPv6 program never sees a packet pointer moved by an offset it
/// cannot bound).
#[inline(always)]
pub fn rewrite_port<F: Family>(ctx: &impl PacketContext, pkt: &Packet, port_field: usize, old_port: u16, new_port: u16) -> Result<(), i64> {
    let port_off = pkt.l4_off + port_field;
    let dist = pkt.l4_end.checked_sub(port_off + 2).ok_or(-1i64)?;
    let probed = if F::V6 { load_crc_and_probe::<false>(ctx, pkt.l4_csum_off) } else { load_crc_and_probe::<true>(ctx, pkt.l4_csum_off) };
    if probed < 0 {
        return Err(probed);
    }
    let stored = probed as u32;
    let crc = if probed & PARTIAL != 0 {
        stored
    } else {
        crc_after_port_change(stored, old_port as u32, new_port as u32, dist as u32)
    };
    let written = if F::V6 {
        store_crc_and_port::<false>(ctx, pkt.l4_csum_off, crc, port_off, new_port)
    } else {
        store_crc_and_port::<true>(ctx, pkt.l4_csum_off, crc, port_off, new_port)
    };
    match written {
        0 => Ok(()),
        err => Err(err),
    }
}

/// `update_port` as a global BPF function (exported, BTF linkage global):
/// the verifier checks it once per program, on its own, instead of walking
/// its 32 rounds again on every path that rewrites an SCTP port. Global
/// functions take and return only scalars, so the ports travel as u32.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn crc_after_port_change(stored: u32, old_port: u32, new_port: u32, dist_from_end: u32) -> u32 {
    update_port(stored, (old_port as u16).to_ne_bytes(), (new_port as u16).to_ne_bytes(), dist_from_end as u16)
}

/// Set in `load_crc_and_probe`'s result when the packet is CHECKSUM_PARTIAL.
const PARTIAL: i64 = 1 << 32;

/// The stored CRC (low 32 bits; a plain little-endian load of the field is
/// the CRC value, SCTP sending it least significant byte first), `PARTIAL`
/// if the kernel computes the checksum later, or a helper's negative error.
/// Leaves the probe's bytes in the field: `store_crc_and_port` overwrites them.
#[inline(never)]
fn load_crc_and_probe<const LINEAR: bool>(ctx: &impl PacketContext, csum_off: usize) -> i64 {
    let ctx = opaque(ctx);
    let Ok(stored) = get::<LINEAR, u32>(ctx, csum_off) else { return -1 };
    match ctx.checksum_is_partial(csum_off, LINEAR) {
        Ok(true) => i64::from(stored) | PARTIAL,
        Ok(false) => i64::from(stored),
        Err(e) => e,
    }
}

/// Writes the CRC and the port (network order); 0 or a helper's negative error.
#[inline(never)]
fn store_crc_and_port<const LINEAR: bool>(ctx: &impl PacketContext, csum_off: usize, crc: u32, port_off: usize, port: u16) -> i64 {
    let ctx = opaque(ctx);
    if let Err(e) = put::<LINEAR, _>(ctx, csum_off, crc) {
        return e;
    }
    match put::<LINEAR, _>(ctx, port_off, port) {
        Ok(()) => 0,
        Err(e) => e,
    }
}

/// The `T` at `off`: in the linear data where it lies there (`LINEAR`), else
/// with the load helper.
#[inline(always)]
fn get<const LINEAR: bool, T: Copy>(ctx: &impl PacketContext, off: usize) -> Result<T, i64> {
    if LINEAR { load_linear_first(ctx, off) } else { ctx.load(off) }
}

/// Writes `value` at `off` as `get` reads.
#[inline(always)]
fn put<const LINEAR: bool, T: Copy>(ctx: &impl PacketContext, off: usize, value: T) -> Result<(), i64> {
    if LINEAR { store_linear_first(ctx, off, value) } else { ctx.store(off, &value, 0) }
}

/// The context as the subprogram's own: without it, LLVM passes an XDP
/// context's packet pointers in as 32-bit arguments (it knows where the
/// caller read them), and widening them is arithmetic the verifier forbids
/// on pointers.
#[inline(always)]
fn opaque<C: PacketContext>(ctx: &C) -> &C {
    core::hint::black_box(ctx)
}
