//! Frames for the packet tests (fixtures, property tests, micro-benchmark),
//! of either family, built with etherparse (which computes every length and
//! checksum): Ethernet frames as the TC programs see them, and bare IP
//! packets as an ICMP error quotes them. Also the edits the tests make to
//! them (each leaving the rest of the frame valid), the REJECT a frame draws,
//! and the reference checks of a frame out of a program: its checksums
//! recomputed from scratch, and the names of its header fields.

use std::net::IpAddr;

use etherparse::{
    Icmpv4Type, Icmpv6Type, IpHeaders, IpNumber, Ipv4Header, Ipv6FlowLabel, Ipv6Header, NetHeaders, PacketBuilder,
    PacketBuilderStep, PacketHeaders, PayloadSlice, TcpHeader, TransportHeader, icmpv4, icmpv6,
};
use proxy_common::{IPPROTO_ICMP, IPPROTO_ICMPV6, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP};

use crate::sctp;

pub const MAC_SRC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];
pub const MAC_DST: [u8; 6] = [0x02, 0, 0, 0, 0, 0x02];
pub const ETH_HLEN: usize = 14;
pub const IPV6_HLEN: usize = 40;

pub type Endpoint = (IpAddr, u16);

/// An address and port, the address as any of std's (or octets) converts.
pub trait ToEndpoint {
    fn endpoint(self) -> Endpoint;
}

impl<A: Into<IpAddr>> ToEndpoint for (A, u16) {
    fn endpoint(self) -> Endpoint {
        (self.0.into(), self.1)
    }
}

/// The Ethernet and IP headers of a frame from `src` to `dst`; the builder
/// sets the protocol, lengths and checksum.
fn start(src: IpAddr, dst: IpAddr, macs: ([u8; 6], [u8; 6])) -> PacketBuilderStep<IpHeaders> {
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
    PacketBuilder::ethernet2(macs.0, macs.1).ip(ip)
}

fn forward(src: IpAddr, dst: IpAddr) -> PacketBuilderStep<IpHeaders> {
    start(src, dst, (MAC_SRC, MAC_DST))
}

fn written(write: impl FnOnce(&mut Vec<u8>) -> Result<(), etherparse::err::packet::BuildWriteError>) -> Vec<u8> {
    let mut v = Vec::new();
    write(&mut v).expect("building a frame");
    v
}

/// The IP packet of a frame, without its Ethernet header: what an ICMP
/// error quotes.
pub fn ip_of(frame: &[u8]) -> Vec<u8> {
    frame[ETH_HLEN..].to_vec()
}

pub fn udp(src: impl ToEndpoint, dst: impl ToEndpoint, payload: &[u8]) -> Vec<u8> {
    let (src, dst) = (src.endpoint(), dst.endpoint());
    written(|v| forward(src.0, dst.0).udp(src.1, dst.1).write(v, payload))
}

/// A TCP segment whose header starts as a client's SYN has it (sequence
/// 1000000, window 64240) with no flag set, then is edited by `edit`.
pub fn tcp(src: impl ToEndpoint, dst: impl ToEndpoint, payload: &[u8], edit: impl FnOnce(&mut TcpHeader)) -> Vec<u8> {
    let (src, dst) = (src.endpoint(), dst.endpoint());
    let mut h = TcpHeader::new(src.1, dst.1, 1_000_000, 64240);
    edit(&mut h);
    written(|v| forward(src.0, dst.0).tcp_header(h).write(v, payload))
}

/// A client's SYN (sequence 1000000).
pub fn tcp_syn(src: impl ToEndpoint, dst: impl ToEndpoint) -> Vec<u8> {
    tcp(src, dst, &[], |h| h.syn = true)
}

/// The client's data after the handshake (sequence 1000001, ACK 2000001, PSH).
pub fn tcp_data(src: impl ToEndpoint, dst: impl ToEndpoint, payload: &[u8]) -> Vec<u8> {
    tcp(src, dst, payload, |h| {
        established(h, 1_000_001, 2_000_001);
        h.psh = true;
    })
}

/// A bare ACK of `ack` from the client (sequence 1000001, after its SYN).
pub fn tcp_ack(src: impl ToEndpoint, dst: impl ToEndpoint, ack: u32) -> Vec<u8> {
    tcp(src, dst, &[], |h| established(h, 1_000_001, ack))
}

