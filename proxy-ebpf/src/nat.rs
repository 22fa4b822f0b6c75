//! Address and port rewrites. The L4 checksum goes through the kernel's
//! helper rather than a hand-made update: with checksum offload a locally
//! sent packet holds only a partial L4 checksum (over the pseudo-header),
//! and the helper knows which parts of it to fix. The IPv4 header checksum
//! is always a full one, so the address, its header checksum and the port
//! are written straight into the packet (direct packet access): two helper
//! calls for a full rewrite instead of five.

use aya_ebpf::bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR};
use proxy_common::{Addr, IPPROTO_SCTP, IPPROTO_UDP, csum};

use crate::{context::PacketContext, packet::Packet, sctp};
use crate::headers::{IPV4_CSUM_OFF, IPV4_SRC_OFF, IPV4_DST_OFF};


/// Client -> frontend becomes client -> backend.
#[inline(always)]
pub fn rewrite_dst(ctx: &impl PacketContext, pkt: &Packet, addr: &Addr, port: u16) -> Result<(), i64> {
    if pkt.v6 {
        return crate::nat6::rewrite_dst::<true>(ctx, pkt, addr, port);
    }
    rewrite::<true>(ctx, pkt, IPV4_DST_OFF, &pkt.tuple.dst, addr, 2, pkt.tuple.dport, port)
}

/// Backend -> client becomes frontend -> client.
#[inline(always)]
pub fn rewrite_src(ctx: &impl PacketContext, pkt: &Packet, addr: &Addr, port: u16) -> Result<(), i64> {
    if pkt.v6 {
        return crate::nat6::rewrite_src::<true>(ctx, pkt, addr, port);
    }
    rewrite::<true>(ctx, pkt, IPV4_SRC_OFF, &pkt.tuple.src, addr, 0, pkt.tuple.sport, port)
}

/// `rewrite_dst` for a later IP fragment, which has no L4 header: the
/// address only (its first fragment carried the ports and the checksum).
#[inline(always)]
pub fn rewrite_dst_address(ctx: &impl PacketContext, pkt: &Packet, addr: &Addr) -> Result<(), i64> {
    let port = pkt.tuple.dport;
    if pkt.v6 {
        return crate::nat6::rewrite_dst::<false>(ctx, pkt, addr, port);
    }
    rewrite::<false>(ctx, pkt, IPV4_DST_OFF, &pkt.tuple.dst, addr, 2, port, port)
}

/// `rewrite_src` for a later IP fragment (see `rewrite_dst_address`).
#[inline(always)]
pub fn rewrite_src_address(ctx: &impl PacketContext, pkt: &Packet, addr: &Addr) -> Result<(), i64> {
    let port = pkt.tuple.sport;
    if pkt.v6 {
        return crate::nat6::rewrite_src::<false>(ctx, pkt, addr, port);
    }
    rewrite::<false>(ctx, pkt, IPV4_SRC_OFF, &pkt.tuple.src, addr, 0, port, port)
}

/// `L4`: the packet has its L4 header (every packet but a later fragment),
/// whose port and checksum change too.
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
    // UDP over IPv4 may carry no checksum (0): MANGLED_0 keeps it that way.
    let l4_flags = if pkt.proto == IPPROTO_UDP { BPF_F_MARK_MANGLED_0 as u64 } else { 0 };
    let is_sctp = pkt.proto == IPPROTO_SCTP;
    let (old_octets, new_octets) = (old_addr.v4_octets(), new_addr.v4_octets());
    let addr_changes = old_octets != new_octets;
    let port_changes = old_port != new_port && L4;
    // The direct writes come first: the helpers below may move the packet.
    if addr_changes {
        let field = read(ctx, pkt.l3_off + IPV4_CSUM_OFF)?;
        write(ctx, pkt.l3_off + IPV4_CSUM_OFF, csum::replace4(field, old_octets, new_octets))?;
        write(ctx, pkt.l3_off + ip_field, new_octets)?;
    }
    if port_changes && !is_sctp {
        write(ctx, pkt.l4_off + port_field, new_port)?;
    }
    // SCTP's CRC32c has no pseudo-header: an address change leaves it alone.
    if addr_changes && !is_sctp && L4 {
        let (old_ip, new_ip) = (u32::from_ne_bytes(old_octets), u32::from_ne_bytes(new_octets));
        ctx.l4_csum_replace(pkt.l4_csum_off, old_ip as u64, new_ip as u64, l4_flags | BPF_F_PSEUDO_HDR as u64 | 4)?;
    }
    if port_changes {
        if is_sctp {
            return sctp::rewrite_port(ctx, pkt, port_field, old_port, new_port);
        }
        ctx.l4_csum_replace(pkt.l4_csum_off, old_port as u64, new_port as u64, l4_flags | 2)?;
    }
    Ok(())
}

/// The `T` at `off`, or an error if the linear part does not hold it
/// (`parse` pulled the headers in, so it does).
#[inline(always)]
fn read<T: Copy>(ctx: &impl PacketContext, off: usize) -> Result<T, i64> {
    crate::context::read(ctx, off).ok_or(-1)
}

#[inline(always)]
fn write<T: Copy>(ctx: &impl PacketContext, off: usize, value: T) -> Result<(), i64> {
    let start = ctx.data();
    if start + off + core::mem::size_of::<T>() > ctx.data_end() {
        return Err(-1);
    }
    unsafe { core::ptr::write_unaligned((start + off) as *mut T, value) };
    Ok(())
}
