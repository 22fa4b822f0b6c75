//! Property tests of the packet path (issue 17): random and mutated frames
//! through the real compiled `tc_ingress` and `tc_egress`, run by
//! BPF_PROG_TEST_RUN on real maps holding IPv4, IPv6 and SCTP services
//! (see `install_services`).
//!
//! Frames start as valid TCP (any flag combination), UDP, SCTP and ICMP over
//! IPv4 and IPv6, to the frontends and elsewhere, built with etherparse; then
//! they are mutated: truncated at any length, wrong IPv4 total length or IPv6
//! payload length, IPv4 options, fragments (IPv4 MF/offset, IPv6 fragment
//! header), IPv6 extension headers, bad IP versions, corrupt checksums,
//! trailers, random bytes; some cases are random bytes from the start. A case
//! is a short sequence of frames (conntrack flushed first), later ones
//! possibly the reply to an earlier output or that output itself sent on to
//! `tc_egress` with the mark `tc_ingress` left (masquerade, reverse NAT).
//!
//! The property: the program never mistranslates. Its verdict is OK, SHOT,
//! UNSPEC or REDIRECT; a frame out is byte for byte the input, or a REJECT
//! (REDIRECT: a TCP RST or ICMP port unreachable from the dialled address,
//! checksums right), or a translation (REDIRECT too: a node socket's reply
//! into loopback, its MACs changed): same length, only addresses, ports and
//! checksums changed (never TTL, never a later fragment's payload), the IPv4
//! header checksum right if it was right, the TCP/UDP checksum right if it
//! was right and wrong by the same amount if it was wrong (SCTP: the CRC32c
//! error preserved likewise).
//!
//! `PROPTEST_CASES=N` runs N cases instead of 20000; `PROPTEST_RNG_SEED=S`
//! replays a run. Needs root (BPF).

#![feature(custom_test_frameworks)]
#![test_runner(proxy_tests::harness::run)]

use std::{cell::RefCell, time::Instant};

use etherparse::{TcpHeader, UdpHeader};
use proptest::{
    prelude::*,
    test_runner::{Config, RngSeed, TestCaseError, TestError, TestRunner},
};
use proxy_common::*;
use proxy_tests::{
    addrs::{self, addr},
    fixture::{Fixture, TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT, TC_ACT_UNSPEC},
    frames::{
        ETH_HLEN, MAC_DST, MAC_SRC, icmp_echo_request, insert_ipv4_options, insert_ipv6_header, ip_packet, set_ipv4_checksum,
        tcp, udp,
    },
    sctp,
};
use proxy_user::{
    maps::{MapWriter, Maps, TC_EGRESS, TC_INGRESS},
};

// The generator works on octets (random addresses among them).
const CLIENT: [u8; 4] = addrs::CLIENT.octets();
const BACKEND: [u8; 4] = addrs::BACKEND.octets();
/// 80/TCP -> 8080, 53/UDP -> 5353, 2905/SCTP -> 3905; masqueraded from
/// outside the cluster CIDR.
const VIP: [u8; 4] = addrs::VIP.octets();
/// 80/TCP and 53/UDP with no backend: REJECT.
const VIP_EMPTY: [u8; 4] = addrs::VIP_EMPTY.octets();
const NOWHERE: [u8; 4] = addrs::UNALLOCATED.octets();
const EXTERNAL: [u8; 4] = addrs::EXTERNAL.octets();
const NODE_IP: [u8; 4] = addrs::NODE_IP.octets();
const V4_ADDRS: [[u8; 4]; 7] = [CLIENT, BACKEND, VIP, VIP_EMPTY, NOWHERE, EXTERNAL, NODE_IP];

const CLIENT6: [u8; 16] = v6(0x244, 2);
const BACKEND6: [u8; 16] = v6(0x244, 0x11);
const VIP6: [u8; 16] = v6(0x96, 0x10);
const VIP6_EMPTY: [u8; 16] = v6(0x96, 0x30);
const NOWHERE6: [u8; 16] = v6(0x96, 0x99);
const V6_ADDRS: [[u8; 16]; 5] = [CLIENT6, BACKEND6, VIP6, VIP6_EMPTY, NOWHERE6];

const PORTS: [u16; 8] = [80, 53, 2905, 8080, 5353, 3905, 62000, 40000];

/// fd00:10:<net>::<host>
const fn v6(net: u16, host: u16) -> [u8; 16] {
    let mut a = [0u8; 16];
    a[0] = 0xfd;
    a[3] = 0x10;
    a[4] = (net >> 8) as u8;
    a[5] = net as u8;
    a[14] = (host >> 8) as u8;
    a[15] = host as u8;
    a
}

// ---------------------------------------------------------------- cases

#[derive(Debug, Clone, Copy)]
enum L4 {
    /// TCP with these flags (FIN SYN RST PSH ACK URG ECE CWR, low bit first).
    Tcp(u8),
    Udp,
    Sctp,
    Icmp,
}

#[derive(Debug, Clone)]
enum Addrs {
    V4([u8; 4], [u8; 4]),
    V6([u8; 16], [u8; 16]),
}

#[derive(Debug, Clone)]
struct Spec {
    addrs: Addrs,
    l4: L4,
    sport: u16,
    dport: u16,
    payload: Vec<u8>,
}

