//! Header parsing with bounds checks. Anything we cannot fully read — short,
//! malformed, fragmented, not TCP/UDP/SCTP — is reported, never guessed at.
//! IPv6 is parsed in `parse6`, by the IPv6 programs.

use aya_ebpf::programs::TcContext;
use proxy_common::{Addr, Counter, CtKey, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP};

pub const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const IP_MF_AND_OFFSET: u16 = 0x3fff;

pub struct Packet {
    /// The tuple as it arrived (ports in network order).
    pub tuple: CtKey,
    /// Offsets of the IPv4 addresses and of the L4 ports and checksum.
    pub l3_off: usize,
    pub l4_off: usize,
    pub l4_csum_off: usize,
    /// End of the IP datagram (Ethernet padding may follow): SCTP's CRC
    /// covers everything from `l4_off` to here.
    pub l4_end: usize,
    pub proto: u8,
    /// TCP flags (0 for other protocols).
    pub tcp_flags: u8,
    /// An IPv6 packet: the addresses are 16 bytes at `parse6`'s offsets.
    pub v6: bool,
}

pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_ACK: u8 = 0x10;

impl Packet {
    /// A TCP SYN without ACK: a client opening a connection.
    #[inline(always)]
    pub fn opens_connection(&self) -> bool {
        self.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN
    }

    /// A TCP FIN or RST: this direction of the connection is ending.
    #[inline(always)]
    pub fn closes_connection(&self) -> bool {
        self.tcp_flags & (TCP_FIN | TCP_RST) != 0
    }
}

// Inlined: as a subprogram its stack frame would add to tc_egress's, past
// the kernel's 512 bytes.
#[inline(always)]
pub fn parse(ctx: &TcContext) -> Result<Packet, Counter> {
    let ethertype = u16::from_be(ctx.load::<u16>(12).map_err(|_| Counter::Malformed)?);
    if ethertype != ETH_P_IP {
        return Err(Counter::Passed);
    }
    let l3_off = ETH_HLEN;
    let ver_ihl: u8 = ctx.load(l3_off).map_err(|_| Counter::Malformed)?;
    let ihl = ((ver_ihl & 0x0f) as usize) * 4;
    if ver_ihl >> 4 != 4 || ihl < 20 {
        return Err(Counter::Malformed);
    }
    let total_len = u16::from_be(ctx.load::<u16>(l3_off + 2).map_err(|_| Counter::Malformed)?) as usize;
    if total_len < ihl || l3_off + total_len > ctx.len() as usize {
        return Err(Counter::Malformed);
    }
    let frag = u16::from_be(ctx.load::<u16>(l3_off + 6).map_err(|_| Counter::Malformed)?);
    if frag & IP_MF_AND_OFFSET != 0 {
        // Only the first fragment carries ports; translating it alone would
        // split the datagram across two destinations.
        return Err(Counter::Fragment);
    }
    let proto: u8 = ctx.load(l3_off + 9).map_err(|_| Counter::Malformed)?;
    let (l4_hlen, csum_field) = match proto {
        IPPROTO_TCP => (20, 16),
        IPPROTO_UDP => (8, 6),
        IPPROTO_SCTP => (crate::sctp::COMMON_HEADER_LEN, crate::sctp::CHECKSUM_OFF),
        _ => return Err(Counter::Passed),
    };
    let l4_off = l3_off + ihl;
    if l4_off + l4_hlen > l3_off + total_len {
        return Err(Counter::Malformed);
    }
    let src: [u8; 4] = ctx.load(l3_off + 12).map_err(|_| Counter::Malformed)?;
    let dst: [u8; 4] = ctx.load(l3_off + 16).map_err(|_| Counter::Malformed)?;
    let sport: u16 = ctx.load(l4_off).map_err(|_| Counter::Malformed)?;
    let dport: u16 = ctx.load(l4_off + 2).map_err(|_| Counter::Malformed)?;
    let tcp_flags: u8 = if proto == IPPROTO_TCP { ctx.load(l4_off + 13).map_err(|_| Counter::Malformed)? } else { 0 };
    Ok(Packet {
        tuple: CtKey {
            src: Addr::from_v4_octets(src),
            dst: Addr::from_v4_octets(dst),
            sport,
            dport,
            proto,
            _pad: [0; 3],
        },
        l3_off,
        l4_off,
        l4_csum_off: l4_off + csum_field,
        l4_end: l3_off + total_len,
        proto,
        tcp_flags,
        v6: false,
    })
}
