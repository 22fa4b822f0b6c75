//! Address and port rewrites, for either family (`Family`). The L4 checksum
//! goes through the kernel's helper rather than a hand-made update: with
//! checksum offload a locally sent packet holds only a partial L4 checksum
//! (over the pseudo-header), and the helper knows which parts of it to fix.
//! The pseudo-header part is folded in per 32-bit word of the address that
//! changes (IPv4's one; IPv6's words that stay equal, a shared prefix, cost
//! nothing).
//!
//! IPv4: the header checksum is always a full one, and `parse` pulled the
//! headers into the linear data, so the address, its header checksum and
//! the port are written straight into the packet (direct packet access):
//! two helper calls for a full rewrite instead of five. IPv6 has no header
//! checksum, and `parse` reads its headers with helpers, so it writes with them
//! too.

use aya_ebpf::bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR};
use proxy_common::{Addr, IPPROTO_SCTP, IPPROTO_UDP, csum};

use crate::{context::PacketContext, family::Family, packet::Packet, sctp};
use crate::headers::IPV4_CSUM_OFF;


/// Client -> frontend becomes client -> backend.
#[inline(always)]
pub fn rewrite_dst<F: Family>(ctx: &impl PacketContext, pkt: &Packet, addr: &Addr, port: u16) -> Result<(), i64> {
    rewrite::<F, true, true, _>(ctx, pkt, F::DST_OFF, &pkt.tuple.dst, addr, 2, pkt.tuple.dport, port)
}

/// Backend -> client becomes frontend -> client.
#[inline(always)]
pub fn rewrite_src<F: Family>(ctx: &impl PacketContext, pkt: &Packet, addr: &Addr, port: u16) -> Result<(), i64> {
    rewrite::<F, true, true, _>(ctx, pkt, F::SRC_OFF, &pkt.tuple.src, addr, 0, pkt.tuple.sport, port)
}

/// `rewrite_src` for a TCP or UDP packet only: without SCTP's CRC
/// subprograms, whose stack frames would add to the caller's (see
/// `xdp_forward`).
#[inline(always)]
pub fn rewrite_src_tcp_udp<F: Family>(ctx: &impl PacketContext, pkt: &Packet, addr: &Addr, port: u16) -> Result<(), i64> {
    rewrite::<F, true, false, _>(ctx, pkt, F::SRC_OFF, &pkt.tuple.src, addr, 0, pkt.tuple.sport, port)
}

/// `rewrite_dst` for a later IP fragment, which has no L4 header: the
/// address only (its first fragment carried the ports and the checksum).
#[inline(always)]
pub fn rewrite_dst_address<F: Family>(ctx: &impl PacketContext, pkt: &Packet, addr: &Addr) -> Result<(), i64> {
    let port = pkt.tuple.dport;
    rewrite::<F, false, true, _>(ctx, pkt, F::DST_OFF, &pkt.tuple.dst, addr, 2, port, port)
}

/// `rewrite_src` for a later IP fragment (see `rewrite_dst_address`).
#[inline(always)]
pub fn rewrite_src_address<F: Family>(ctx: &impl PacketContext, pkt: &Packet, addr: &Addr) -> Result<(), i64> {
    let port = pkt.tuple.sport;
    rewrite::<F, false, true, _>(ctx, pkt, F::SRC_OFF, &pkt.tuple.src, addr, 0, port, port)
}

/// `L4`: the packet has its L4 header (every packet but a later fragment),
/// whose port and checksum change too. `SCTP`: it may be an SCTP packet.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn rewrite<F: Family, const L4: bool, const SCTP: bool, C: PacketContext>(
    ctx: &C,
    pkt: &Packet,
    ip_field: usize,
    old_addr: &Addr,
    new_addr: &Addr,
    port_field: usize,
    old_port: u16,
    new_port: u16,
) -> Result<(), i64> {
    // UDP over IPv4 may carry no checksum (0): MANGLED_0 keeps it that way.
    // (Over IPv6 it makes a sum of 0 go out as 0xffff: 0 means "none",
    // which IPv6 forbids.)
    let l4_flags = if pkt.proto == IPPROTO_UDP { BPF_F_MARK_MANGLED_0 as u64 } else { 0 };
    let is_sctp = SCTP && pkt.proto == IPPROTO_SCTP;
    let addr_changes = (F::FIRST_WORD..4).any(|i| word(old_addr, i) != word(new_addr, i));
    let port_changes = old_port != new_port && L4;
    // IPv4's direct writes come first: the helpers below may move the packet.
    if addr_changes {
        set_address::<F>(ctx, pkt.l3_off, ip_field, old_addr, new_addr)?;
    }
    if port_changes && !is_sctp {
        set::<F, u16>(ctx, pkt.l4_off + port_field, new_port)?;
    }
    // IPv4 in TC, address and port: one helper call for both (see
    // `ipv4_address_then_port`).
    if !F::V6 && C::MAY_BE_PARTIAL && addr_changes && port_changes && !is_sctp {
        return ipv4_address_then_port(ctx, pkt, old_addr, new_addr, old_port, new_port, l4_flags);
    }
    // SCTP's CRC32c has no pseudo-header: an address change leaves it alone.
    if addr_changes && !is_sctp && L4 {
        for i in F::FIRST_WORD..4 {
            let (old, new) = (word(old_addr, i), word(new_addr, i));
            if old != new {
                ctx.l4_csum_replace(pkt.l4_csum_off, old as u64, new as u64, l4_flags | BPF_F_PSEUDO_HDR as u64 | 4)?;
            }
        }
    }
    if port_changes {
        if is_sctp {
            return sctp::rewrite_port::<F>(ctx, pkt, port_field, old_port, new_port);
        }
        ctx.l4_csum_replace(pkt.l4_csum_off, old_port as u64, new_port as u64, l4_flags | 2)?;
    }
    Ok(())
}

