//! IPv6 packet fixtures, in the style of `fixtures.rs`: the real compiled
//! `tc_ingress` / `tc_egress` through BPF_PROG_TEST_RUN with real maps.
//! Frames are built with etherparse; a translated frame must equal, byte for
//! byte, the frame etherparse builds for the rewritten tuple, and its TCP/UDP
//! checksum (over the IPv6 pseudo-header) is recomputed from scratch. Each
//! case names the counters it must move; nothing else may move.
//!
//! Run with `-- --nocapture` to see the result tables. Needs root (BPF).

#![feature(custom_test_frameworks)]
#![test_runner(proxy_tests::harness::run)]

use std::net::Ipv6Addr;

use proxy_common::*;
use proxy_tests::{
    addrs::addr,
    fixture::{Case, Expect, Fixture, TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT, run_table},
    frames::{
        self, ETH_HLEN, IPV6_HLEN, icmp_echo, insert_ipv6_header, padded, reject_of, tcp_data, tcp_rst_ack, tcp_syn, udp,
        with_ipv6_payload_len,
    },
};
use proxy_user::maps::{MapWriter, Maps};

// The fixtures' own IPv6 world (fd00:10:…, not `proxy_tests::addrs`'s fd00:244::…).

const CLIENT: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 0, 0, 0, 0, 2);
/// The backend shares the client's /64 and the VIP's first words differ.
const BACKEND: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 0, 0, 0, 0, 0x11);
/// The service with one backend: 80/TCP -> 8080, 53/UDP -> 5353.
const VIP: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x10);
/// A service whose backend differs from it in all four 32-bit words, so
/// every word of the pseudo-header checksum update is exercised.
const VIP_FAR: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x20);
const BACKEND_FAR: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 1, 2, 3, 4, 5, 6);
/// A service with no backend: 80/TCP.
const VIP_EMPTY: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x30);
const NOWHERE: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x99);
/// A service whose frontend masquerades (as with --masquerade-all).
const VIP_MASQ: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x40);
/// The node's IPv6 address masqueraded flows leave with, and its IPv4 one.
const NODE_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1);
const NODE_IP4: [u8; 4] = [192, 168, 0, 2];

const TCP_SERVICE_ID: u32 = 1;
const UDP_SERVICE_ID: u32 = 2;
const FAR_SERVICE_ID: u32 = 3;
const EMPTY_SERVICE_ID: u32 = 4;
const MASQ_SERVICE_ID: u32 = 5;
const TCP_BACKEND_ID: u32 = 1;
const UDP_BACKEND_ID: u32 = 2;
const FAR_BACKEND_ID: u32 = 3;

/// Next-header values (RFC 8200).
const NEXTHDR_HOP: u8 = 0;
const NEXTHDR_FRAGMENT: u8 = 44;
const NEXTHDR_DEST: u8 = 60;

type Endpoint = (Ipv6Addr, u16);

// ---------------------------------------------------------------- cases