/// The client's FIN (sequence 1000100, ACK 2000001).
pub fn tcp_fin(src: impl ToEndpoint, dst: impl ToEndpoint) -> Vec<u8> {
    tcp(src, dst, &[], |h| {
        established(h, 1_000_100, 2_000_001);
        h.fin = true;
    })
}

fn established(h: &mut TcpHeader, seq: u32, ack: u32) {
    h.sequence_number = seq;
    h.window_size = 502;
    h.ack = true;
    h.acknowledgment_number = ack;
}

/// The backend's SYN-ACK (sequence 5000000) of the client's SYN (1000000).
pub fn tcp_syn_ack(src: impl ToEndpoint, dst: impl ToEndpoint) -> Vec<u8> {
    tcp(src, dst, &[], |h| {
        h.sequence_number = 5_000_000;
        h.window_size = 65160;
        h.syn = true;
        h.ack = true;
        h.acknowledgment_number = 1_000_001;
    })
}

/// A client's RST (sequence 1000001, window 0, no ACK).
pub fn tcp_rst(src: impl ToEndpoint, dst: impl ToEndpoint) -> Vec<u8> {
    tcp(src, dst, &[], |h| {
        h.sequence_number = 1_000_001;
        h.window_size = 0;
        h.rst = true;
    })
}

/// A RST|ACK (sequence 0, ACK 1000001), as a stack answers a segment it has
/// no connection for.
pub fn tcp_rst_ack(src: impl ToEndpoint, dst: impl ToEndpoint) -> Vec<u8> {
    tcp(src, dst, &[], |h| {
        h.sequence_number = 0;
        h.window_size = 0;
        h.rst = true;
        h.ack = true;
        h.acknowledgment_number = 1_000_001;
    })
}