/// The L4 checksum of an IPv4 TCP or UDP packet in TC whose address and
/// port both changed (already written), with one helper call instead of
/// two. The address's change, a pseudo-header one, must go through the
/// helper, which alone knows whether the packet is CHECKSUM_PARTIAL; the
/// port's must not touch a partial packet at all, and a full checksum
/// takes it as RFC 1624 says. The field as it was before the helper's
/// update and after it tells which the packet is (`csum::pseudo_update`), so
/// a full checksum takes the port's change straight into the field. Where
/// the two cannot be told apart, the helper takes the port too, as before.
#[inline(always)]
fn ipv4_address_then_port(
    ctx: &impl PacketContext,
    pkt: &Packet,
    old_addr: &Addr,
    new_addr: &Addr,
    old_port: u16,
    new_port: u16,
    l4_flags: u64,
) -> Result<(), i64> {
    let (old, new) = (old_addr.v4_octets(), new_addr.v4_octets());
    let before: [u8; 2] = read(ctx, pkt.l4_csum_off)?;
    let (from, to) = (u32::from_ne_bytes(old), u32::from_ne_bytes(new));
    ctx.l4_csum_replace(pkt.l4_csum_off, from as u64, to as u64, l4_flags | BPF_F_PSEUDO_HDR as u64 | 4)?;
    let after: [u8; 2] = read(ctx, pkt.l4_csum_off)?;
    match csum::pseudo_update(before, after, old, new) {
        csum::PseudoUpdate::Partial => Ok(()),
        csum::PseudoUpdate::Full => {
            let updated = csum::replace2(after, old_port.to_ne_bytes(), new_port.to_ne_bytes());
            // UDP: a sum of 0 goes out as 0xffff, 0 meaning "no checksum"
            // (the helper's BPF_F_MARK_MANGLED_0).
            let mangled_0 = l4_flags & BPF_F_MARK_MANGLED_0 as u64 != 0;
            write(ctx, pkt.l4_csum_off, if mangled_0 && updated == [0, 0] { [0xff, 0xff] } else { updated })
        }
        csum::PseudoUpdate::Unknown => {
            ctx.l4_csum_replace(pkt.l4_csum_off, old_port as u64, new_port as u64, l4_flags | 2)
        }
    }
}

/// The address at `l3_off + field`, and IPv4's header checksum over it.
#[inline(always)]
fn set_address<F: Family>(ctx: &impl PacketContext, l3_off: usize, field: usize, old: &Addr, new: &Addr) -> Result<(), i64> {
    if F::V6 {
        return ctx.store(l3_off + field, &new.0, 0);
    }
    let (old, new) = (old.v4_octets(), new.v4_octets());
    let header_csum = read(ctx, l3_off + IPV4_CSUM_OFF)?;
    write(ctx, l3_off + IPV4_CSUM_OFF, csum::replace4(header_csum, old, new))?;
    write(ctx, l3_off + field, new)
}

/// Writes `value` at `off`: straight into the linear data (IPv4), or with
/// the store helper (IPv6, whose headers may lie outside it).
#[inline(always)]
fn set<F: Family, T: Copy>(ctx: &impl PacketContext, off: usize, value: T) -> Result<(), i64> {
    if F::V6 { ctx.store(off, &value, 0) } else { write(ctx, off, value) }
}

/// The `i`th 32-bit word of the address, in network order as the checksum
/// helper takes it.
#[inline(always)]
fn word(addr: &Addr, i: usize) -> u32 {
    let b = &addr.0[i * 4..i * 4 + 4];
    u32::from_ne_bytes([b[0], b[1], b[2], b[3]])
}

/// The `T` at `off`, or an error if the linear part does not hold it
/// (`parse` pulled the headers in, so it does).
#[inline(always)]
fn read<T: Copy>(ctx: &impl PacketContext, off: usize) -> Result<T, i64> {
    crate::context::read(ctx, off).ok_or(-1)
}

#[inline(always)]
fn write<T: Copy>(ctx: &impl PacketContext, off: usize, value: T) -> Result<(), i64> {
    crate::context::write(ctx, off, value).ok_or(-1)
}