/// Translation, in order: later cases rely on the conntrack state earlier
/// ones left.
fn translation_cases() -> Vec<Case> {
    let client = (CLIENT, 40000);
    let vip_http = (VIP, 80);
    let backend_http = (BACKEND, 8080);
    let data = b"GET / HTTP/1.1\r\nHost: web\r\n\r\n";
    let reply = b"HTTP/1.1 200 OK\r\n\r\n";
    let dns = b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x03web\x00\x00\x1c\x00\x01";
    vec![
        Case::translated(
            "TCP SYN [fd00:10:244::2]:40000 -> [fd00:10:96::10]:80 goes to [fd00:10:244::11]:8080",
            tcp_syn(client, vip_http),
            tcp_syn(client, backend_http),
            Counter::NewFlow,
        )
        .then(conntrack_has_both_directions),
        Case::translated(
            "TCP ACK+data, same flow: established, same backend, payload unchanged",
            tcp_data(client, vip_http, data),
            tcp_data(client, backend_http, data),
            Counter::Established,
        ),
        Case::new(
            "TCP reply [fd00:10:244::11]:8080 -> client: recognised at ingress, marked for egress; the server's ACK confirms the flow",
            tcp_data(backend_http, client, reply),
            TC_ACT_OK,
            Expect::Unchanged,
            &[Counter::Reply, Counter::CtPromoted, Counter::CtPromoted],
        )
        .leaves_mark(REVERSE_NAT_MARK),
        Case::new(
            "egress: the marked reply comes from [fd00:10:96::10]:80; mark cleared",
            tcp_data(backend_http, client, reply),
            TC_ACT_OK,
            Expect::Translated(tcp_data(vip_http, client, reply)),
            &[],
        )
        .at_egress(REVERSE_NAT_MARK)
        .leaves_mark(0),
        Case::translated(
            "TCP SYN -> [fd00:10:96::20]:80 goes to [2001:db8:1:2:3:4:5:6]:80 (all four address words change)",
            tcp_syn((CLIENT, 40001), (VIP_FAR, 80)),
            tcp_syn((CLIENT, 40001), (BACKEND_FAR, 80)),
            Counter::NewFlow,
        ),
        Case::new(
            "egress: its reply comes from [fd00:10:96::20]:80 (port unchanged, address only)",
            tcp_data((BACKEND_FAR, 80), (CLIENT, 40001), reply),
            TC_ACT_OK,
            Expect::Translated(tcp_data((VIP_FAR, 80), (CLIENT, 40001), reply)),
            &[],
        )
        .at_egress(REVERSE_NAT_MARK),
        Case::translated(
            "UDP [fd00:10:244::2]:40002 -> [fd00:10:96::10]:53 goes to [fd00:10:244::11]:5353",
            udp((CLIENT, 40002), (VIP, 53), dns),
            udp((CLIENT, 40002), (BACKEND, 5353), dns),
            Counter::NewFlow,
        ),
        Case::new(
            "UDP reply from [fd00:10:244::11]:5353: marked for egress; the flow's two entries confirmed",
            udp((BACKEND, 5353), (CLIENT, 40002), dns),
            TC_ACT_OK,
            Expect::Unchanged,
            &[Counter::Reply, Counter::CtPromoted, Counter::CtPromoted],
        )
        .leaves_mark(REVERSE_NAT_MARK),
        Case::new(
            "egress: the marked UDP reply comes from [fd00:10:96::10]:53",
            udp((BACKEND, 5353), (CLIENT, 40002), dns),
            TC_ACT_OK,
            Expect::Translated(udp((VIP, 53), (CLIENT, 40002), dns)),
            &[],
        )
        .at_egress(REVERSE_NAT_MARK),
        Case::translated(
            "TCP SYN in a frame with Ethernet padding past the IPv6 payload length",
            padded(tcp_syn((CLIENT, 40003), vip_http), 100),
            padded(tcp_syn((CLIENT, 40003), backend_http), 100),
            Counter::NewFlow,
        ),
        Case::untouched(
            "from the backend to a client it never served (no conntrack entry)",
            tcp_data(backend_http, (CLIENT, 40999), b"stray"),
            Counter::Passed,
        ),
        // REJECT: a RST for TCP, ICMPv6 port unreachable for UDP.
        Case::new(
            "TCP SYN -> [fd00:10:96::30]:80, no backend: rejected (RST)",
            tcp_syn(client, (VIP_EMPTY, 80)),
            TC_ACT_REDIRECT,
            Expect::Translated(reject_of(&tcp_syn(client, (VIP_EMPTY, 80)))),
            &[Counter::NoBackend, Counter::Rejected],
        ),
        Case::new(
            "TCP data with ACK -> [fd00:10:96::30]:80, no backend: RST whose sequence is the segment's ACK",
            tcp_data((CLIENT, 40004), (VIP_EMPTY, 80), b"late"),
            TC_ACT_REDIRECT,
            Expect::Translated(reject_of(&tcp_data((CLIENT, 40004), (VIP_EMPTY, 80), b"late"))),
            &[Counter::NoBackend, Counter::Rejected],
        ),
        Case::new(
            "TCP RST|ACK -> [fd00:10:96::30]:80, no backend: dropped, never answered with a reset",
            tcp_rst_ack((CLIENT, 40006), (VIP_EMPTY, 80)),
            TC_ACT_SHOT,
            Expect::Unchanged,
            &[Counter::NoBackend, Counter::RejectSuppressed],
        ),
        Case::new(
            "UDP -> [fd00:10:96::30]:53, no backend: rejected (ICMPv6 port unreachable)",
            udp(client, (VIP_EMPTY, 53), b"query"),
            TC_ACT_REDIRECT,
            Expect::Translated(reject_of(&udp(client, (VIP_EMPTY, 53), b"query"))),
            &[Counter::NoBackend, Counter::Rejected],
        ),
    ]
}

