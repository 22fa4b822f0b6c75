//! REJECT as kube-proxy does it (`reject` in nftables, `-j REJECT` in
//! iptables): an ICMP port unreachable back to the sender, for TCP too (the
//! client's connect() fails at once with ECONNREFUSED). The packet is turned
//! into the ICMP error in place and sent back out the interface it came in on.

use aya_ebpf::{helpers::bpf_redirect, programs::TcContext};

use crate::{maps::SCRATCH, parse::Packet};

const ETH_ALEN: usize = 6;
const IPV4_HLEN: usize = 20;
const ICMP_HLEN: usize = 8;
/// RFC 792: the original IP header and the first 8 bytes of its payload.
const QUOTE_LEN: usize = IPV4_HLEN + 8;
const OUT_L3_LEN: usize = IPV4_HLEN + ICMP_HLEN + QUOTE_LEN;
const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
/// The rebuilt frame.
pub const OUT_LEN: usize = ETH_HLEN + OUT_L3_LEN;
const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_PORT_UNREACH: u8 = 3;
const IPPROTO_ICMP: u8 = 1;

/// Rewrites the packet into the ICMP error and redirects it; the caller
/// returns the redirect verdict. Packets with IP options are not handled
/// (fixed sizes keep the verifier simple): the caller drops those. Not
/// inlined, and the packet is built in a per-CPU scratch buffer: the BPF
/// stack (512 bytes for all frames) is already used by the lookup path.
#[inline(never)]
pub fn reject(ctx: &TcContext, pkt: &Packet) -> Result<i32, i64> {
    if pkt.l3_off != ETH_HLEN || pkt.l4_off - pkt.l3_off != IPV4_HLEN {
        return Err(-1);
    }
    let buf = unsafe { &mut *SCRATCH.get_ptr_mut(0).ok_or(-1i64)? };
    buf.fill(0);
    // buf: Ethernet header with the addresses swapped, IPv4, ICMP, quote.
    // Fixed-size loads: the verifier rejects a length it cannot bound below.
    let (eth, out) = buf.split_at_mut(ETH_HLEN);
    eth[..ETH_ALEN].copy_from_slice(&ctx.load::<[u8; ETH_ALEN]>(ETH_ALEN)?);
    eth[ETH_ALEN..2 * ETH_ALEN].copy_from_slice(&ctx.load::<[u8; ETH_ALEN]>(0)?);
    eth[12..14].copy_from_slice(&ETH_P_IP.to_be_bytes());
    let quote_at = IPV4_HLEN + ICMP_HLEN;
    out[quote_at..].copy_from_slice(&ctx.load::<[u8; QUOTE_LEN]>(ETH_HLEN)?);

    // IPv4 header: from the address the client dialled, back to the client.
    out[0] = 0x45;
    out[2..4].copy_from_slice(&(OUT_L3_LEN as u16).to_be_bytes());
    out[8] = 64;
    out[9] = IPPROTO_ICMP;
    for i in 0..4 {
        out[12 + i] = out[quote_at + 16 + i];
        out[16 + i] = out[quote_at + 12 + i];
    }
    let ip_csum = checksum(&out[..IPV4_HLEN]);
    out[10..12].copy_from_slice(&ip_csum.to_be_bytes());
    out[IPV4_HLEN] = ICMP_DEST_UNREACH;
    out[IPV4_HLEN + 1] = ICMP_PORT_UNREACH;
    let icmp_csum = checksum(&out[IPV4_HLEN..]);
    out[IPV4_HLEN + 2..IPV4_HLEN + 4].copy_from_slice(&icmp_csum.to_be_bytes());

    ctx.change_tail(OUT_LEN as u32, 0)?;
    ctx.store(0, &*buf, 0)?;
    let ifindex = crate::skb::ifindex(ctx);
    Ok(unsafe { bpf_redirect(ifindex, 0) } as i32)
}

/// The Internet checksum (RFC 1071) of a short, even-length buffer.
#[inline(always)]
fn checksum(bytes: &[u8]) -> u16 {
    let mut sum = 0u32;
    let mut i = 0;
    while i + 1 < bytes.len() {
        sum += u16::from_be_bytes([bytes[i], bytes[i + 1]]) as u32;
        i += 2;
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}