/// An SCTP packet (common header with `vtag`, `chunks`, a valid CRC32c).
pub fn sctp_frame(src: impl ToEndpoint, dst: impl ToEndpoint, vtag: u32, chunks: &[Vec<u8>]) -> Vec<u8> {
    let (src, dst) = (src.endpoint(), dst.endpoint());
    ip_packet(src.0, dst.0, IPPROTO_SCTP, &sctp::packet(src.1, dst.1, vtag, chunks))
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
pub fn icmp_error(src: impl Into<IpAddr>, dst: impl Into<IpAddr>, error: IcmpError, quote: &[u8]) -> Vec<u8> {
    icmp_error_between(src.into(), dst.into(), (MAC_SRC, MAC_DST), error, quote)
}

fn icmp_error_between(src: IpAddr, dst: IpAddr, macs: ([u8; 6], [u8; 6]), error: IcmpError, quote: &[u8]) -> Vec<u8> {
    let step = start(src, dst, macs);
    if src.is_ipv4() {
        let kind = match error {
            IcmpError::PortUnreachable => Icmpv4Type::DestinationUnreachable(icmpv4::DestUnreachableHeader::Port),
            IcmpError::TooBig(mtu) => {
                Icmpv4Type::DestinationUnreachable(icmpv4::DestUnreachableHeader::FragmentationNeeded { next_hop_mtu: mtu })
            }
            IcmpError::TimeExceeded => Icmpv4Type::TimeExceeded(icmpv4::TimeExceededCode::TtlExceededInTransit),
        };
        written(|v| step.icmpv4(kind).write(v, quote))
    } else {
        let kind = match error {
            IcmpError::PortUnreachable => Icmpv6Type::DestinationUnreachable(icmpv6::DestUnreachableCode::Port),
            IcmpError::TooBig(mtu) => Icmpv6Type::PacketTooBig { mtu: u32::from(mtu) },
            IcmpError::TimeExceeded => Icmpv6Type::TimeExceeded(icmpv6::TimeExceededCode::HopLimitExceeded),
        };
        written(|v| step.icmpv6(kind).write(v, quote))
    }
}

/// An IP packet of protocol `proto` (GRE, say, or SCTP) carrying `payload`.
pub fn ip_packet(src: impl Into<IpAddr>, dst: impl Into<IpAddr>, proto: u8, payload: &[u8]) -> Vec<u8> {
    written(|v| forward(src.into(), dst.into()).write(v, IpNumber(proto), payload))
}

/// An echo request (ping) from `src` to `dst`: identifier 7, sequence 1, "ping".
pub fn icmp_echo(src: impl Into<IpAddr>, dst: impl Into<IpAddr>) -> Vec<u8> {
    icmp_echo_request(src, dst, 7, 1, b"ping")
}

pub fn icmp_echo_request(src: impl Into<IpAddr>, dst: impl Into<IpAddr>, id: u16, seq: u16, payload: &[u8]) -> Vec<u8> {
    let (src, dst) = (src.into(), dst.into());
    let step = forward(src, dst);
    if src.is_ipv4() {
        written(|v| step.icmpv4_echo_request(id, seq).write(v, payload))
    } else {
        written(|v| step.icmpv6_echo_request(id, seq).write(v, payload))
    }
}

/// An ARP who-has `target` from `sender` (ethertype 0x0806), broadcast.
pub fn arp_request(sender: [u8; 4], target: [u8; 4]) -> Vec<u8> {
    let mut f = Vec::new();
    f.extend_from_slice(&[0xff; 6]);
    f.extend_from_slice(&MAC_SRC);
    f.extend_from_slice(&0x0806u16.to_be_bytes());
    // Ethernet/IPv4, request.
    f.extend_from_slice(&[0, 1, 0x08, 0x00, 6, 4, 0, 1]);
    f.extend_from_slice(&MAC_SRC);
    f.extend_from_slice(&sender);
    f.extend_from_slice(&[0; 6]);
    f.extend_from_slice(&target);
    f
}

// ---------------------------------------------------------------- REJECT

/// The reset a TCP stack sends for `segment` (with `payload_len` bytes of
/// data) when nothing listens, as RFC 793 states it: with the segment's ACK
/// as its sequence number if it had one, else sequence 0 and an ACK of
/// everything the segment carried (data, SYN, FIN).
pub fn reset_for(segment: &TcpHeader, payload_len: usize) -> TcpHeader {
    let mut rst = TcpHeader::new(segment.destination_port, segment.source_port, 0, 0);
    rst.rst = true;
    if segment.ack {
        rst.sequence_number = segment.acknowledgment_number;
    } else {
        rst.ack = true;
        let carried = payload_len as u32 + u32::from(segment.syn) + u32::from(segment.fin);
        rst.acknowledgment_number = segment.sequence_number.wrapping_add(carried);
    }
    rst
}

/// The REJECT of a frame, from the dialled address back to the sender (its
/// MACs swapped): a RST (`reset_for`) for TCP, else an ICMP (ICMPv6) port
/// unreachable quoting the IP header and the 8 bytes after it. An IPv4 one
/// goes without Don't Fragment (etherparse sets it), as the kernel sends its
/// errors.
pub fn reject_of(frame: &[u8]) -> Vec<u8> {
    let h = PacketHeaders::from_ethernet_slice(frame).unwrap();
    let (src, dst, ip_hlen) = match &h.net {
        Some(NetHeaders::Ipv4(ip, _)) => (IpAddr::from(ip.source), IpAddr::from(ip.destination), ip.header_len()),
        Some(NetHeaders::Ipv6(ip, _)) => (IpAddr::from(ip.source), IpAddr::from(ip.destination), IPV6_HLEN),
        _ => panic!("the REJECT of a frame that is not IP"),
    };
    // (source, destination): the frame's destination MAC, then its source.
    let macs = (frame[..6].try_into().unwrap(), frame[6..12].try_into().unwrap());
    let out = match &h.transport {
        Some(TransportHeader::Tcp(segment)) => {
            let rst = reset_for(segment, h.payload.slice().len());
            written(|v| start(dst, src, macs).tcp_header(rst).write(v, &[]))
        }
        _ => icmp_error_between(dst, src, macs, IcmpError::PortUnreachable, &frame[ETH_HLEN..ETH_HLEN + ip_hlen + 8]),
    };
    if src.is_ipv4() { with_ipv4_header(out, |ip| ip[6] &= !0x40) } else { out }
}

// ---------------------------------------------------------------- edits

/// Ethernet padding after the IP datagram, up to `len` bytes.
pub fn padded(mut frame: Vec<u8>, len: usize) -> Vec<u8> {
    assert!(frame.len() < len, "frame already {} bytes", frame.len());
    frame.resize(len, 0);
    frame
}

/// The IPv4 header checksum over `header`, its checksum field taken as zero.
pub fn ipv4_checksum(header: &[u8]) -> u16 {
    let sum: u32 = header.chunks(2).enumerate().filter(|(i, _)| *i != 5).map(|(_, w)| u32::from(u16::from_be_bytes([w[0], w[1]]))).sum();
    let folded = (sum & 0xffff) + (sum >> 16);
    !(((folded & 0xffff) + (folded >> 16)) as u16)
}

/// Gives the first `len` bytes of the IPv4 header a valid checksum (`len`
/// need not be what IHL says: a test may make IHL lie).
pub fn set_ipv4_checksum(frame: &mut [u8], len: usize) {
    let header = &mut frame[ETH_HLEN..ETH_HLEN + len];
    let sum = ipv4_checksum(header);
    header[10..12].copy_from_slice(&sum.to_be_bytes());
}

/// Edits the fixed 20 bytes of the IPv4 header and then gives them a valid
/// checksum, so only the edit makes the frame unusual.
pub fn with_ipv4_header(mut frame: Vec<u8>, edit: impl FnOnce(&mut [u8])) -> Vec<u8> {
    edit(&mut frame[ETH_HLEN..ETH_HLEN + 20]);
    set_ipv4_checksum(&mut frame, 20);
    frame
}

/// IPv4 options (a multiple of 4 bytes) inserted after the header's 20
/// bytes: IHL, total length (wrapping, as a test may have set it to
/// anything) and checksum follow.
pub fn insert_ipv4_options(frame: &mut Vec<u8>, options: &[u8]) {
    assert!(options.len().is_multiple_of(4), "IPv4 options come in 4-byte words");
    let at = ETH_HLEN + 20;
    frame.splice(at..at, options.iter().copied());
    frame[ETH_HLEN] += (options.len() / 4) as u8;
    let total = u16::from_be_bytes([frame[ETH_HLEN + 2], frame[ETH_HLEN + 3]]).wrapping_add(options.len() as u16);
    frame[ETH_HLEN + 2..ETH_HLEN + 4].copy_from_slice(&total.to_be_bytes());
    set_ipv4_checksum(frame, 20 + options.len());
}

/// An IPv6 extension header of type `kind` inserted right after the IPv6
/// header (its first byte, the next header, filled in from the frame); the
/// payload length grows by its size. The L4 checksum stays valid: the
/// pseudo-header holds the upper-layer length, not the payload length.
pub fn insert_ipv6_header(frame: &mut Vec<u8>, kind: u8, header: &[u8]) {
    let at = ETH_HLEN + IPV6_HLEN;
    let mut h = header.to_vec();
    h[0] = frame[ETH_HLEN + 6];
    frame[ETH_HLEN + 6] = kind;
    frame.splice(at..at, h);
    let len = u16::from_be_bytes([frame[ETH_HLEN + 4], frame[ETH_HLEN + 5]]).wrapping_add(header.len() as u16);
    frame[ETH_HLEN + 4..ETH_HLEN + 6].copy_from_slice(&len.to_be_bytes());
}

/// The IPv6 payload length edited.
pub fn with_ipv6_payload_len(mut frame: Vec<u8>, edit: impl FnOnce(u16) -> u16) -> Vec<u8> {
    let at = ETH_HLEN + 4;
    let len = edit(u16::from_be_bytes([frame[at], frame[at + 1]]));
    frame[at..at + 2].copy_from_slice(&len.to_be_bytes());
    frame
}

/// An Ethernet frame's IP datagram (IPv4 without options, or IPv6 with no
/// extension header) cut into fragments of `chunk` payload bytes (a multiple
/// of 8) with IP ID `id`, as a router or the sender's stack cuts it: IPv4
/// headers with MF and the offset (and their checksum), or an IPv6 Fragment
/// header after the fixed one. The L4 header and checksum stay in the first.
pub fn fragments(frame: &[u8], chunk: usize, id: u32) -> Vec<Vec<u8>> {
    assert!(chunk.is_multiple_of(8), "fragment payloads are multiples of 8 bytes");
    let v6 = frame[ETH_HLEN] >> 4 == 6;
    let ip_hlen = if v6 { IPV6_HLEN } else { 20 };
    assert!(v6 || frame[ETH_HLEN] & 0x0f == 5, "IPv4 options are not cut here");
    let (head, payload) = frame.split_at(ETH_HLEN + ip_hlen);
    let count = payload.len().div_ceil(chunk);
    (0..count)
        .map(|i| {
            let part = &payload[i * chunk..payload.len().min((i + 1) * chunk)];
            let more = i + 1 < count;
            let offset = (i * chunk / 8) as u16;
            let mut f = head.to_vec();
            if v6 {
                let next = f[ETH_HLEN + 6];
                f[ETH_HLEN + 6] = 44;
                f[ETH_HLEN + 4..ETH_HLEN + 6].copy_from_slice(&((8 + part.len()) as u16).to_be_bytes());
                f.extend_from_slice(&[next, 0]);
                f.extend_from_slice(&((offset << 3) | more as u16).to_be_bytes());
                f.extend_from_slice(&id.to_be_bytes());
            } else {
                let ip = &mut f[ETH_HLEN..ETH_HLEN + 20];
                ip[2..4].copy_from_slice(&((20 + part.len()) as u16).to_be_bytes());
                ip[4..6].copy_from_slice(&(id as u16).to_be_bytes());
                ip[6..8].copy_from_slice(&(((more as u16) << 13) | offset).to_be_bytes());
                set_ipv4_checksum(&mut f, 20);
            }
            f.extend_from_slice(part);
            f
        })
        .collect()
}

// ---------------------------------------------------------------- checks

/// The source and destination ports of a TCP, UDP or SCTP frame.
pub fn ports(frame: &[u8]) -> Option<(u16, u16)> {
    let h = PacketHeaders::from_ethernet_slice(frame).ok()?;
    let l4 = match (&h.transport, &h.payload) {
        (Some(TransportHeader::Tcp(t)), _) => return Some((t.source_port, t.destination_port)),
        (Some(TransportHeader::Udp(u)), _) => return Some((u.source_port, u.destination_port)),
        (None, PayloadSlice::Ip(p)) if p.ip_number == IpNumber(IPPROTO_SCTP) && !p.fragmented => p.payload,
        _ => return None,
    };
    Some((u16::from_be_bytes([*l4.first()?, *l4.get(1)?]), u16::from_be_bytes([*l4.get(2)?, *l4.get(3)?])))
}

/// Every checksum of a frame recomputed from scratch, all of them right:
/// see `recheck`.
pub fn check_checksums(frame: &[u8]) -> Result<(), String> {
    check(frame, None)
}

/// Every checksum of a frame out of a program recomputed from scratch, never
/// taken from the program: the IPv4 header's; the TCP or UDP checksum over
/// the pseudo-header; an SCTP packet's CRC32c; an ICMP (ICMPv6) error's own
/// checksum and, where it quotes a whole packet, those of the packet it
/// quotes. `want`, the frame expected, says which may be other than right:
/// an IPv4 UDP checksum of 0 (none) where it has none, an SCTP CRC32c wrong
/// by the same (xor) difference as its own. The frame must be of `want`'s
/// family. A fragment holds a part of its datagram: of it only the IPv4
/// header checksum is checked here (the L4 checksum, over the whole
/// datagram, is checked by comparing the fragments with those of a datagram
/// etherparse built).
pub fn recheck(out: &[u8], want: &[u8]) -> Result<(), String> {
    check(out, Some(want))
}

fn check(out: &[u8], want: Option<&[u8]>) -> Result<(), String> {
    let h = PacketHeaders::from_ethernet_slice(out).map_err(|e| format!("output does not parse: {e}"))?;
    let wanted = want.map(|w| PacketHeaders::from_ethernet_slice(w).map_err(|e| format!("expected frame does not parse: {e}"))).transpose()?;
    let family = |h: &PacketHeaders| match h.net {
        Some(NetHeaders::Ipv4(..)) => "IPv4",
        Some(NetHeaders::Ipv6(..)) => "IPv6",
        _ => "not IP",
    };
    if let Some(w) = &wanted
        && family(&h) != family(w)
    {
        return Err(format!("output is {}, want {}", family(&h), family(w)));
    }
    let mut bad = Vec::new();
    if let Some(NetHeaders::Ipv4(ip, _)) = &h.net
        && ip.header_checksum != ip.calc_header_checksum()
    {
        bad.push(format!("IPv4 header checksum {:#06x}, recomputed {:#06x}", ip.header_checksum, ip.calc_header_checksum()));
    }
    if let PayloadSlice::Ip(p) = &h.payload
        && p.fragmented
    {
        return if bad.is_empty() { Ok(()) } else { Err(bad.join("; ")) };
    }
    let payload = h.payload.slice();
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
        (Some(NetHeaders::Ipv4(_, _)), Some(TransportHeader::Udp(udp))) if udp.checksum == 0 || udp_checksum(&wanted) == Some(0) => {
            // IPv4 UDP may go without a checksum (0): only where the expected frame does.
            if udp_checksum(&wanted) != Some(0) || udp.checksum != 0 {
                let want = if udp.checksum == 0 { "a checksum" } else { "0 (none)" };
                bad.push(format!("UDP checksum {:#06x}, want {want}", udp.checksum));
            }
        }
        (None, _) => bad.push("output has no IP header".into()),
        (_, None) if ip_number(&h) == Some(IPPROTO_SCTP) => {
            let error = sctp_crc_error(payload)?;
            let want_error = match &wanted {
                Some(w) => sctp_crc_error(w.payload.slice())?,
                None => 0,
            };
            if error != want_error {
                let (stored, reference) = (sctp::stored_checksum(payload), sctp::reference_checksum(payload));
                bad.push(format!("CRC32c {stored:#010x}, reference {reference:#010x} (error {error:#010x}, want {want_error:#010x})"));
            }
        }
        (net, transport) => bad.extend(recheck_l4("", net, transport, payload).err()),
    }
    if bad.is_empty() { Ok(()) } else { Err(bad.join("; ")) }
}

