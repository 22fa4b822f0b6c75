//! REJECT for IPv6, as `reject` does it for IPv4: a TCP RST for TCP, an
//! ICMPv6 port unreachable (RFC 4443: type 1, code 4) for anything else,
//! built from the packet and sent back out the interface it came in on.
//!
//! CHECKSUM_PARTIAL (a packet from a local socket or an offloading pod): the
//! sender on will sum from the original L4 header (here, the reply's) to the
//! end and store the result at a fixed offset: 16 for TCP, 6 for UDP. The
//! RST keeps its checksum field there, holding the pseudo-header seed. For
//! the ICMPv6 reply, offset 6 is the second half of the unused word, which
//! receivers ignore: it gets the seed, so completion makes the whole sum
//! right (ICMPv6, unlike ICMP, covers a pseudo-header).

use aya_ebpf::{macros::map, maps::PerCpuArray};
use proxy_common::IPPROTO_TCP;

use crate::{
    context::PacketContext,
    headers::{ETH_HLEN, ETH_ALEN, ETH_P_IPV6, IPV6_HLEN, TCP_HLEN, TCP_CSUM_OFF, UDP_CSUM_OFF},
    l2,
    packet::Packet,
    reject::{fold, reset_in_place, sum},
};

/// Room to build an IPv6 REJECT's frame off the stack; not pinned, per CPU.
#[map]
static SCRATCH6: PerCpuArray<[u8; OUT_LEN]> = PerCpuArray::with_max_entries(1, 0);

const ICMP6_HLEN: usize = 8;
/// The original header and the first 8 bytes of its payload (the ports):
/// what a receiver needs to find the socket, well within the minimum MTU.
const QUOTE_LEN: usize = IPV6_HLEN + 8;
const ICMP6_LEN: usize = ICMP6_HLEN + QUOTE_LEN;
const RST_L3_LEN: usize = IPV6_HLEN + TCP_HLEN;
const ICMP6_L3_LEN: usize = IPV6_HLEN + ICMP6_LEN;
/// The largest frame built here (the ICMPv6 one), with an Ethernet header
/// (left out on an L3 device, see `l2::store_frame`).
pub const OUT_LEN: usize = ETH_HLEN + ICMP6_L3_LEN;
/// The L4 header in the frame.
const L4: usize = ETH_HLEN + IPV6_HLEN;
const ICMP6_DST_UNREACH: u8 = 1;
const ICMP6_PORT_UNREACH: u8 = 4;
const IPPROTO_ICMPV6: u8 = 58;

/// Rewrites the packet into the reject; the caller redirects it. Only a packet without extension headers gets here
/// (parse leaves the others alone). Everything is loaded straight into the
/// per-CPU scratch frame: the lookup path leaves little of the 512-byte
/// stack, and an IPv6 header is 40 bytes.
#[inline(always)]
pub fn reject(ctx: &impl PacketContext, pkt: &Packet) -> Result<(), i64> {
    let l3 = l2::l3_off();
    if pkt.l3_off != l3 || pkt.l4_off != l3 + IPV6_HLEN {
        return Err(-1);
    }
    let buf = unsafe { &mut *SCRATCH6.get_ptr_mut(0).ok_or(-1i64)? };
    buf.fill(0);
    // Ethernet back to the sender; IPv6 from the address dialled back to the client.
    if l2::has_ethernet() {
        ctx.load_bytes(ETH_ALEN, &mut buf[..ETH_ALEN])?;
        ctx.load_bytes(0, &mut buf[ETH_ALEN..2 * ETH_ALEN])?;
        buf[12..14].copy_from_slice(&ETH_P_IPV6.to_be_bytes());
    }
    ctx.load_bytes(l3 + 24, &mut buf[ETH_HLEN + 8..ETH_HLEN + 24])?;
    ctx.load_bytes(l3 + 8, &mut buf[ETH_HLEN + 24..L4])?;
    let orig_payload: u16 = u16::from_be(ctx.load(l3 + 4)?);
    let tcp = pkt.tuple.proto == IPPROTO_TCP;

    let payload = if tcp { TCP_HLEN } else { ICMP6_LEN };
    let ip = &mut buf[ETH_HLEN..L4];
    ip[0] = 0x60;
    ip[4..6].copy_from_slice(&(payload as u16).to_be_bytes());
    ip[6] = if tcp { IPPROTO_TCP } else { IPPROTO_ICMPV6 };
    ip[7] = 64;

    if tcp {
        // The segment's header, loaded where the reset's goes, then rewritten.
        let tcp: &mut [u8; TCP_HLEN] = (&mut buf[L4..L4 + TCP_HLEN]).try_into().map_err(|_| -1i64)?;
        ctx.load_bytes(l3 + IPV6_HLEN, tcp)?;
        reset_in_place(tcp, orig_payload as u32);
    } else {
        // The original IPv6 header and the 8 bytes after it.
        ctx.load_bytes(l3, &mut buf[L4 + ICMP6_HLEN..L4 + ICMP6_LEN])?;
        buf[L4] = ICMP6_DST_UNREACH;
        buf[L4 + 1] = ICMP6_PORT_UNREACH;
    }
    let len = l3 + IPV6_HLEN + payload;
    ctx.change_tail(len as u32, 0)?;
    // Probe before the final write, on the offset completion would write.
    let partial = ctx.checksum_is_partial(l3 + IPV6_HLEN + if tcp { TCP_CSUM_OFF } else { UDP_CSUM_OFF })?;
    // Pseudo-header (RFC 8200 8.1): addresses, upper-layer length, next
    // header. Summed after the helper calls: LLVM would otherwise load the
    // bytes before them and keep them on the stack across.
    let pseudo = sum(&buf[ETH_HLEN + 8..L4], payload as u32 + buf[ETH_HLEN + 6] as u32);
    if tcp {
        let csum = if partial { fold(pseudo) } else { !fold(sum(&buf[L4..L4 + TCP_HLEN], pseudo)) };
        buf[L4 + TCP_CSUM_OFF..L4 + TCP_CSUM_OFF + 2].copy_from_slice(&csum.to_be_bytes());
        l2::store_frame::<RST_L3_LEN>(ctx, buf)?;
    } else {
        if partial {
            buf[L4 + UDP_CSUM_OFF..L4 + UDP_CSUM_OFF + 2].copy_from_slice(&fold(pseudo).to_be_bytes());
        } else {
            let csum = !fold(sum(&buf[L4..L4 + ICMP6_LEN], pseudo));
            buf[L4 + 2..L4 + 4].copy_from_slice(&csum.to_be_bytes());
        }
        l2::store_frame::<ICMP6_L3_LEN>(ctx, buf)?;
    }
    Ok(())
}