/// Frames the program must pass on byte for byte, each with the counter
/// that says why.
fn untouched_cases() -> Vec<Case> {
    let syn = tcp_syn((CLIENT, 40000), (VIP, 80));
    vec![
        Case::untouched("TCP -> [fd00:10:96::99]:80, no such service", tcp_syn((CLIENT, 40000), (NOWHERE, 80)), Counter::Passed),
        Case::untouched("UDP -> [fd00:10:96::10]:80, service port but not its protocol", udp((CLIENT, 40000), (VIP, 80), b"x"), Counter::Passed),
        Case::untouched("ICMPv6 echo -> fd00:10:96::10", icmp_echo(CLIENT, VIP), Counter::Passed),
        // (Fragments that follow their first: fragment_fixtures.rs.)
        Case::untouched(
            "a later fragment (offset 1480) -> fd00:10:96::10, its first not seen",
            with_extension_header(&syn, NEXTHDR_FRAGMENT, [0, 0, 0x05, 0xc8, 0, 0, 0x12, 0x34]),
            Counter::Fragment,
        ),
        Case::untouched(
            "TCP SYN -> [fd00:10:96::10]:80 behind a Hop-by-Hop Options header (PadN)",
            with_extension_header(&syn, NEXTHDR_HOP, [0, 0, 1, 4, 0, 0, 0, 0]),
            Counter::ExtensionHeader,
        ),
        Case::untouched(
            "TCP SYN -> [fd00:10:96::10]:80 behind a Destination Options header (PadN)",
            with_extension_header(&syn, NEXTHDR_DEST, [0, 0, 1, 4, 0, 0, 0, 0]),
            Counter::ExtensionHeader,
        ),
        Case::untouched(
            "IPv6 header only (54 bytes, the least the kernel takes for IPv6), payload length 20",
            syn[..ETH_HLEN + IPV6_HLEN].to_vec(),
            Counter::Malformed,
        ),
        Case::untouched(
            "payload length 100 bytes more than the frame holds",
            with_ipv6_payload_len(syn.clone(), |len| len + 100),
            Counter::Malformed,
        ),
        Case::untouched("payload length 10: too short for a TCP header", with_ipv6_payload_len(syn.clone(), |_| 10), Counter::Malformed),
        Case::untouched(
            "IP version 4 under the IPv6 ethertype",
            {
                let mut f = syn.clone();
                f[ETH_HLEN] = 0x40 | (f[ETH_HLEN] & 0x0f);
                f
            },
            Counter::Malformed,
        ),
    ]
}

#[test]
#[ignore = "needs root (BPF)"]
fn ipv6_translation_fixtures() {
    let fx = fixture("ipv6-fixtures-xlate");
    run_table(&fx, "IPv6 translation", translation_cases());
}