fn ip_number(h: &PacketHeaders) -> Option<u8> {
    match &h.payload {
        PayloadSlice::Ip(p) => Some(p.ip_number.0),
        _ => None,
    }
}

fn udp_checksum(h: &Option<PacketHeaders>) -> Option<u16> {
    match h.as_ref()?.transport.as_ref()? {
        TransportHeader::Udp(u) => Some(u.checksum),
        _ => None,
    }
}

/// The xor of an SCTP packet's CRC32c and the one the reference computes (0: right).
fn sctp_crc_error(packet: &[u8]) -> Result<u32, String> {
    if packet.len() < 12 {
        return Err(format!("SCTP packet of {} bytes", packet.len()));
    }
    Ok(sctp::stored_checksum(packet) ^ sctp::reference_checksum(packet))
}

/// The checksums of a quoted packet, if it is whole (its IP length that of
/// the quote): its IPv4 header's and its TCP/UDP one. A quote cut after 8
/// bytes of L4 header (a REJECT's) holds no L4 checksum to check.
fn recheck_quote(quote: &[u8]) -> Result<(), String> {
    let whole = match quote.first().map(|b| b >> 4) {
        Some(4) if quote.len() >= 20 => usize::from(u16::from_be_bytes([quote[2], quote[3]])) == quote.len(),
        Some(6) if quote.len() >= IPV6_HLEN => IPV6_HLEN + usize::from(u16::from_be_bytes([quote[4], quote[5]])) == quote.len(),
        _ => false,
    };
    if !whole {
        return Ok(());
    }
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
        _ => return Err(format!("the {what}packet holds no TCP, UDP, SCTP or ICMP header")),
    };
    let sum = sum.map_err(|e| e.to_string())?;
    if got != sum { Err(format!("{what}{name} checksum {got:#06x}, recomputed {sum:#06x}")) } else { Ok(()) }
}

