//! Address and port rewrites. The kernel's checksum helpers are used rather
//! than hand-made updates: with checksum offload a locally sent packet holds
//! only a partial L4 checksum (over the pseudo-header), and the helpers know
//! which parts of it to fix.

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    programs::TcContext,
};
use proxy_common::{Addr, IPPROTO_SCTP, IPPROTO_UDP};

use crate::{parse::Packet, sctp};

const IP_CSUM_OFF: usize = 10;
const IP_SRC_OFF: usize = 12;
const IP_DST_OFF: usize = 16;

/// Client -> frontend becomes client -> backend.
#[inline(always)]
pub fn rewrite_dst(ctx: &TcContext, pkt: &Packet, addr: &Addr, port: u16) -> Result<(), i64> {
    if pkt.v6 {
        return crate::nat6::rewrite_dst(ctx, pkt, addr, port);
    }
    rewrite(ctx, pkt, IP_DST_OFF, &pkt.tuple.dst, addr, 2, pkt.tuple.dport, port)
}

/// Backend -> client becomes frontend -> client.
#[inline(always)]
pub fn rewrite_src(ctx: &TcContext, pkt: &Packet, addr: &Addr, port: u16) -> Result<(), i64> {
    if pkt.v6 {
        return crate::nat6::rewrite_src(ctx, pkt, addr, port);
    }
    rewrite(ctx, pkt, IP_SRC_OFF, &pkt.tuple.src, addr, 0, pkt.tuple.sport, port)
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn rewrite(
    ctx: &TcContext,
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
    let old_ip = u32::from_ne_bytes(old_addr.v4_octets());
    let new_ip = u32::from_ne_bytes(new_addr.v4_octets());
    if old_ip != new_ip {
        // SCTP's CRC32c has no pseudo-header: an address change leaves it alone.
        if !is_sctp {
            ctx.l4_csum_replace(pkt.l4_csum_off, old_ip as u64, new_ip as u64, l4_flags | BPF_F_PSEUDO_HDR as u64 | 4)?;
        }
        ctx.l3_csum_replace(pkt.l3_off + IP_CSUM_OFF, old_ip as u64, new_ip as u64, 4)?;
        ctx.store(pkt.l3_off + ip_field, &new_addr.v4_octets(), 0)?;
    }
    if old_port != new_port {
        if is_sctp {
            return sctp::rewrite_port(ctx, pkt, port_field, old_port, new_port);
        }
        ctx.l4_csum_replace(pkt.l4_csum_off, old_port as u64, new_port as u64, l4_flags | 2)?;
        ctx.store(pkt.l4_off + port_field, &new_port, 0)?;
    }
    Ok(())
}