/// Masquerade: the mark at ingress, the SNAT to the node's IPv6 address at
/// egress, the reply back to the client at ingress and from the frontend at
/// egress.
fn masquerade_cases() -> Vec<Case> {
    // Inside the SNAT port range (the default, 61000-65535): kept.
    let client = (CLIENT, 62000);
    let node = (NODE_IP6, 62000);
    let backend = (BACKEND, 8080);
    vec![
        Case::new(
            "TCP SYN -> [fd00:10:96::40]:80, a masquerading frontend: DNAT, marked for masquerade",
            tcp_syn(client, (VIP_MASQ, 80)),
            TC_ACT_OK,
            Expect::Translated(tcp_syn(client, backend)),
            &[Counter::NewFlow, Counter::Masqueraded],
        )
        .leaves_mark(MASQUERADE_MARK),
        Case::new(
            "egress: the marked SYN leaves from [2001:db8::1] (the IPv6 source, not the IPv4 one), port kept",
            tcp_syn(client, backend),
            TC_ACT_OK,
            Expect::Translated(tcp_syn(node, backend)),
            &[],
        )
        .at_egress(MASQUERADE_MARK)
        .leaves_mark(0),
        Case::new(
            "reply [fd00:10:244::11]:8080 -> [2001:db8::1]:62000: at ingress, back to the client; its three entries confirmed",
            tcp_data(backend, node, b"ok"),
            TC_ACT_OK,
            Expect::Translated(tcp_data(backend, client, b"ok")),
            &[Counter::Reply, Counter::CtPromoted, Counter::CtPromoted, Counter::CtPromoted],
        )
        .leaves_mark(REVERSE_NAT_MARK),
        Case::new(
            "egress: ... and from [fd00:10:96::40]:80",
            tcp_data(backend, client, b"ok"),
            TC_ACT_OK,
            Expect::Translated(tcp_data((VIP_MASQ, 80), client, b"ok")),
            &[],
        )
        .at_egress(REVERSE_NAT_MARK),
        Case::new(
            "egress: the flow's next packet reuses its SNAT entry",
            tcp_data(client, backend, b"more"),
            TC_ACT_OK,
            Expect::Translated(tcp_data(node, backend, b"more")),
            &[],
        )
        .at_egress(MASQUERADE_MARK),
        Case::new(
            "TCP SYN from port 40002 (in the node's ephemeral range) -> [fd00:10:96::40]:80: marked for masquerade",
            tcp_syn((CLIENT, 40002), (VIP_MASQ, 80)),
            TC_ACT_OK,
            Expect::Translated(tcp_syn((CLIENT, 40002), backend)),
            &[Counter::NewFlow, Counter::Masqueraded],
        )
        .leaves_mark(MASQUERADE_MARK),
        Case::new(
            "egress: port 40002 kept (its tuple free, no node socket on it)",
            tcp_syn((CLIENT, 40002), backend),
            TC_ACT_OK,
            Expect::Translated(tcp_syn((NODE_IP6, 40002), backend)),
            &[],
        )
        .at_egress(MASQUERADE_MARK),
        Case::new(
            "egress, unmarked: a node socket's SYN [2001:db8::1]:40002 -> the backend, that flow's tuple: a port of its own",
            tcp_syn((NODE_IP6, 40002), backend),
            TC_ACT_OK,
            Expect::TranslatedWith(|out| {
                let Some((port, _)) = frames::ports(out) else { return Err("the output has no TCP header".into()) };
                let ephemeral = DEFAULT_EPHEMERAL_PORTS.0..=DEFAULT_EPHEMERAL_PORTS.1;
                if port < TCP_SNAT_PORT_LOW || ephemeral.contains(&port) {
                    return Err(format!("source port {port}: want one drawn from {TCP_SNAT_PORT_LOW} up outside {ephemeral:?}"));
                }
                Ok(tcp_syn((NODE_IP6, port), (BACKEND, 8080)))
            }),
            &[Counter::NodeSnat],
        )
        .at_egress(0),
    ]
}

#[test]
#[ignore = "needs root (BPF)"]
fn ipv6_masquerade_fixtures() {
    let mut fx = fixture("ipv6-fixtures-masq");
    let snat = [(0, std::net::IpAddr::from(NODE_IP4)), (SNAT_ADDR_IPV6, NODE_IP6.into())].into_iter().collect();
    let cluster = ["0.0.0.0/0".parse().unwrap(), "::/0".parse().unwrap()];
    fx.maps.write_node_config(&snat, &cluster).expect("node settings");
    let key = FrontendKey { addr: addr(VIP_MASQ), port: 80u16.to_be(), proto: IPPROTO_TCP, scope: SCOPE_INTERNAL };
    let entry = ServiceEntry { service_id: MASQ_SERVICE_ID, backend_count: 1, kind: KIND_CLUSTER_IP, flags: SVC_MASQUERADE, ..Default::default() };
    fx.maps.put_frontend(&key, &entry).unwrap();
    fx.maps.put_slot(&SlotKey { service_id: MASQ_SERVICE_ID, slot: 0 }, TCP_BACKEND_ID).unwrap();
    run_table(&fx, "IPv6 masquerade", masquerade_cases());
}

#[test]
#[ignore = "needs root (BPF)"]
fn ipv6_untouched_fixtures() {
    let fx = fixture("ipv6-fixtures-untouched");
    run_table(&fx, "IPv6 left untouched", untouched_cases());
    let flows = fx.maps.conntrack.keys().count() + fx.maps.ct_unconfirmed.keys().count();
    assert_eq!(flows, 0, "untouched frames created {flows} conntrack entries");
}

fn fixture(label: &str) -> Fixture {
    let mut fx = Fixture::new(label, install_services).unwrap();
    // Every source in-cluster (IPv6 too), so only internal frontends are needed.
    let cluster = ["0.0.0.0/0".parse().unwrap(), "::/0".parse().unwrap()];
    fx.maps.write_node_config(&Default::default(), &cluster).expect("node settings");
    fx
}

