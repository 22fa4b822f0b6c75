//! Frames for the packet fixtures, of either family, built with etherparse
//! (which computes every length and checksum): Ethernet frames as the TC
//! programs see them, and bare IP packets as an ICMP error quotes them.
//! Also the reference check of their checksums.

use std::net::IpAddr;

use etherparse::{
    Icmpv4Type, Icmpv6Type, IpHeaders, IpNumber, Ipv4Header, Ipv6FlowLabel, Ipv6Header, NetHeaders, PacketBuilder,
    PacketBuilderStep, PacketHeaders, TcpHeader, TransportHeader, icmpv4, icmpv6,
};

pub const MAC_SRC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];
pub const MAC_DST: [u8; 6] = [0x02, 0, 0, 0, 0, 0x02];

pub type Endpoint = (IpAddr, u16);

/// With an Ethernet header (what a TC program gets), or the IP packet alone
/// (what an ICMP error quotes).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    Ethernet,
    Bare,
}

fn start(src: IpAddr, dst: IpAddr, framing: Framing) -> PacketBuilderStep<IpHeaders> {
    // The builder sets the protocol, lengths and checksum.
    let ip = match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            IpHeaders::Ipv4(Ipv4Header::new(0, 64, IpNumber::UDP, s.octets(), d.octets()).unwrap(), Default::default())
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => IpHeaders::Ipv6(
            Ipv6Header {
                traffic_class: 0,
                flow_label: Ipv6FlowLabel::ZERO,
                payload_length: 0,
                next_header: IpNumber::UDP,
                hop_limit: 64,
                source: s.octets(),
                destination: d.octets(),
            },
            Default::default(),
        ),
        _ => panic!("{src} -> {dst}: one family per packet"),
    };
    match framing {
        Framing::Ethernet => PacketBuilder::ethernet2(MAC_SRC, MAC_DST).ip(ip),
        Framing::Bare => PacketBuilder::ip(ip),
    }
}

pub fn udp(src: Endpoint, dst: Endpoint, payload: &[u8], framing: Framing) -> Vec<u8> {
    let mut v = Vec::new();
    start(src.0, dst.0, framing).udp(src.1, dst.1).write(&mut v, payload).unwrap();
    v
}

/// A client's SYN (sequence 1000000).
pub fn tcp_syn(src: Endpoint, dst: Endpoint, framing: Framing) -> Vec<u8> {
    let mut h = TcpHeader::new(src.1, dst.1, 1_000_000, 64240);
    h.syn = true;
    let mut v = Vec::new();
    start(src.0, dst.0, framing).tcp_header(h).write(&mut v, &[]).unwrap();
    v
}

/// The ICMP errors the fixtures send, in either family's terms.
#[derive(Clone, Copy)]
pub enum IcmpError {
    PortUnreachable,
    /// IPv4's fragmentation needed, IPv6's packet too big, with the MTU.
    TooBig(u16),
    TimeExceeded,
}

/// An ICMP (ICMPv6) error from `src` to `dst` quoting `quote`.
pub fn icmp_error(src: IpAddr, dst: IpAddr, error: IcmpError, quote: &[u8]) -> Vec<u8> {
    let step = start(src, dst, Framing::Ethernet);
    let mut v = Vec::new();
    if src.is_ipv4() {
        let kind = match error {
            IcmpError::PortUnreachable => Icmpv4Type::DestinationUnreachable(icmpv4::DestUnreachableHeader::Port),
            IcmpError::TooBig(mtu) => {
                Icmpv4Type::DestinationUnreachable(icmpv4::DestUnreachableHeader::FragmentationNeeded { next_hop_mtu: mtu })
            }
            IcmpError::TimeExceeded => Icmpv4Type::TimeExceeded(icmpv4::TimeExceededCode::TtlExceededInTransit),
        };
        step.icmpv4(kind).write(&mut v, quote).unwrap();
    } else {
        let kind = match error {
            IcmpError::PortUnreachable => Icmpv6Type::DestinationUnreachable(icmpv6::DestUnreachableCode::Port),
            IcmpError::TooBig(mtu) => Icmpv6Type::PacketTooBig { mtu: u32::from(mtu) },
            IcmpError::TimeExceeded => Icmpv6Type::TimeExceeded(icmpv6::TimeExceededCode::HopLimitExceeded),
        };
        step.icmpv6(kind).write(&mut v, quote).unwrap();
    }
    v
}