/// The header field at byte `off` of an Ethernet frame, read from the frame
/// itself (IPv4 options and IPv6 extension headers included), for reports
/// of the bytes that differ.
pub fn field(frame: &[u8], off: usize) -> &'static str {
    let at = |fields: &[(usize, usize, &'static str)], rel: usize, rest: &'static str| {
        fields.iter().find(|(from, to, _)| (*from..*to).contains(&rel)).map_or(rest, |f| f.2)
    };
    if off < ETH_HLEN {
        return "eth";
    }
    let ip = &frame[ETH_HLEN.min(frame.len())..];
    let rel = off - ETH_HLEN;
    let (l4, proto, later) = match ip.first().map(|b| b >> 4) {
        Some(4) if ip.len() >= 20 => {
            let ihl = usize::from(ip[0] & 0x0f) * 4;
            if rel < ihl.max(20) {
                return at(&[(10, 12, "ip csum"), (12, 16, "ip src"), (16, 20, "ip dst"), (20, 60, "ip options")], rel, "ip");
            }
            (ihl, ip[9], u16::from_be_bytes([ip[6], ip[7]]) & 0x1fff != 0)
        }
        Some(6) if ip.len() >= IPV6_HLEN => {
            if rel < IPV6_HLEN {
                return at(&[(8, 24, "ip6 src"), (24, 40, "ip6 dst")], rel, "ip6");
            }
            let (mut next, mut l4, mut later) = (ip[6], IPV6_HLEN, false);
            while let (0 | 43 | 44 | 60, Some(h)) = (next, ip.get(l4..l4 + 8)) {
                later |= next == 44 && u16::from_be_bytes([h[2], h[3]]) >> 3 != 0;
                let len = if next == 44 { 8 } else { (usize::from(h[1]) + 1) * 8 };
                if rel < l4 + len {
                    return "ip6 extension header";
                }
                (next, l4) = (h[0], l4 + len);
            }
            (l4, next, later)
        }
        _ => return "l3",
    };
    if later {
        return "fragment payload";
    }
    let rel = rel - l4;
    match proto {
        IPPROTO_TCP => at(
            &[
                (0, 2, "tcp sport"),
                (2, 4, "tcp dport"),
                (4, 8, "tcp seq"),
                (8, 12, "tcp ack"),
                (12, 14, "tcp flags"),
                (14, 16, "tcp window"),
                (16, 18, "tcp csum"),
                (18, 20, "tcp urgent"),
            ],
            rel,
            "tcp options / payload",
        ),
        IPPROTO_UDP => at(&[(0, 2, "udp sport"), (2, 4, "udp dport"), (4, 6, "udp length"), (6, 8, "udp csum")], rel, "payload"),
        IPPROTO_SCTP => at(&[(0, 2, "sctp sport"), (2, 4, "sctp dport"), (4, 8, "sctp vtag"), (8, 12, "sctp crc32c")], rel, "chunks"),
        IPPROTO_ICMP | IPPROTO_ICMPV6 => at(&[(0, 1, "icmp type"), (1, 2, "icmp code"), (2, 4, "icmp csum"), (4, 8, "icmp header")], rel, "quote / data"),
        _ => "l4/payload",
    }
}

/// An IPv4 frame carrying TCP, UDP or SCTP, not a fragment: what
/// xdp_ingress may finish itself.
pub fn is_ipv4_l4_unfragmented(frame: &[u8]) -> bool {
    let Ok(sliced) = etherparse::SlicedPacket::from_ethernet(frame) else { return false };
    let Some(etherparse::NetSlice::Ipv4(ip)) = &sliced.net else { return false };
    let header = ip.header();
    let fragmented = header.more_fragments() || header.fragments_offset().value() != 0;
    !fragmented && matches!(header.protocol(), etherparse::IpNumber::TCP | etherparse::IpNumber::UDP | etherparse::IpNumber::SCTP)
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use super::*;
    use crate::sctp::chunk;

    const A: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
    const B: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 2);
    const A6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 1);
    const B6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 2);

    fn flipped(mut f: Vec<u8>, at: usize) -> Vec<u8> {
        f[at] ^= 0x10;
        f
    }

    #[test]
    fn recheck_accepts_what_etherparse_built_and_catches_each_wrong_checksum() {
        let syn = tcp_syn((A, 1), (B, 2));
        let udp6 = udp((A6, 1), (B6, 2), b"q");
        let sctp = sctp_frame((A, 1), (B, 2), 7, &[chunk::data(1, b"x")]);
        let error = icmp_error(B, A, IcmpError::PortUnreachable, &ip_of(&udp((A, 1), (B, 2), b"q")));
        for f in [&syn, &udp6, &sctp, &error, &reject_of(&syn), &reject_of(&udp6)] {
            assert_eq!(recheck(f, f), Ok(()));
        }
        assert!(recheck(&flipped(syn.clone(), ETH_HLEN + 10), &syn).is_err(), "IPv4 header checksum");
        assert!(recheck(&flipped(syn.clone(), ETH_HLEN + 20 + 16), &syn).is_err(), "TCP checksum");
        assert!(recheck(&flipped(udp6.clone(), ETH_HLEN + IPV6_HLEN + 6), &udp6).is_err(), "UDP checksum (IPv6)");
        assert!(recheck(&flipped(sctp.clone(), ETH_HLEN + 20 + 8), &sctp).is_err(), "CRC32c");
        assert!(recheck(&flipped(error.clone(), ETH_HLEN + 20 + 2), &error).is_err(), "ICMP checksum");
        // The quote's UDP checksum: the ICMP checksum made right around it.
        let quote = flipped(ip_of(&udp((A, 1), (B, 2), b"q")), 20 + 6);
        assert!(recheck(&icmp_error(B, A, IcmpError::PortUnreachable, &quote), &error).is_err(), "quoted UDP checksum");
        assert!(recheck(&syn, &udp6).is_err(), "the family of the frame expected");
    }

    #[test]
    fn recheck_takes_the_expected_frame_for_what_may_be_wrong() {
        let udp4 = udp((A, 1), (B, 2), b"q");
        let mut none = udp4.clone();
        none[ETH_HLEN + 26..ETH_HLEN + 28].fill(0);
        assert_eq!(recheck(&none, &none), Ok(()), "no UDP checksum where none is expected");
        assert!(recheck(&none, &udp4).is_err(), "no UDP checksum where one is expected");
        assert!(recheck(&udp4, &none).is_err(), "a UDP checksum where none is expected");
        assert!(check_checksums(&none).is_err());
        let sctp = sctp_frame((A, 1), (B, 2), 7, &[chunk::abort()]);
        let wrong = flipped(sctp.clone(), ETH_HLEN + 20 + 8);
        assert_eq!(recheck(&wrong, &wrong), Ok(()), "a CRC32c as wrong as expected");
        assert!(check_checksums(&wrong).is_err());
        // A REJECT quotes 8 bytes of the L4 header: no checksum of it to check.
        assert_eq!(check_checksums(&reject_of(&udp4)), Ok(()));
    }

    #[test]
    fn fields_are_named_from_the_frame() {
        let syn = tcp_syn((A, 1), (B, 2));
        assert_eq!(field(&syn, 5), "eth");
        assert_eq!(field(&syn, ETH_HLEN + 16), "ip dst");
        assert_eq!(field(&syn, ETH_HLEN + 20 + 17), "tcp csum");
        let mut with_options = syn.clone();
        insert_ipv4_options(&mut with_options, &[1, 1, 1, 1]);
        assert_eq!(field(&with_options, ETH_HLEN + 21), "ip options");
        assert_eq!(field(&with_options, ETH_HLEN + 24 + 2), "tcp dport");
        assert_eq!(check_checksums(&with_options), Ok(()));
        let mut udp6 = udp((A6, 1), (B6, 2), b"q");
        insert_ipv6_header(&mut udp6, 60, &[0, 0, 1, 4, 0, 0, 0, 0]);
        assert_eq!(field(&udp6, ETH_HLEN + IPV6_HLEN + 2), "ip6 extension header");
        assert_eq!(field(&udp6, ETH_HLEN + IPV6_HLEN + 8 + 6), "udp csum");
        let sctp = sctp_frame((A, 1), (B, 2), 7, &[chunk::abort()]);
        assert_eq!(field(&sctp, ETH_HLEN + 20 + 9), "sctp crc32c");
        assert_eq!(ports(&sctp), Some((1, 2)));
        let later = &fragments(&udp((A, 1), (B, 2), &[0; 64]), 16, 9)[1];
        assert_eq!(field(later, ETH_HLEN + 20), "fragment payload");
    }
}