// ---------------------------------------------------------------- map checks

fn ct_key(src: Endpoint, dst: Endpoint, proto: u8) -> CtKey {
    CtKey { src: addr(src.0), dst: addr(dst.0), sport: src.1.to_be(), dport: dst.1.to_be(), proto, _pad: [0; 3] }
}

fn conntrack_has_both_directions(maps: &Maps) -> Result<(), String> {
    let get = |key: &CtKey| maps.conntrack_entry(key).map_err(|e| format!("conntrack {key:?}: {e}"));
    let orig = get(&ct_key((CLIENT, 40000), (VIP, 80), IPPROTO_TCP))?;
    let want = (CT_ORIGINAL, addr(BACKEND), 8080u16.to_be(), TCP_SERVICE_ID, TCP_BACKEND_ID);
    let got = (orig.direction, orig.nat_addr, orig.nat_port, orig.service_id, orig.backend_id);
    if got != want {
        return Err(format!("ORIGINAL entry {orig:?}, want (direction, nat, port, service, backend) {want:?}"));
    }
    let reply = get(&ct_key((BACKEND, 8080), (CLIENT, 40000), IPPROTO_TCP))?;
    let want = (CT_REPLY, addr(VIP), 80u16.to_be(), TCP_SERVICE_ID, TCP_BACKEND_ID);
    let got = (reply.direction, reply.nat_addr, reply.nat_port, reply.service_id, reply.backend_id);
    if got != want {
        return Err(format!("REPLY entry {reply:?}, want (direction, nat, port, service, backend) {want:?}"));
    }
    Ok(())
}

// ---------------------------------------------------------------- fixture

/// One backend per service so the choice is deterministic.
fn install_services(m: &mut Maps) -> anyhow::Result<()> {
    let backends = [
        (TCP_BACKEND_ID, BACKEND, 8080, IPPROTO_TCP),
        (UDP_BACKEND_ID, BACKEND, 5353, IPPROTO_UDP),
        (FAR_BACKEND_ID, BACKEND_FAR, 80, IPPROTO_TCP),
    ];
    for (id, a, port, proto) in backends {
        let backend = Backend { addr: addr(a), port: u16::to_be(port), proto, flags: BACKEND_READY | BACKEND_SERVING };
        m.put_backend(id, &backend)?;
    }
    m.put_slot(&SlotKey { service_id: TCP_SERVICE_ID, slot: 0 }, TCP_BACKEND_ID)?;
    m.put_slot(&SlotKey { service_id: UDP_SERVICE_ID, slot: 0 }, UDP_BACKEND_ID)?;
    m.put_slot(&SlotKey { service_id: FAR_SERVICE_ID, slot: 0 }, FAR_BACKEND_ID)?;
    let services = [
        (VIP, 80, IPPROTO_TCP, TCP_SERVICE_ID, 1, "default/web6:http"),
        (VIP, 53, IPPROTO_UDP, UDP_SERVICE_ID, 1, "default/web6:dns"),
        (VIP_FAR, 80, IPPROTO_TCP, FAR_SERVICE_ID, 1, "default/far6:http"),
        (VIP_EMPTY, 80, IPPROTO_TCP, EMPTY_SERVICE_ID, 0, "default/empty6:http"),
        (VIP_EMPTY, 53, IPPROTO_UDP, EMPTY_SERVICE_ID, 0, "default/empty6:dns"),
    ];
    for (a, port, proto, service_id, backend_count, name) in services {
        let key = FrontendKey { addr: addr(a), port: u16::to_be(port), proto, scope: SCOPE_INTERNAL };
        let entry = ServiceEntry { service_id, backend_count, kind: KIND_CLUSTER_IP, ..Default::default() };
        m.put_frontend(&key, &entry)?;
        m.put_name(service_id, &ServiceName::new(name, SCOPE_INTERNAL))?;
    }
    Ok(())
}

// ---------------------------------------------------------------- frames

/// The frame with an 8-byte extension header of type `kind` between the
/// IPv6 header and the L4 header.
fn with_extension_header(frame: &[u8], kind: u8, header: [u8; 8]) -> Vec<u8> {
    let mut out = frame.to_vec();
    insert_ipv6_header(&mut out, kind, &header);
    out
}
