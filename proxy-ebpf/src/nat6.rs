//! IPv6 address and port rewrites. IPv6 has no header checksum; the TCP/UDP
//! checksum covers the 16-byte addresses through the pseudo-header, so each
//! 32-bit word that changes is folded in with the kernel's helper (which,
//! like IPv4's, handles a CHECKSUM_PARTIAL packet from a local socket).
//! Words that stay equal (a shared prefix) cost nothing.

use aya_ebpf::bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR};
use proxy_common::{Addr, IPPROTO_SCTP, IPPROTO_UDP};

use crate::{context::PacketContext, headers::{IPV6_SRC_OFF, IPV6_DST_OFF}, packet::Packet, sctp};

/// Client -> frontend becomes client -> backend. `L4`: see nat::rewrite.
#[inline(always)]
pub fn rewrite_dst<const L4: bool>(ctx: &impl PacketContext, pkt: &Packet, addr: &Addr, port: u16) -> Result<(), i64> {
    rewrite::<L4>(ctx, pkt, IPV6_DST_OFF, &pkt.tuple.dst, addr, 2, pkt.tuple.dport, port)
}

/// Backend -> client becomes frontend -> client.
#[inline(always)]
pub fn rewrite_src<const L4: bool>(ctx: &impl PacketContext, pkt: &Packet, addr: &Addr, port: u16) -> Result<(), i64> {
    rewrite::<L4>(ctx, pkt, IPV6_SRC_OFF, &pkt.tuple.src, addr, 0, pkt.tuple.sport, port)
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn rewrite<const L4: bool>(
    ctx: &impl PacketContext,
    pkt: &Packet,
    ip_field: usize,
    old_addr: &Addr,
    new_addr: &Addr,
    port_field: usize,
    old_port: u16,
    new_port: u16,
) -> Result<(), i64> {
    // A UDP checksum that sums to 0 is sent as 0xffff (0 means "none", which
    // IPv6 forbids).
    let l4_flags = if pkt.proto == IPPROTO_UDP { BPF_F_MARK_MANGLED_0 as u64 } else { 0 };
    let is_sctp = pkt.proto == IPPROTO_SCTP;
    if old_addr != new_addr {
        // SCTP's CRC32c has no pseudo-header: an address change leaves it alone.
        if !is_sctp && L4 {
            for i in 0..4 {
                let old = word(old_addr, i);
                let new = word(new_addr, i);
                if old != new {
                    ctx.l4_csum_replace(pkt.l4_csum_off, old as u64, new as u64, l4_flags | BPF_F_PSEUDO_HDR as u64 | 4)?;
                }
            }
        }
        ctx.store(pkt.l3_off + ip_field, &new_addr.0, 0)?;
    }
    if old_port != new_port && L4 {
        if is_sctp {
            return sctp::rewrite_port(ctx, pkt, port_field, old_port, new_port);
        }
        ctx.l4_csum_replace(pkt.l4_csum_off, old_port as u64, new_port as u64, l4_flags | 2)?;
        ctx.store(pkt.l4_off + port_field, &new_port, 0)?;
    }
    Ok(())
}

/// The `i`th 32-bit word of the address, in network order as the checksum
/// helper takes it.
#[inline(always)]
fn word(addr: &Addr, i: usize) -> u32 {
    let b = &addr.0[i * 4..i * 4 + 4];
    u32::from_ne_bytes([b[0], b[1], b[2], b[3]])
}