/// An IP packet of protocol `proto` (GRE, say: no TCP, UDP, SCTP or ICMP)
/// carrying `payload`.
pub fn ip_packet(src: IpAddr, dst: IpAddr, proto: u8, payload: &[u8]) -> Vec<u8> {
    let mut v = Vec::new();
    start(src, dst, Framing::Ethernet).write(&mut v, IpNumber(proto), payload).unwrap();
    v
}

/// An echo request (ping) from `src` to `dst`.
pub fn icmp_echo(src: IpAddr, dst: IpAddr) -> Vec<u8> {
    let step = start(src, dst, Framing::Ethernet);
    let mut v = Vec::new();
    if src.is_ipv4() {
        step.icmpv4_echo_request(7, 1).write(&mut v, b"ping").unwrap();
    } else {
        step.icmpv6_echo_request(7, 1).write(&mut v, b"ping").unwrap();
    }
    v
}

/// Every checksum of a frame, recomputed from scratch: the IPv4 header's,
/// the TCP or UDP checksum, and for an ICMP (ICMPv6) error its own checksum
/// and those of the packet it quotes (the fixtures quote whole packets).
pub fn recheck_checksums(out: &[u8], _want: &[u8]) -> Result<(), String> {
    let h = PacketHeaders::from_ethernet_slice(out).map_err(|e| format!("output does not parse: {e}"))?;
    let payload = h.payload.slice();
    let mut bad = Vec::new();
    if let Some(NetHeaders::Ipv4(ip, _)) = &h.net
        && ip.header_checksum != ip.calc_header_checksum()
    {
        bad.push(format!("IPv4 header checksum {:#06x}, recomputed {:#06x}", ip.header_checksum, ip.calc_header_checksum()));
    }
    match (&h.net, &h.transport) {
        (Some(NetHeaders::Ipv4(_, _)), Some(TransportHeader::Icmpv4(icmp))) => {
            let sum = icmp.icmp_type.calc_checksum(payload);
            if icmp.checksum != sum {
                bad.push(format!("ICMP checksum {:#06x}, recomputed {sum:#06x}", icmp.checksum));
            }
            bad.extend(recheck_quote(payload).err());
        }
        (Some(NetHeaders::Ipv6(ip, _)), Some(TransportHeader::Icmpv6(icmp))) => {
            let sum = icmp.icmp_type.calc_checksum(ip.source, ip.destination, payload).map_err(|e| e.to_string())?;
            if icmp.checksum != sum {
                bad.push(format!("ICMPv6 checksum {:#06x}, recomputed {sum:#06x}", icmp.checksum));
            }
            bad.extend(recheck_quote(payload).err());
        }
        (net, transport) => bad.extend(recheck_l4("", net, transport, payload).err()),
    }
    if bad.is_empty() { Ok(()) } else { Err(bad.join("; ")) }
}

/// The checksums of a quoted packet: its IPv4 header's and its TCP/UDP one.
fn recheck_quote(quote: &[u8]) -> Result<(), String> {
    let q = PacketHeaders::from_ip_slice(quote).map_err(|e| format!("the quote does not parse: {e}"))?;
    let mut bad = Vec::new();
    if let Some(NetHeaders::Ipv4(ip, _)) = &q.net
        && ip.header_checksum != ip.calc_header_checksum()
    {
        bad.push(format!("quoted IPv4 header checksum {:#06x}, recomputed {:#06x}", ip.header_checksum, ip.calc_header_checksum()));
    }
    bad.extend(recheck_l4("quoted ", &q.net, &q.transport, q.payload.slice()).err());
    if bad.is_empty() { Ok(()) } else { Err(bad.join("; ")) }
}