#[derive(Debug, Clone)]
enum Mutation {
    Truncate(usize),
    /// IPv4 total length or IPv6 payload length set to this (header
    /// checksum fixed, so only the length is wrong).
    IpLength(u16),
    /// This many 4-byte words of IPv4 options (NOPs then these bytes).
    Ipv4Options(u8, Vec<u8>),
    /// IPv4 flags/offset word, or an IPv6 fragment header: MF and offset.
    Fragment(bool, u16),
    /// An IPv6 extension header (hop-by-hop, routing, destination options)
    /// of this many 8-byte units.
    ExtHeader(u8, u8),
    Version(u8),
    /// The L4 checksum (its first byte) xored.
    CorruptL4Checksum(u8),
    Trailer(Vec<u8>),
    /// Bytes overwritten at positions (taken modulo the length).
    Bytes(Vec<(usize, u8)>),
}

#[derive(Debug, Clone)]
enum Base {
    Fresh(Spec),
    /// Random bytes with this EtherType.
    Random(u16, Vec<u8>),
    /// The reply to the previous step's output (addresses and ports swapped).
    Reply { flags: u8 },
    /// The previous step's output again.
    Previous,
}

#[derive(Debug, Clone, Copy)]
enum Mark {
    /// The mark the previous step left.
    Previous,
    Fixed(u32),
}

#[derive(Debug, Clone)]
struct Step {
    base: Base,
    mutations: Vec<Mutation>,
    /// `None`: tc_ingress with mark 0.
    egress: Option<Mark>,
}

fn addrs() -> impl Strategy<Value = Addrs> {
    let v4 = prop_oneof![4 => prop::sample::select(V4_ADDRS.to_vec()), 1 => any::<[u8; 4]>()];
    let v6 = prop_oneof![4 => prop::sample::select(V6_ADDRS.to_vec()), 1 => any::<[u8; 16]>()];
    prop_oneof![
        3 => (v4.clone(), v4).prop_map(|(s, d)| Addrs::V4(s, d)),
        2 => (v6.clone(), v6).prop_map(|(s, d)| Addrs::V6(s, d)),
    ]
}

fn port() -> impl Strategy<Value = u16> {
    prop_oneof![3 => prop::sample::select(PORTS.to_vec()), 1 => any::<u16>()]
}

fn spec() -> impl Strategy<Value = Spec> {
    let l4 = prop_oneof![
        4 => any::<u8>().prop_map(L4::Tcp),
        2 => Just(L4::Udp),
        2 => Just(L4::Sctp),
        1 => Just(L4::Icmp),
    ];
    let anywhere = (addrs(), l4.clone(), port(), port(), prop::collection::vec(any::<u8>(), 0..64))
        .prop_map(|(addrs, l4, sport, dport, payload)| Spec { addrs, l4, sport, dport, payload });
    // To a served frontend, from inside the cluster or outside it (masquerade).
    let v4 = prop::sample::select(vec![CLIENT, BACKEND, EXTERNAL]).prop_map(|a| Addrs::V4(a, VIP));
    let v6 = prop::sample::select(vec![CLIENT6, BACKEND6]).prop_map(|a| Addrs::V6(a, VIP6));
    let served = (prop_oneof![v4, v6], l4, port(), prop::collection::vec(any::<u8>(), 0..64)).prop_map(|(addrs, l4, sport, payload)| {
        let dport = match l4 {
            L4::Tcp(_) => 80,
            L4::Udp => 53,
            L4::Sctp => 2905,
            L4::Icmp => 0,
        };
        Spec { addrs, l4, sport, dport, payload }
    });
    prop_oneof![anywhere, served]
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        3 => (0usize..200).prop_map(Mutation::Truncate),
        2 => any::<u16>().prop_map(Mutation::IpLength),
        2 => (1u8..=10, prop::collection::vec(any::<u8>(), 0..8)).prop_map(|(n, b)| Mutation::Ipv4Options(n, b)),
        2 => (any::<bool>(), prop_oneof![Just(0u16), Just(1), any::<u16>()]).prop_map(|(mf, off)| Mutation::Fragment(mf, off)),
        2 => (prop::sample::select(vec![0u8, 43, 60, 51, 59, 200]), 0u8..4).prop_map(|(k, n)| Mutation::ExtHeader(k, n)),
        1 => (0u8..16).prop_map(Mutation::Version),
        1 => (1u8..=255).prop_map(Mutation::CorruptL4Checksum),
        1 => prop::collection::vec(any::<u8>(), 1..40).prop_map(Mutation::Trailer),
        2 => prop::collection::vec((any::<usize>(), any::<u8>()), 1..6).prop_map(Mutation::Bytes),
    ]
}

fn mark() -> impl Strategy<Value = Mark> {
    prop_oneof![
        3 => Just(Mark::Previous),
        2 => Just(Mark::Fixed(MASQUERADE_MARK)),
        2 => Just(Mark::Fixed(REVERSE_NAT_MARK)),
        1 => Just(Mark::Fixed(0)),
        1 => any::<u32>().prop_map(Mark::Fixed),
    ]
}

fn step() -> impl Strategy<Value = Step> {
    let base = prop_oneof![
        8 => spec().prop_map(Base::Fresh),
        1 => (prop::sample::select(vec![0x0800u16, 0x86dd, 0x8100, 0x0806]), prop::collection::vec(any::<u8>(), 0..120))
            .prop_map(|(t, b)| Base::Random(t, b)),
        3 => any::<u8>().prop_map(|flags| Base::Reply { flags }),
        3 => Just(Base::Previous),
    ];
    let mutations = prop_oneof![2 => Just(vec![]), 3 => prop::collection::vec(mutation(), 1..4)];
    let egress = prop_oneof![2 => Just(None), 1 => mark().prop_map(Some)];
    (base, mutations, egress).prop_map(|(base, mutations, egress)| Step { base, mutations, egress })
}

// ---------------------------------------------------------------- frames

fn build(spec: &Spec) -> Vec<u8> {
    let (src, dst): (std::net::IpAddr, std::net::IpAddr) = match spec.addrs {
        Addrs::V4(s, d) => (s.into(), d.into()),
        Addrs::V6(s, d) => (s.into(), d.into()),
    };
    let (from, to) = ((src, spec.sport), (dst, spec.dport));
    match spec.l4 {
        L4::Tcp(flags) => tcp(from, to, &spec.payload, |h| {
            h.fin = flags & 1 != 0;
            h.syn = flags & 2 != 0;
            h.rst = flags & 4 != 0;
            h.psh = flags & 8 != 0;
            h.ack = flags & 16 != 0;
            h.urg = flags & 32 != 0;
            h.ece = flags & 64 != 0;
            h.cwr = flags & 128 != 0;
            if h.ack {
                h.acknowledgment_number = 2_000_000;
            }
        }),
        L4::Udp => udp(from, to, &spec.payload),
        L4::Icmp => icmp_echo_request(src, dst, spec.sport, spec.dport, &spec.payload),
        L4::Sctp => {
            let packet = sctp::packet(spec.sport, spec.dport, 0x1122_3344, &[sctp::chunk::data(1, &spec.payload)]);
            ip_packet(src, dst, IPPROTO_SCTP, &packet)
        }
    }
}

/// The reply to `frame` (a parsed TCP/UDP/SCTP frame): addresses and ports
/// swapped, TCP with `flags`, a short payload.
fn reply_to(frame: &[u8], flags: u8) -> Option<Vec<u8>> {
    let l = Layout::of(frame)?;
    let l4_off = l.l4_off?;
    let l4 = frame.get(l4_off..l4_off + 4)?;
    let (sport, dport) = (u16::from_be_bytes([l4[0], l4[1]]), u16::from_be_bytes([l4[2], l4[3]]));
    let l4 = match l.proto {
        IPPROTO_TCP => L4::Tcp(flags),
        IPPROTO_UDP => L4::Udp,
        IPPROTO_SCTP => L4::Sctp,
        _ => return None,
    };
    let ip = &frame[ETH_HLEN..];
    let addrs = if l.v6 {
        Addrs::V6(ip[24..40].try_into().unwrap(), ip[8..24].try_into().unwrap())
    } else {
        Addrs::V4(ip[16..20].try_into().unwrap(), ip[12..16].try_into().unwrap())
    };
    Some(build(&Spec { addrs, l4, sport: dport, dport: sport, payload: b"reply".to_vec() }))
}

fn is_v4(f: &[u8]) -> bool {
    f.len() >= ETH_HLEN + 20 && f[12..14] == [0x08, 0x00] && f[ETH_HLEN] >> 4 == 4
}

fn is_v6(f: &[u8]) -> bool {
    f.len() >= ETH_HLEN + 40 && f[12..14] == [0x86, 0xdd] && f[ETH_HLEN] >> 4 == 6
}

/// The IPv4 header checksum made right again (after an edit of the header).
/// The IPv4 header checksum made right again (after an edit of the header),
/// if the whole header (as IHL says, at least 20 bytes) is in the frame.
fn fix_ipv4_checksum(f: &mut [u8]) {
    let ihl = (usize::from(f[ETH_HLEN] & 0xf) * 4).max(20);
    if f.len() >= ETH_HLEN + ihl {
        set_ipv4_checksum(f, ihl);
    }
}