fn recheck_l4(what: &str, net: &Option<NetHeaders>, transport: &Option<TransportHeader>, data: &[u8]) -> Result<(), String> {
    let (name, got, sum) = match (net, transport) {
        (Some(NetHeaders::Ipv4(ip, _)), Some(TransportHeader::Udp(udp))) => ("UDP", udp.checksum, udp.calc_checksum_ipv4(ip, data)),
        (Some(NetHeaders::Ipv4(ip, _)), Some(TransportHeader::Tcp(tcp))) => ("TCP", tcp.checksum, tcp.calc_checksum_ipv4(ip, data)),
        (Some(NetHeaders::Ipv6(ip, _)), Some(TransportHeader::Udp(udp))) => ("UDP", udp.checksum, udp.calc_checksum_ipv6(ip, data)),
        (Some(NetHeaders::Ipv6(ip, _)), Some(TransportHeader::Tcp(tcp))) => ("TCP", tcp.checksum, tcp.calc_checksum_ipv6(ip, data)),
        _ => return Err(format!("the {what}packet holds no TCP or UDP header")),
    };
    let sum = sum.map_err(|e| e.to_string())?;
    if got != sum { Err(format!("{what}{name} checksum {got:#06x}, recomputed {sum:#06x}")) } else { Ok(()) }
}

/// An Ethernet frame's IP datagram (IPv4 without options, or IPv6 with no
/// extension header) cut into fragments of `chunk` payload bytes (a multiple
/// of 8) with IP ID `id`, as a router or the sender's stack cuts it: IPv4
/// headers with MF and the offset (and their checksum), or an IPv6 Fragment
/// header after the fixed one. The L4 header and checksum stay in the first.
pub fn fragments(frame: &[u8], chunk: usize, id: u32) -> Vec<Vec<u8>> {
    assert!(chunk.is_multiple_of(8), "fragment payloads are multiples of 8 bytes");
    const ETH: usize = 14;
    let v6 = frame[ETH] >> 4 == 6;
    let ip_hlen = if v6 { 40 } else { 20 };
    assert!(v6 || frame[ETH] & 0x0f == 5, "IPv4 options are not cut here");
    let (head, payload) = frame.split_at(ETH + ip_hlen);
    let count = payload.len().div_ceil(chunk);
    (0..count)
        .map(|i| {
            let part = &payload[i * chunk..payload.len().min((i + 1) * chunk)];
            let more = i + 1 < count;
            let offset = (i * chunk / 8) as u16;
            let mut f = head.to_vec();
            if v6 {
                let next = f[ETH + 6];
                f[ETH + 6] = 44;
                f[ETH + 4..ETH + 6].copy_from_slice(&((8 + part.len()) as u16).to_be_bytes());
                f.extend_from_slice(&[next, 0]);
                f.extend_from_slice(&((offset << 3) | more as u16).to_be_bytes());
                f.extend_from_slice(&id.to_be_bytes());
            } else {
                let ip = &mut f[ETH..ETH + 20];
                ip[2..4].copy_from_slice(&((20 + part.len()) as u16).to_be_bytes());
                ip[4..6].copy_from_slice(&(id as u16).to_be_bytes());
                ip[6..8].copy_from_slice(&(((more as u16) << 13) | offset).to_be_bytes());
                ip[10..12].copy_from_slice(&[0, 0]);
                let sum = Ipv4Header::from_slice(ip).unwrap().0.calc_header_checksum();
                ip[10..12].copy_from_slice(&sum.to_be_bytes());
            }
            f.extend_from_slice(part);
            f
        })
        .collect()
}

/// The checks `recheck_checksums` can make of a fragment, which holds only
/// a part of its datagram: the IPv4 header checksum (the L4 checksum, over
/// the whole datagram, is checked by comparing the fragments with those of
/// a datagram etherparse built).
pub fn recheck_fragment(out: &[u8], _want: &[u8]) -> Result<(), String> {
    if out.len() < 34 || out[14] >> 4 != 4 {
        return Ok(());
    }
    let (ip, _) = Ipv4Header::from_slice(&out[14..]).map_err(|e| format!("output does not parse: {e}"))?;
    if ip.header_checksum != ip.calc_header_checksum() {
        return Err(format!("IPv4 header checksum {:#06x}, recomputed {:#06x}", ip.header_checksum, ip.calc_header_checksum()));
    }
    Ok(())
}