fn mutate(f: &mut Vec<u8>, m: &Mutation) {
    match m {
        Mutation::Truncate(n) => f.truncate(*n),
        Mutation::IpLength(len) => {
            if is_v4(f) {
                f[ETH_HLEN + 2..ETH_HLEN + 4].copy_from_slice(&len.to_be_bytes());
                fix_ipv4_checksum(f);
            } else if is_v6(f) {
                f[ETH_HLEN + 4..ETH_HLEN + 6].copy_from_slice(&len.to_be_bytes());
            }
        }
        Mutation::Ipv4Options(words, bytes) => {
            let ihl = f.get(ETH_HLEN).map_or(0, |b| b & 0xf);
            if !is_v4(f) || ihl != 5 {
                return;
            }
            let n = usize::from(*words) * 4;
            let mut opts = vec![1u8; n]; // NOPs
            let tail = bytes.len().min(n);
            opts[n - tail..].copy_from_slice(&bytes[..tail]);
            insert_ipv4_options(f, &opts);
        }
        Mutation::Fragment(mf, offset) => {
            if is_v4(f) {
                let word = (u16::from(*mf) << 13) | (offset & 0x1fff);
                f[ETH_HLEN + 6..ETH_HLEN + 8].copy_from_slice(&word.to_be_bytes());
                fix_ipv4_checksum(f);
            } else if is_v6(f) {
                let word = (offset << 3) | u16::from(*mf);
                let mut h = [0u8; 8];
                h[2..4].copy_from_slice(&word.to_be_bytes());
                h[4..8].copy_from_slice(&0xdead_beefu32.to_be_bytes());
                insert_ipv6_header(f, 44, &h);
            }
        }
        Mutation::ExtHeader(kind, units) => {
            if !is_v6(f) {
                return;
            }
            // AH counts its length in 4-byte units, minus 2.
            let len = usize::from(*units) * 8 + 8;
            let mut h = vec![0u8; len];
            h[1] = if *kind == 51 { (len / 4 - 2) as u8 } else { *units };
            if *kind == 0 || *kind == 60 {
                // PadN over the rest.
                h[2] = 1;
                h[3] = (len - 4) as u8;
            }
            insert_ipv6_header(f, *kind, &h);
        }
        Mutation::Version(v) => {
            if let Some(b) = f.get_mut(ETH_HLEN) {
                *b = (*b & 0xf) | (v << 4);
            }
            if is_v4(f) {
                fix_ipv4_checksum(f);
            }
        }
        Mutation::CorruptL4Checksum(x) => {
            let Some(l) = Layout::of(f) else { return };
            let (Some(off), Some(csum)) = (l.l4_off, l.l4_checksum_at()) else { return };
            if let Some(b) = f.get_mut(off + csum) {
                *b ^= x;
            }
        }
        Mutation::Trailer(bytes) => f.extend_from_slice(bytes),
        Mutation::Bytes(edits) => {
            if f.is_empty() {
                return;
            }
            let n = f.len();
            for (at, b) in edits {
                f[at % n] = *b;
            }
        }
    }
}

/// Inserts an extension header (its next-header byte filled in) right
/// after the IPv6 header, and grows the payload length.
// ---------------------------------------------------------------- layout

/// Where things are in an IPv4 or IPv6 frame, as the checks read it.
#[derive(Debug)]
struct Layout {
    v6: bool,
    /// The upper-layer protocol, after IPv6 extension headers.
    proto: u8,
    /// The L4 header's offset; `None` for a later fragment (no L4 header).
    l4_off: Option<usize>,
    /// The end of the IP datagram per its length field, if it is in the frame.
    ip_end: Option<usize>,
    fragment: bool,
}

impl Layout {
    fn of(f: &[u8]) -> Option<Layout> {
        if is_v4(f) {
            let ip = &f[ETH_HLEN..];
            let ihl = usize::from(ip[0] & 0xf) * 4;
            if ihl < 20 || ip.len() < ihl {
                return None;
            }
            let total = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
            let word = u16::from_be_bytes([ip[6], ip[7]]);
            let (mf, offset) = (word & 0x2000 != 0, word & 0x1fff);
            Some(Layout {
                v6: false,
                proto: ip[9],
                l4_off: (offset == 0).then_some(ETH_HLEN + ihl),
                ip_end: (total >= ihl && total <= ip.len()).then_some(ETH_HLEN + total),
                fragment: mf || offset != 0,
            })
        } else if is_v6(f) {
            let ip = &f[ETH_HLEN..];
            let payload = usize::from(u16::from_be_bytes([ip[4], ip[5]]));
            let mut next = ip[6];
            let mut off = 40;
            let mut fragment = false;
            let mut later = false;
            for _ in 0..8 {
                let h = ip.get(off..off + 8);
                match (next, h) {
                    (0 | 43 | 60, Some(h)) => {
                        next = h[0];
                        off += (usize::from(h[1]) + 1) * 8;
                    }
                    (51, Some(h)) => {
                        next = h[0];
                        off += (usize::from(h[1]) + 2) * 4;
                    }
                    (44, Some(h)) => {
                        fragment = true;
                        later |= u16::from_be_bytes([h[2], h[3]]) >> 3 != 0;
                        next = h[0];
                        off += 8;
                    }
                    (0 | 43 | 60 | 51 | 44, None) => return None,
                    _ => break,
                }
            }
            if off > ip.len() {
                return None;
            }
            Some(Layout {
                v6: true,
                proto: next,
                l4_off: (!later).then_some(ETH_HLEN + off),
                ip_end: (40 + payload <= ip.len()).then_some(ETH_HLEN + 40 + payload),
                fragment,
            })
        } else {
            None
        }
    }

    /// The L4 checksum's offset in the L4 header (TCP/UDP: 16-bit; SCTP:
    /// the CRC32c).
    fn l4_checksum_at(&self) -> Option<usize> {
        match self.proto {
            IPPROTO_TCP => Some(16),
            IPPROTO_UDP => Some(6),
            IPPROTO_SCTP => Some(8),
            _ => None,
        }
    }

    /// Byte offsets a translation may change.
    fn may_change(&self, at: usize) -> bool {
        let ip = ETH_HLEN;
        let l3 = if self.v6 { (ip + 8..ip + 40).contains(&at) } else { (ip + 10..ip + 20).contains(&at) };
        let l4 = match (self.l4_off, self.l4_checksum_at()) {
            (Some(l4), Some(csum)) => {
                let width = if self.proto == IPPROTO_SCTP { 4 } else { 2 };
                (l4..l4 + 4).contains(&at) || (l4 + csum..l4 + csum + width).contains(&at)
            }
            _ => false,
        };
        l3 || l4
    }

    /// The L4 segment (header and data, up to the IP length), if the whole
    /// of it is in the frame and it is not a fragment.
    fn segment<'f>(&self, f: &'f [u8]) -> Option<&'f [u8]> {
        if self.fragment {
            return None;
        }
        f.get(self.l4_off?..self.ip_end?)
    }
}

// ---------------------------------------------------------------- checksums

fn sum16(bytes: &[u8], mut acc: u32) -> u32 {
    let mut chunks = bytes.chunks_exact(2);
    for w in &mut chunks {
        acc += u32::from(u16::from_be_bytes([w[0], w[1]]));
    }
    if let [b] = chunks.remainder() {
        acc += u32::from(*b) << 8;
    }
    acc
}

fn fold(mut acc: u32) -> u16 {
    while acc > 0xffff {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    acc as u16
}

/// The addresses of an IP header, as the pseudo-header has them.
fn pseudo_addrs(f: &[u8], v6: bool) -> &[u8] {
    if v6 { &f[ETH_HLEN + 8..ETH_HLEN + 40] } else { &f[ETH_HLEN + 12..ETH_HLEN + 20] }
}

/// The ones'-complement sum over pseudo-header and segment, checksum field
/// included: 0xffff (or 0) when the checksum is right. Incremental updates
/// keep it, whatever it was: a wrong checksum stays wrong by as much.
fn l4_residual(f: &[u8], l: &Layout, segment: &[u8]) -> u16 {
    let acc = sum16(pseudo_addrs(f, l.v6), 0) + u32::from(l.proto) + segment.len() as u32;
    match fold(sum16(segment, acc)) {
        0 => 0xffff,
        r => r,
    }
}

/// The TCP/UDP checksum as etherparse computes it for the segment.
fn etherparse_checksum(f: &[u8], l: &Layout, segment: &[u8]) -> Option<u16> {
    let (src, dst) = if l.v6 {
        (&f[ETH_HLEN + 8..ETH_HLEN + 24], &f[ETH_HLEN + 24..ETH_HLEN + 40])
    } else {
        (&f[ETH_HLEN + 12..ETH_HLEN + 16], &f[ETH_HLEN + 16..ETH_HLEN + 20])
    };
    match l.proto {
        IPPROTO_TCP => {
            let (h, _) = TcpHeader::from_slice(segment).ok()?;
            let data = &segment[h.header_len()..];
            if l.v6 {
                h.calc_checksum_ipv6_raw(src.try_into().ok()?, dst.try_into().ok()?, data).ok()
            } else {
                h.calc_checksum_ipv4_raw(src.try_into().ok()?, dst.try_into().ok()?, data).ok()
            }
        }
        IPPROTO_UDP => {
            let (h, _) = UdpHeader::from_slice(segment).ok()?;
            if usize::from(h.length) != segment.len() {
                return None;
            }
            let data = &segment[8..];
            if l.v6 {
                h.calc_checksum_ipv6_raw(src.try_into().ok()?, dst.try_into().ok()?, data).ok()
            } else {
                h.calc_checksum_ipv4_raw(src.try_into().ok()?, dst.try_into().ok()?, data).ok()
            }
        }
        _ => None,
    }
}

fn ipv4_header_ok(f: &[u8]) -> bool {
    let ihl = usize::from(f[ETH_HLEN] & 0xf) * 4;
    f.get(ETH_HLEN..ETH_HLEN + ihl).is_some_and(|h| matches!(fold(sum16(h, 0)), 0xffff | 0))
}

// ---------------------------------------------------------------- property

/// What the program may do with `input`: see the module comment.
fn check(input: &[u8], verdict: u32, out: &[u8]) -> Result<(), String> {
    if ![TC_ACT_OK, TC_ACT_SHOT, TC_ACT_UNSPEC, TC_ACT_REDIRECT].contains(&verdict) {
        return Err(format!("verdict {verdict:#x}"));
    }
    if out == input {
        return Ok(());
    }
    if verdict == TC_ACT_REDIRECT {
        // A REJECT, or a translated packet redirected: a node socket's reply
        // into loopback (its destination MAC zeroed), or to the interface
        // the FIB routes a node packet's backend through (its MACs).
        return check_reject(input, out).or_else(|reject| {
            check_translation(input, out, true).map_err(|translation| format!("not a REJECT ({reject}) nor a translation ({translation})"))
        });
    }
    check_translation(input, out, false)
}

/// `redirected`: the Ethernet addresses may change too.
fn check_translation(input: &[u8], out: &[u8], redirected: bool) -> Result<(), String> {
    if out.len() != input.len() {
        return Err(format!("length {} -> {}", input.len(), out.len()));
    }
    let Some(l) = Layout::of(input) else { return Err("changed a frame that is not IPv4/IPv6".into()) };
    let bad: Vec<usize> = (0..input.len()).filter(|&i| input[i] != out[i] && !l.may_change(i) && !(redirected && i < 12)).collect();
    if !bad.is_empty() {
        return Err(format!("bytes changed outside addresses/ports/checksums at offsets {bad:?} ({l:?})"));
    }
    if !l.v6 && ipv4_header_ok(input) && !ipv4_header_ok(out) {
        return Err("IPv4 header checksum wrong after translation".into());
    }
    let (Some(seg_in), Some(seg_out)) = (l.segment(input), l.segment(out)) else { return Ok(()) };
    match l.proto {
        IPPROTO_TCP | IPPROTO_UDP if seg_in.len() >= 8 => {
            let at = l.l4_checksum_at().unwrap();
            let stored = |s: &[u8]| u16::from_be_bytes([s[at], s[at + 1]]);
            if l.proto == IPPROTO_UDP && !l.v6 && stored(seg_in) == 0 {
                // No checksum (IPv4 only): must stay none.
                return if stored(seg_out) == 0 { Ok(()) } else { Err("UDP checksum 0 (none) became nonzero".into()) };
            }
            if seg_in.len() < at + 2 {
                return Ok(());
            }
            let (r_in, r_out) = (l4_residual(input, &l, seg_in), l4_residual(out, &l, seg_out));
            if r_in != r_out {
                return Err(format!("L4 checksum residual {r_in:#06x} -> {r_out:#06x} (0xffff is right)"));
            }
            // Right in, right out, by etherparse's reckoning too.
            if r_in == 0xffff
                && let Some(want) = etherparse_checksum(out, &l, seg_out)
            {
                let got = stored(seg_out);
                // A computed 0 goes on the wire as 0xffff for UDP.
                if got != want && !(l.proto == IPPROTO_UDP && want == 0xffff && got == 0) {
                    return Err(format!("L4 checksum {got:#06x}, etherparse computes {want:#06x}"));
                }
            }
            Ok(())
        }
        IPPROTO_SCTP if seg_in.len() >= 12 => {
            let error = |s: &[u8]| sctp::stored_checksum(s) ^ proxy_common::crc32c::sctp_checksum(s);
            let (e_in, e_out) = (error(seg_in), error(seg_out));
            if e_in != e_out {
                return Err(format!("SCTP CRC32c error {e_in:#010x} -> {e_out:#010x} (0 is right)"));
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// A REJECT: from the dialled address back to the sender, a TCP RST or an
/// ICMP(v6) port unreachable, checksums right.
fn check_reject(input: &[u8], out: &[u8]) -> Result<(), String> {
    let l = Layout::of(input).ok_or("REDIRECT of a frame that is not IPv4/IPv6")?;
    if ![IPPROTO_TCP, IPPROTO_UDP, IPPROTO_SCTP].contains(&l.proto) {
        return Err(format!("REDIRECT (reject) of protocol {}", l.proto));
    }
    let lo = Layout::of(out).ok_or("the reject is not IPv4/IPv6")?;
    if lo.v6 != l.v6 || out[..6] != input[6..12] || out[6..12] != input[..6] {
        return Err("the reject's Ethernet header is not the input's reversed".into());
    }
    let (ip_in, ip_out) = (&input[ETH_HLEN..], &out[ETH_HLEN..]);
    let (src, dst) = if l.v6 { (8..24, 24..40) } else { (12..16, 16..20) };
    if ip_out[src.clone()] != ip_in[dst.clone()] || ip_out[dst] != ip_in[src] {
        return Err("the reject is not from the dialled address to the sender".into());
    }
    if !l.v6 && !ipv4_header_ok(out) {
        return Err("the reject's IPv4 header checksum is wrong".into());
    }
    let seg = lo.segment(out).ok_or("the reject's length fields do not match it")?;
    if lo.ip_end != Some(out.len()) {
        return Err("the reject has bytes past its IP length".into());
    }
    let (icmp, unreach, port) = if l.v6 { (IPPROTO_ICMPV6, 1, 4) } else { (IPPROTO_ICMP, 3, 3) };
    match lo.proto {
        IPPROTO_TCP if seg.len() >= 20 && seg[13] & 0x04 != 0 => {}
        p if p == icmp && seg.len() >= 8 && seg[0] == unreach && seg[1] == port => {}
        _ => return Err("the reject is neither a TCP RST nor a port unreachable".into()),
    }
    let sum = if lo.proto == IPPROTO_ICMP { match fold(sum16(seg, 0)) { 0 => 0xffff, r => r } } else { l4_residual(out, &lo, seg) };
    if sum != 0xffff {
        return Err(format!("the reject's checksum is wrong (residual {sum:#06x})"));
    }
    Ok(())
}

// ---------------------------------------------------------------- fixture

/// IPv4: 10.96.0.10 80/TCP -> 10.244.0.11:8080, 53/UDP -> 5353, 2905/SCTP ->
/// 3905, masqueraded from outside 10.244.0.0/16 (to 192.168.0.2);
/// 10.96.0.20 80/TCP, 53/UDP without backends; 10.96.0.0/16 the service CIDR.
/// IPv6: fd00:10:96::10 80/TCP, 53/UDP -> fd00:10:244::11 8080, 5353, 2905/SCTP
/// -> 3905; fd00:10:96::30 80/TCP, 53/UDP without backends.
fn install_services(m: &mut Maps) -> anyhow::Result<()> {
    let backends = [
        (addr(BACKEND), 8080, IPPROTO_TCP),
        (addr(BACKEND), 5353, IPPROTO_UDP),
        (addr(BACKEND), 3905, IPPROTO_SCTP),
        (addr(BACKEND6), 8080, IPPROTO_TCP),
        (addr(BACKEND6), 5353, IPPROTO_UDP),
        (addr(BACKEND6), 3905, IPPROTO_SCTP),
    ];
    let vip = addr(VIP);
    let vip6 = addr(VIP6);
    let frontends = [(vip, 80u16, IPPROTO_TCP), (vip, 53, IPPROTO_UDP), (vip, 2905, IPPROTO_SCTP), (vip6, 80, IPPROTO_TCP), (vip6, 53, IPPROTO_UDP), (vip6, 2905, IPPROTO_SCTP)];
    for (i, ((addr, port, proto), (fe, fe_port, fe_proto))) in backends.into_iter().zip(frontends).enumerate() {
        let id = i as u32 + 1;
        m.put_backend(id, &Backend { addr, port: u16::to_be(port), proto, flags: BACKEND_READY | BACKEND_SERVING })?;
        m.put_slot(&SlotKey { service_id: id, slot: 0 }, id)?;
        let entry = ServiceEntry { service_id: id, backend_count: 1, kind: KIND_CLUSTER_IP, ..Default::default() };
        for (scope, flags) in [(SCOPE_INTERNAL, 0), (SCOPE_EXTERNAL, SVC_MASQUERADE)] {
            let key = FrontendKey { addr: fe, port: fe_port.to_be(), proto: fe_proto, scope };
            m.put_frontend(&key, &ServiceEntry { flags, ..entry })?;
        }
        m.put_name(id, &ServiceName::new(&format!("fuzz/svc{id}:p"), SCOPE_INTERNAL))?;
    }
    let empty = [addr(VIP_EMPTY), addr(VIP6_EMPTY)];
    for (i, addr) in empty.into_iter().enumerate() {
        let id = 10 + i as u32;
        for (port, proto) in [(80u16, IPPROTO_TCP), (53, IPPROTO_UDP)] {
            let entry = ServiceEntry { service_id: id, backend_count: 0, kind: KIND_CLUSTER_IP, ..Default::default() };
            m.put_frontend(&FrontendKey { addr, port: port.to_be(), proto, scope: SCOPE_INTERNAL }, &entry)?;
        }
        m.put_name(id, &ServiceName::new("fuzz/empty:p", SCOPE_INTERNAL))?;
    }
    for addr in [vip, empty[0], vip6, empty[1]] {
        m.put_frontend(&cluster_ip_marker(addr), &ServiceEntry { kind: KIND_CLUSTER_IP, ..Default::default() })?;
    }
    m.put_service_cidr(&"10.96.0.0/16".parse()?)?;
    m.put_service_cidr(&"fd00:10:96::/64".parse()?)?;
    Ok(())
}

fn fixture() -> Fixture {
    let mut fx = Fixture::new("packet-fuzz", install_services).unwrap();
    let snat = [(0u32, std::net::IpAddr::from(NODE_IP))].into_iter().collect();
    let cluster = ["10.244.0.0/16".parse().unwrap(), "fd00:10:244::/64".parse().unwrap()];
    fx.maps.write_node_config(&snat, &cluster).expect("node settings");
    fx
}

fn flush_conntrack(m: &mut Maps) {
    for table in [&mut m.conntrack, &mut m.ct_unconfirmed] {
        let keys: Vec<CtKey> = table.keys().filter_map(Result::ok).collect();
        for k in keys {
            let _ = table.remove(&k);
        }
    }
}

#[derive(Default, Debug)]
struct Tally {
    runs: u64,
    verdicts: std::collections::BTreeMap<String, u64>,
    translated: u64,
    rejects: u64,
    /// Frames BPF_PROG_TEST_RUN refused (too short to run).
    refused: u64,
}

/// Runs the steps of one case; the first frame that breaks the property fails it.
fn run_case(fx: &RefCell<Fixture>, steps: &[Step], tally: &RefCell<Tally>) -> Result<(), TestCaseError> {
    flush_conntrack(&mut fx.borrow_mut().maps);
    let fx = fx.borrow();
    // The previous step's output and the mark it left.
    let mut prev: Option<(Vec<u8>, u32)> = None;
    for (i, step) in steps.iter().enumerate() {
        let mut frame = match &step.base {
            Base::Fresh(spec) => build(spec),
            Base::Random(ethertype, bytes) => {
                let mut f = [MAC_DST, MAC_SRC].concat();
                f.extend_from_slice(&ethertype.to_be_bytes());
                f.extend_from_slice(bytes);
                f
            }
            Base::Reply { flags } => match prev.as_ref().and_then(|(f, _)| reply_to(f, *flags)) {
                Some(f) => f,
                None => continue,
            },
            Base::Previous => match &prev {
                Some((f, _)) => f.clone(),
                None => continue,
            },
        };
        for m in &step.mutations {
            mutate(&mut frame, m);
        }
        let (program, mark) = match step.egress {
            None => (TC_INGRESS, 0),
            Some(Mark::Fixed(m)) => (TC_EGRESS, m),
            Some(Mark::Previous) => (TC_EGRESS, prev.as_ref().map_or(0, |p| p.1)),
        };
        let (verdict, out, mark_out) = match fx.run(program, &frame, mark) {
            Ok(r) => r,
            // The kernel runs no skb program on less than an Ethernet header,
            // and refuses IP frames shorter than their IP header.
            Err(_) if frame.len() < ETH_HLEN + 40 => {
                tally.borrow_mut().refused += 1;
                continue;
            }
            Err(e) => return Err(TestCaseError::fail(format!("BPF_PROG_TEST_RUN on {}: {e}", hex(&frame)))),
        };
        {
            let mut t = tally.borrow_mut();
            t.runs += 1;
            *t.verdicts.entry(proxy_tests::fixture::verdict_name(verdict)).or_default() += 1;
            if out != frame {
                if verdict == TC_ACT_REDIRECT { t.rejects += 1 } else { t.translated += 1 }
            }
        }
        if let Err(why) = check(&frame, verdict, &out) {
            return Err(TestCaseError::fail(format!(
                "step {i}: {program} (mark {mark:#x}) verdict {}: {why}\n  in:  {}\n  out: {}",
                proxy_tests::fixture::verdict_name(verdict),
                hex(&frame),
                hex(&out)
            )));
        }
        prev = Some((if verdict == TC_ACT_REDIRECT { frame } else { out }, mark_out));
    }
    Ok(())
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// PROPTEST_RNG_SEED, else a random seed, printed so a failure can be replayed.
fn seed() -> u64 {
    std::env::var("PROPTEST_RNG_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(rand::random)
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(20000)
}

#[test]
#[ignore = "needs root (BPF)"]
fn packet_path_never_mistranslates() {
    let fx = RefCell::new(fixture());
    let tally = RefCell::new(Tally::default());
    let seed = seed();
    let config = Config { cases: cases(), failure_persistence: None, rng_seed: RngSeed::Fixed(seed), max_shrink_iters: 2000, ..Config::default() };
    let mut runner = TestRunner::new(config);
    let started = Instant::now();
    let result = runner.run(&prop::collection::vec(step(), 1..=4), |steps| run_case(&fx, &steps, &tally));
    let t = tally.into_inner();
    println!(
        "packet fuzz (PROPTEST_RNG_SEED={seed}): {} cases, {} program runs in {:.1}s; verdicts {:?}; {} translated, {} rejects; {} too short to run",
        cases(),
        t.runs,
        started.elapsed().as_secs_f64(),
        t.verdicts,
        t.translated,
        t.rejects,
        t.refused
    );
    match result {
        Ok(()) => {}
        Err(TestError::Fail(why, steps)) => panic!("{why}\nminimal case (PROPTEST_RNG_SEED={seed}): {steps:#?}"),
        Err(e) => panic!("{e}"),
    }
    assert!(cases() < 500 || (t.translated > 0 && t.rejects > 0), "the generator reaches neither translation nor REJECT: {t:?}");
}

/// The checker itself: frames built by etherparse pass, and a translation
/// that breaks a checksum, touches TTL or a later fragment is caught.
#[test]
fn checker_catches_mistranslations() {
    let spec = Spec { addrs: Addrs::V4(CLIENT, VIP), l4: L4::Tcp(2), sport: 40000, dport: 80, payload: b"x".to_vec() };
    let syn = build(&spec);
    let translated = build(&Spec { addrs: Addrs::V4(CLIENT, BACKEND), dport: 8080, ..spec.clone() });
    assert_eq!(check(&syn, TC_ACT_OK, &translated), Ok(()));
    let mut bad_sum = translated.clone();
    bad_sum[ETH_HLEN + 20 + 17] ^= 1;
    assert!(check(&syn, TC_ACT_OK, &bad_sum).is_err(), "a wrong TCP checksum passes");
    let mut ttl = translated.clone();
    ttl[ETH_HLEN + 8] -= 1;
    fix_ipv4_checksum(&mut ttl);
    assert!(check(&syn, TC_ACT_OK, &ttl).is_err(), "a changed TTL passes");
    let mut frag = syn.clone();
    mutate(&mut frag, &Mutation::Fragment(false, 10));
    let mut frag_out = frag.clone();
    frag_out[ETH_HLEN + 20] ^= 0xff;
    assert!(check(&frag, TC_ACT_OK, &frag_out).is_err(), "a later fragment's bytes rewritten pass");
    assert!(check(&syn, 3, &syn).is_err(), "an unknown verdict passes");
    for l4 in [L4::Udp, L4::Sctp] {
        for addrs in [Addrs::V4(CLIENT, VIP), Addrs::V6(CLIENT6, VIP6)] {
            let s = Spec { addrs, l4, sport: 40000, dport: 53, payload: b"q".to_vec() };
            let f = build(&s);
            let l = Layout::of(&f).unwrap();
            let seg = l.segment(&f).unwrap();
            if let L4::Sctp = l4 {
                assert_eq!(sctp::stored_checksum(seg), proxy_common::crc32c::sctp_checksum(seg), "CRC32c conventions differ");
            } else {
                assert_eq!(l4_residual(&f, &l, seg), 0xffff, "{l4:?}: the residual of a valid frame");
                assert_eq!(etherparse_checksum(&f, &l, seg), Some(u16::from_be_bytes([seg[6], seg[7]])));
            }
            let mut broken = build(&Spec { dport: 5353, ..s.clone() });
            let at = l.l4_off.unwrap() + l.l4_checksum_at().unwrap();
            broken[at] ^= 0x10;
            assert!(check(&f, TC_ACT_OK, &broken).is_err(), "{l4:?} checksum broken passes");
        }
    }
}

