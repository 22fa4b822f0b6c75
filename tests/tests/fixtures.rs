//! Packet fixtures, in the style of Katran's: a table of cases, each an input
//! frame, the verdict expected from `tc_ingress` and the frame expected out of
//! it, run through BPF_PROG_TEST_RUN on the real compiled program with real
//! maps. Frames are built with etherparse; translated output is compared byte
//! for byte with a frame etherparse built for the rewritten tuple, and its IPv4
//! and TCP/UDP checksums are recomputed from scratch, never taken from the
//! program. Each case also names the counters it must move, and nothing else
//! may move.
//!
//! Run with `-- --nocapture` to see the result tables. Needs root (BPF).

#![feature(custom_test_frameworks)]
#![test_runner(proxy_tests::harness::run)]

use std::net::{Ipv4Addr, Ipv6Addr};

use proxy_common::*;
use proxy_tests::{
    addrs::{BACKEND, CLIENT, EXTERNAL, NODE_IP, UNALLOCATED, VIP, VIP_EMPTY, addr},
    fixture::{
        Case, Expect, Fixture, TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT, TC_ACT_UNSPEC, XDP_PASS, XDP_REDIRECT, diff, run_table,
        xdp_verdict_name,
        run_table_through_xdp,
    },
    frames::{
        self, ETH_HLEN, arp_request, icmp_echo, insert_ipv4_options, padded, reject_of, tcp_ack, tcp_data, tcp_fin, tcp_rst,
        tcp_syn, tcp_syn_ack, udp, with_ipv4_header,
    },
};
use proxy_tests::{netns::Netns, unique_suffix};
use aya::util::KernelVersion;
use proxy_user::maps::{MapWriter, Maps};

// CLIENT and BACKEND are pods of the cluster CIDR, VIP serves 80/TCP ->
// 8080 and 53/UDP -> 5353 on BACKEND, VIP_EMPTY 80/TCP with no backend,
// UNALLOCATED nothing (see `proxy_tests::addrs`).
/// The verdict fixture's service CIDR holds the VIPs above, UNALLOCATED too.
const SERVICE_CIDR: &str = "10.96.0.0/16";
/// ... and its cluster CIDR holds CLIENT and BACKEND; EXTERNAL is outside.
const CLUSTER_CIDR: &str = "10.244.0.0/16";
const EXTERNAL_BLOCKED: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 130);
const EXTERNAL_2: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 3);
const EXTERNAL_3: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 4);
/// A LoadBalancer IP reserved to 203.0.113.0/25, served by the TCP backend.
const LB_IP: Ipv4Addr = Ipv4Addr::new(1, 2, 3, 4);
const LB_SOURCE_RANGE: &str = "203.0.113.0/25";
/// A Local-policy frontend with no local endpoint.
const LOCAL_EMPTY: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 30);
const LOCAL_EMPTY_SERVICE_ID: u32 = 5;

const TCP_BACKEND_ID: u32 = 1;
const UDP_BACKEND_ID: u32 = 2;
const TCP_SERVICE_ID: u32 = 1;
const UDP_SERVICE_ID: u32 = 2;
const EMPTY_SERVICE_ID: u32 = 3;

type Endpoint = (Ipv4Addr, u16);

// ---------------------------------------------------------------- cases

/// A REJECT: the frame comes back from the address the client dialled,
/// as a TCP RST for TCP, ICMP port unreachable otherwise.
fn rejected(what: &str, input: Vec<u8>) -> Case {
    let want = reject_of(&input);
    Case::new(what, input, TC_ACT_REDIRECT, Expect::Translated(want), &[Counter::Rejected])
}

fn dropped(what: &str, input: Vec<u8>, counter: Counter) -> Case {
    Case::new(what, input, TC_ACT_SHOT, Expect::Unchanged, &[counter])
}

/// Translation, in order: later cases rely on the conntrack state earlier
/// ones left.
fn translation_cases() -> Vec<Case> {
    let client = (CLIENT, 40000);
    let vip_http = (VIP, 80);
    let backend_http = (BACKEND, 8080);
    let data = b"GET / HTTP/1.1\r\nHost: web\r\n\r\n";
    let udp_payload = b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x03web\x00\x00\x01\x00\x01";
    vec![
        Case::translated(
            "TCP SYN 10.244.0.2:40000 -> 10.96.0.10:80 goes to backend 10.244.0.11:8080",
            tcp_syn(client, vip_http),
            tcp_syn(client, backend_http),
            Counter::NewFlow,
        )
        .then(conntrack_has_both_directions),
        Case::translated(
            "TCP SYN retransmitted (no FIN/RST seen): the same flow, kept on the backend it chose",
            tcp_syn(client, vip_http),
            tcp_syn(client, backend_http),
            Counter::Established,
        ),
        Case::translated(
            "TCP ACK+data, same flow: established, same backend, payload unchanged",
            tcp_data(client, vip_http, data),
            tcp_data(client, backend_http, data),
            Counter::Established,
        ),
        Case::translated(
            "TCP FIN, same flow: established, and the entry is marked closing",
            tcp_fin(client, vip_http),
            tcp_fin(client, backend_http),
            Counter::Established,
        )
        .then(original_entry_is_closing),
        Case::translated(
            "TCP SYN again on the same tuple: a new flow (the backend is chosen again), not the old entry",
            tcp_syn(client, vip_http),
            tcp_syn(client, backend_http),
            Counter::NewFlow,
        ),
        Case::new(
            "TCP reply 10.244.0.11:8080 -> 10.244.0.2:40000: recognised at ingress, marked for egress; \
             the server's ACK confirms the flow",
            tcp_data(backend_http, client, b"HTTP/1.1 200 OK\r\n\r\n"),
            TC_ACT_OK,
            Expect::Unchanged,
            &[Counter::Reply, Counter::CtPromoted, Counter::CtPromoted],
        )
        .leaves_mark(REVERSE_NAT_MARK),
        Case::new(
            "egress: the marked reply comes from 10.96.0.10:80",
            tcp_data(backend_http, client, b"HTTP/1.1 200 OK\r\n\r\n"),
            TC_ACT_OK,
            Expect::Translated(tcp_data(vip_http, client, b"HTTP/1.1 200 OK\r\n\r\n")),
            &[],
        )
        .at_egress(REVERSE_NAT_MARK)
        .leaves_mark(0),
        Case::translated(
            "UDP 10.244.0.2:40001 -> 10.96.0.10:53 goes to 10.244.0.11:5353",
            udp((CLIENT, 40001), (VIP, 53), udp_payload),
            udp((CLIENT, 40001), (BACKEND, 5353), udp_payload),
            Counter::NewFlow,
        ),
        Case::new(
            "UDP reply 10.244.0.11:5353 -> 10.244.0.2:40001: marked for egress; the flow's two entries confirmed",
            udp((BACKEND, 5353), (CLIENT, 40001), udp_payload),
            TC_ACT_OK,
            Expect::Unchanged,
            &[Counter::Reply, Counter::CtPromoted, Counter::CtPromoted],
        )
        .leaves_mark(REVERSE_NAT_MARK),
        Case::new(
            "egress: the marked UDP reply comes from 10.96.0.10:53",
            udp((BACKEND, 5353), (CLIENT, 40001), udp_payload),
            TC_ACT_OK,
            Expect::Translated(udp((VIP, 53), (CLIENT, 40001), udp_payload)),
            &[],
        )
        .at_egress(REVERSE_NAT_MARK),
        Case::translated(
            "UDP without checksum (0) -> 10.96.0.10:53: rewritten, checksum stays 0",
            without_udp_checksum(udp((CLIENT, 40002), (VIP, 53), udp_payload)),
            without_udp_checksum(udp((CLIENT, 40002), (BACKEND, 5353), udp_payload)),
            Counter::NewFlow,
        ),
        Case::translated(
            "TCP SYN with IPv4 options (IHL 6) -> 10.96.0.10:80: ports found after the options",
            with_router_alert(tcp_syn((CLIENT, 40003), vip_http)),
            with_router_alert(tcp_syn((CLIENT, 40003), backend_http)),
            Counter::NewFlow,
        ),
        Case::translated(
            "TCP SYN in a 60-byte frame (Ethernet padding past IP total length)",
            padded(tcp_syn((CLIENT, 40004), vip_http), 60),
            padded(tcp_syn((CLIENT, 40004), backend_http), 60),
            Counter::NewFlow,
        ),
        Case::untouched(
            "from the backend to a client it never served (no conntrack entry)",
            tcp_data(backend_http, (CLIENT, 40999), b"stray"),
            Counter::Passed,
        ),
        Case::new(
            "TCP SYN -> 10.96.0.20:80, a service with no backend: rejected (RST)",
            tcp_syn(client, (VIP_EMPTY, 80)),
            TC_ACT_REDIRECT,
            Expect::Translated(reject_of(&tcp_syn(client, (VIP_EMPTY, 80)))),
            &[Counter::NoBackend, Counter::Rejected],
        ),
        Case::new(
            "TCP data with ACK -> 10.96.0.20:80, no backend: RST whose sequence is the segment's ACK",
            tcp_data((CLIENT, 40003), (VIP_EMPTY, 80), b"late"),
            TC_ACT_REDIRECT,
            Expect::Translated(reject_of(&tcp_data((CLIENT, 40003), (VIP_EMPTY, 80), b"late"))),
            &[Counter::NoBackend, Counter::Rejected],
        ),
        Case::new(
            "TCP RST -> 10.96.0.20:80, no backend: dropped, never answered with a reset",
            tcp_rst((CLIENT, 40006), (VIP_EMPTY, 80)),
            TC_ACT_SHOT,
            Expect::Unchanged,
            &[Counter::NoBackend, Counter::RejectSuppressed],
        ),
    ]
}

/// kube-proxy's verdicts beyond translation, with the maps as the agent
/// fills them for a cluster CIDR and a service CIDR: REJECT, DROP, source
/// ranges, masquerade (the mark at ingress, the SNAT at egress, the reply).
fn verdict_cases() -> Vec<Case> {
    // Inside the SNAT port range (the default, 61000-65535): kept.
    let ext = (EXTERNAL, 62000);
    vec![
        rejected("UDP -> 10.96.0.20:53, a ClusterIP on a port it does not serve", udp((CLIENT, 40000), (VIP_EMPTY, 53), b"q")),
        rejected("TCP SYN -> 10.96.0.10:81, a served ClusterIP on another port", tcp_syn((CLIENT, 40000), (VIP, 81))),
        dropped("TCP SYN -> 10.96.0.99:80, unallocated in the service CIDR", tcp_syn((CLIENT, 40000), (UNALLOCATED, 80)), Counter::DropUnallocated),
        Case::untouched("TCP SYN -> 10.97.0.1:80, outside the service CIDR", tcp_syn((CLIENT, 40000), ([10, 97, 0, 1], 80)), Counter::Passed),
        dropped(
            "TCP SYN -> 10.96.0.30:80, Local policy with endpoints only elsewhere: dropped, not rejected",
            tcp_syn((CLIENT, 40000), (LOCAL_EMPTY, 80)),
            Counter::DropNoLocal,
        ),
        dropped(
            "TCP SYN 203.0.113.130 -> LB 1.2.3.4:80, outside loadBalancerSourceRanges",
            tcp_syn((EXTERNAL_BLOCKED, 40000), (LB_IP, 80)),
            Counter::DropSourceRange,
        ),
        Case::translated(
            "TCP SYN 203.0.113.2 -> LB 1.2.3.4:80, inside the source range: to the backend, client kept",
            tcp_syn((EXTERNAL, 40001), (LB_IP, 80)),
            tcp_syn((EXTERNAL, 40001), (BACKEND, 8080)),
            Counter::NewFlow,
        ),
        masqueraded_syn("TCP SYN 203.0.113.2 -> ClusterIP 10.96.0.10:80 from outside the cluster CIDR: DNAT, marked for masquerade", ext),
        Case::new(
            "egress: the marked SYN leaves from the node address, client port kept; mark cleared",
            tcp_syn(ext, (BACKEND, 8080)),
            TC_ACT_OK,
            Expect::Translated(tcp_syn((NODE_IP, 62000), (BACKEND, 8080))),
            &[],
        )
        .at_egress(MASQUERADE_MARK)
        .leaves_mark(0)
        .then(masqueraded_reply_is_tracked),
        Case::new(
            "reply 10.244.0.11:8080 -> 192.168.0.2:62000: at ingress, back to 203.0.113.2:62000",
            tcp_data((BACKEND, 8080), (NODE_IP, 62000), b"ok"),
            TC_ACT_OK,
            Expect::Translated(tcp_data((BACKEND, 8080), ext, b"ok")),
            // The server's ACK confirms the masqueraded flow: its three entries.
            &[Counter::Reply, Counter::CtPromoted, Counter::CtPromoted, Counter::CtPromoted],
        )
        .leaves_mark(REVERSE_NAT_MARK),
        Case::new(
            "egress: ... and from 10.96.0.10:80",
            tcp_data((BACKEND, 8080), ext, b"ok"),
            TC_ACT_OK,
            Expect::Translated(tcp_data((VIP, 80), ext, b"ok")),
            &[],
        )
        .at_egress(REVERSE_NAT_MARK),
        Case::new(
            "egress: the same flow's next packet reuses its SNAT entry",
            tcp_data(ext, (BACKEND, 8080), b"more"),
            TC_ACT_OK,
            Expect::Translated(tcp_data((NODE_IP, 62000), (BACKEND, 8080), b"more")),
            &[],
        )
        .at_egress(MASQUERADE_MARK),
        masqueraded_syn("TCP SYN 203.0.113.3:62000 -> 10.96.0.10:80, another client with the same port: masqueraded too", (EXTERNAL_2, 62000)),
        snat_to_a_drawn_port("egress: its port is taken towards this backend (by 203.0.113.2's flow): another one from the SNAT range", (EXTERNAL_2, 62000)),
        Case::new(
            "egress: 203.0.113.2's client closes (FIN): its SNAT port 62000 closes with it",
            tcp_fin(ext, (BACKEND, 8080)),
            TC_ACT_OK,
            Expect::Translated(tcp_fin((NODE_IP, 62000), (BACKEND, 8080))),
            &[],
        )
        .at_egress(MASQUERADE_MARK)
        .then(closed_snat_port_is_closing),
        masqueraded_syn("TCP SYN 203.0.113.4:62000 -> 10.96.0.10:80, a new connection: masqueraded", (EXTERNAL_3, 62000)),
        snat_to_a_drawn_port(
            "egress: port 62000 stays 203.0.113.2's (the backend may hold it in TIME_WAIT): another one",
            (EXTERNAL_3, 62000),
        ),
        masqueraded_syn("TCP SYN 203.0.113.2:40002 -> 10.96.0.10:80: masqueraded", (EXTERNAL, 40002)),
        Case::new(
            "egress: a TCP client port in the node's ephemeral range, free and no node socket on it: kept",
            tcp_syn((EXTERNAL, 40002), (BACKEND, 8080)),
            TC_ACT_OK,
            Expect::Translated(tcp_syn((NODE_IP, 40002), (BACKEND, 8080))),
            &[],
        )
        .at_egress(MASQUERADE_MARK),
        node_socket_on_a_taken_tuple(
            "egress, unmarked: a node socket's SYN 192.168.0.2:40002 -> 10.244.0.11:8080, the masqueraded flow's tuple: a port of its own",
        ),
        Case::new(
            "egress, unmarked: a node socket's SYN 192.168.0.2:40004 -> 10.244.0.11:8080, a free tuple: not ours",
            tcp_syn((NODE_IP, 40004), (BACKEND, 8080)),
            TC_ACT_UNSPEC,
            Expect::Unchanged,
            &[],
        )
        .at_egress(0),
        Case::new("egress: an unmarked packet is not ours", tcp_syn(ext, (BACKEND, 8080)), TC_ACT_UNSPEC, Expect::Unchanged, &[])
            .at_egress(0),
        Case::new(
            "hairpin: 10.244.0.11 reaching itself through 10.96.0.10:80 is masqueraded",
            tcp_syn((BACKEND, 40100), (VIP, 80)),
            TC_ACT_OK,
            Expect::Translated(tcp_syn((BACKEND, 40100), (BACKEND, 8080))),
            &[Counter::NewFlow, Counter::Masqueraded],
        )
        .leaves_mark(MASQUERADE_MARK),
    ]
}

/// A closed flow's SNAT tuple stays its client's for CT_SNAT_TIME_WAIT_NS
/// (the backend may hold it in TIME_WAIT): another client gets another port,
/// the same client reopening its connection keeps it; after that time it is
/// anyone's.
fn closed_port_reuse_cases() -> Vec<Case> {
    vec![
        masqueraded_syn("TCP SYN 203.0.113.4:62000 -> 10.96.0.10:80: masqueraded", (EXTERNAL_3, 62000)),
        snat_to_a_drawn_port(
            "egress: port 62000's flow (203.0.113.2:62000) closed 2 s ago, another client: another port",
            (EXTERNAL_3, 62000),
        ),
        masqueraded_syn("TCP SYN 203.0.113.2:62000 -> 10.96.0.10:80, the closed flow's client reopening: masqueraded", (EXTERNAL, 62000)),
        Case::new(
            "egress: it keeps port 62000 (its own sequence numbers pass the backend's TIME_WAIT)",
            tcp_syn((EXTERNAL, 62000), (BACKEND, 8080)),
            TC_ACT_OK,
            Expect::Translated(tcp_syn((NODE_IP, 62000), (BACKEND, 8080))),
            // The closed flow's confirmed entry makes way.
            &[Counter::CtReleased],
        )
        .at_egress(MASQUERADE_MARK),
        Case::new(
            "reply 10.244.0.11:8080 -> 192.168.0.2:62000: to 203.0.113.2:62000",
            tcp_data((BACKEND, 8080), (NODE_IP, 62000), b"ok"),
            TC_ACT_OK,
            Expect::Translated(tcp_data((BACKEND, 8080), (EXTERNAL, 62000), b"ok")),
            // The server's ACK confirms the masqueraded flow: its three entries.
            &[Counter::Reply, Counter::CtPromoted, Counter::CtPromoted, Counter::CtPromoted],
        )
        .leaves_mark(REVERSE_NAT_MARK),
        masqueraded_syn("TCP SYN 203.0.113.4:62001 -> 10.96.0.10:80: masqueraded", (EXTERNAL_3, 62001)),
        Case::new(
            "egress: port 62001's flow (203.0.113.3:62001) closed 121 s ago, past TIME_WAIT: kept by another client",
            tcp_syn((EXTERNAL_3, 62001), (BACKEND, 8080)),
            TC_ACT_OK,
            Expect::Translated(tcp_syn((NODE_IP, 62001), (BACKEND, 8080))),
            // The closed flow's confirmed entry makes way.
            &[Counter::CtReleased],
        )
        .at_egress(MASQUERADE_MARK),
        Case::new(
            "reply 10.244.0.11:8080 -> 192.168.0.2:62001: to the new client 203.0.113.4:62001",
            tcp_data((BACKEND, 8080), (NODE_IP, 62001), b"ok"),
            TC_ACT_OK,
            Expect::Translated(tcp_data((BACKEND, 8080), (EXTERNAL_3, 62001), b"ok")),
            // The server's ACK confirms the masqueraded flow: its three entries.
            &[Counter::Reply, Counter::CtPromoted, Counter::CtPromoted, Counter::CtPromoted],
        )
        .leaves_mark(REVERSE_NAT_MARK),
    ]
}

/// The SNAT reply entry of `client`'s masqueraded flow to the TCP backend
/// through 10.96.0.10:80, on `port`, closed `idle_s` ago.
fn hold_closed_flow(m: &mut Maps, client: Endpoint, port: u16, idle_s: u64) -> anyhow::Result<()> {
    hold_snat_port(m, client, port, idle_s, CT_MASQUERADE | CT_CLOSING)
}

/// As `hold_closed_flow`, for a flow whose SYN was never answered: an
/// unconfirmed entry, last seen `idle_s` ago.
fn hold_unanswered_flow(m: &mut Maps, client: Endpoint, port: u16, idle_s: u64) -> anyhow::Result<()> {
    hold_snat_port(m, client, port, idle_s, CT_MASQUERADE | CT_PENDING)
}

/// The SNAT reply entry of a flow in the state `flags` says, in the table
/// that state lives in.
fn hold_snat_port(m: &mut Maps, client: Endpoint, port: u16, idle_s: u64, flags: u8) -> anyhow::Result<()> {
    let monotonic_ns = || -> anyhow::Result<u64> {
        let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)?;
        Ok(now.tv_sec() as u64 * 1_000_000_000 + now.tv_nsec() as u64)
    };
    // No entry is older than the clock (CLOCK_MONOTONIC starts at boot): in a
    // VM booted moments ago (./x vm-test) wait until it has run that long.
    let old_enough = (idle_s + 1) * 1_000_000_000;
    let mut now_ns = monotonic_ns()?;
    if now_ns < old_enough {
        std::thread::sleep(std::time::Duration::from_nanos(old_enough - now_ns));
        now_ns = monotonic_ns()?;
    }
    let held = CtEntry {
        direction: CT_REPLY,
        flags,
        nat_addr: addr(VIP),
        nat_port: 80u16.to_be(),
        rev_addr: addr(client.0),
        rev_port: client.1.to_be(),
        last_seen_ns: now_ns.saturating_sub(idle_s * 1_000_000_000),
        ..Default::default()
    };
    let table = if flags & CT_PENDING != 0 { &mut m.ct_unconfirmed } else { &mut m.conntrack };
    table.insert(&ct_key((BACKEND, 8080), (NODE_IP, port), IPPROTO_TCP), &held, 0)?;
    Ok(())
}

/// A port held by a flow whose SYN was never answered goes back to the
/// pool once the flow lapses (CT_UNCONFIRMED_TIMEOUT_NS, 30 s idle), not
/// when the LRU gets round to it.
fn unanswered_port_cases() -> Vec<Case> {
    vec![
        masqueraded_syn("TCP SYN 203.0.113.4:62010 -> 10.96.0.10:80: masqueraded", (EXTERNAL_3, 62010)),
        snat_to_a_drawn_port(
            "egress: port 62010's unanswered flow (203.0.113.3) was seen 5 s ago: another port",
            (EXTERNAL_3, 62010),
        ),
        masqueraded_syn("TCP SYN 203.0.113.4:62011 -> 10.96.0.10:80: masqueraded", (EXTERNAL_3, 62011)),
        Case::new(
            "egress: port 62011's unanswered flow (203.0.113.3) lapsed 31 s ago: kept by another client",
            tcp_syn((EXTERNAL_3, 62011), (BACKEND, 8080)),
            TC_ACT_OK,
            Expect::Translated(tcp_syn((NODE_IP, 62011), (BACKEND, 8080))),
            &[],
        )
        .at_egress(MASQUERADE_MARK),
    ]
}

/// 203.0.113.2:62000's flow closed 2 s ago on port 62000, 203.0.113.3:62001's
/// 121 s ago on port 62001.
fn hold_ports_of_closed_flows(m: &mut Maps) -> anyhow::Result<()> {
    hold_closed_flow(m, (EXTERNAL, 62000), 62000, 2)?;
    hold_closed_flow(m, (EXTERNAL_2, 62001), 62001, 121)
}

/// With every port TCP draws from held towards the backend, and the
/// client's port reserved for another client's closed flow, masquerade keeps
/// the client's port rather than drop the flow, and counts it: the backend
/// may still hold that tuple in TIME_WAIT.
fn full_snat_range_cases() -> Vec<Case> {
    vec![
        masqueraded_syn("TCP SYN 203.0.113.2:40003 -> 10.96.0.10:80: masqueraded", (EXTERNAL, 40003)),
        Case::new(
            "egress, every drawable port held, 40003 closed 2 s ago by 203.0.113.3: kept, counted as shared",
            tcp_syn((EXTERNAL, 40003), (BACKEND, 8080)),
            TC_ACT_OK,
            Expect::Translated(tcp_syn((NODE_IP, 40003), (BACKEND, 8080))),
            &[Counter::SnatPortShared, Counter::CtReleased],
        )
        .at_egress(MASQUERADE_MARK),
    ]
}

/// Every port TCP masquerade draws from (1024-65535 outside the default
/// ephemeral range) held by an open masqueraded flow towards the TCP
/// backend; port 40003 by another client's flow closed 2 s ago.
fn hold_every_snat_port(m: &mut Maps) -> anyhow::Result<()> {
    let held = CtEntry { direction: CT_REPLY, flags: CT_MASQUERADE, ..Default::default() };
    for port in (TCP_SNAT_PORT_LOW..=u16::MAX).filter(|p| !is_ephemeral(*p)) {
        m.conntrack.insert(&ct_key((BACKEND, 8080), (NODE_IP, port), IPPROTO_TCP), &held, 0)?;
    }
    hold_closed_flow(m, (EXTERNAL_2, 40003), 40003, 2)
}

fn is_ephemeral(port: u16) -> bool {
    (DEFAULT_EPHEMERAL_PORTS.0..=DEFAULT_EPHEMERAL_PORTS.1).contains(&port)
}

/// The port a listening socket of this test process holds (0: none yet):
/// masquerade must give no flow a tuple a node socket holds. Set once; the
/// socket lives as long as the process, so no table draws it meanwhile.
static NODE_LISTENER_PORT: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(0);

/// A node socket on the client's port (a listener of this process, in the
/// network namespace BPF_PROG_TEST_RUN runs in: the one the lookup asks).
fn node_socket_cases(port: u16) -> Vec<Case> {
    vec![
        masqueraded_syn(&format!("TCP SYN 203.0.113.2:{port} -> 10.96.0.10:80: masqueraded"), (EXTERNAL, port)),
        snat_to_a_drawn_port(&format!("egress: a node socket listens on port {port}: another port"), (EXTERNAL, port)),
    ]
}

fn closed_snat_port_is_closing(maps: &Maps) -> Result<(), String> {
    let key = ct_key((BACKEND, 8080), (NODE_IP, 62000), IPPROTO_TCP);
    let e = maps.conntrack_entry(&key).map_err(|e| format!("SNAT reply entry {key:?}: {e}"))?;
    if e.flags & CT_CLOSING == 0 {
        return Err(format!("SNAT reply entry after the client's FIN has flags {:#x}, want CT_CLOSING", e.flags));
    }
    Ok(())
}

/// A SYN from `client` (outside the cluster CIDR) to the ClusterIP: DNAT,
/// marked for masquerade.
fn masqueraded_syn(what: &str, client: Endpoint) -> Case {
    Case::new(
        what,
        tcp_syn(client, (VIP, 80)),
        TC_ACT_OK,
        Expect::Translated(tcp_syn(client, (BACKEND, 8080))),
        &[Counter::NewFlow, Counter::Masqueraded],
    )
    .leaves_mark(MASQUERADE_MARK)
}

/// That SYN at egress: from the node address and a port TCP draws (from
/// 1024 up, outside the node's ephemeral range; not 62000, which these
/// tables hold, nor the port a node socket listens on).
fn snat_to_a_drawn_port(what: &str, client: Endpoint) -> Case {
    Case::new(
        what,
        tcp_syn(client, (BACKEND, 8080)),
        TC_ACT_OK,
        Expect::TranslatedWith(|out| {
            let Some((port, _)) = frames::ports(out) else { return Err("the output has no TCP header".into()) };
            let listening = NODE_LISTENER_PORT.load(std::sync::atomic::Ordering::Relaxed);
            if port == 62000 || port == listening || port < TCP_SNAT_PORT_LOW || is_ephemeral(port) {
                return Err(format!(
                    "SNAT source port {port}: want a free one from {TCP_SNAT_PORT_LOW} up outside {DEFAULT_EPHEMERAL_PORTS:?}, not 62000 nor {listening}"
                ));
            }
            Ok(tcp_syn((NODE_IP, port), (BACKEND, 8080)))
        }),
        &[],
    )
    .at_egress(MASQUERADE_MARK)
}

/// A node socket's SYN (BPF_PROG_TEST_RUN gives its skb a socket) on the
/// tuple 203.0.113.2:40002's masqueraded flow holds: it leaves from a port
/// drawn for it, counted.
fn node_socket_on_a_taken_tuple(what: &str) -> Case {
    let mut case = snat_to_a_drawn_port(what, (NODE_IP, 40002)).at_egress(0);
    case.counters = vec![Counter::NodeSnat];
    case
}

fn masqueraded_reply_is_tracked(maps: &Maps) -> Result<(), String> {
    let key = ct_key((BACKEND, 8080), (NODE_IP, 62000), IPPROTO_TCP);
    let e = maps.conntrack_entry(&key).map_err(|e| format!("masqueraded reply entry {key:?}: {e}"))?;
    // Pending: a TCP flow is confirmed by its handshake's last ACK.
    let want =
        (CT_REPLY, CT_MASQUERADE | CT_PENDING, addr(VIP), 80u16.to_be(), addr(EXTERNAL), 62000u16.to_be());
    let got = (e.direction, e.flags, e.nat_addr, e.nat_port, e.rev_addr, e.rev_port);
    if got != want {
        return Err(format!("masqueraded reply {got:?}, want (direction, flags, frontend, port, client, port) {want:?}"));
    }
    Ok(())
}

/// Conntrack under a flood: only an opening starts a flow, and a TCP flow
/// is confirmed (moved out of the unconfirmed table a flood turns over) by
/// the client's ACK of the backend's SYN-ACK, not by the SYN-ACK itself.
fn handshake_cases() -> Vec<Case> {
    let (client, vip, backend) = ((CLIENT, 41000), (VIP, 80), (BACKEND, 8080));
    let ext = (EXTERNAL, 62100);
    let established = |what: &str, frame: fn(Endpoint, Endpoint) -> Vec<u8>, counters: &[Counter]| {
        Case::new(what, frame(client, vip), TC_ACT_OK, Expect::Translated(frame(client, backend)), counters)
    };
    vec![
        dropped(
            "TCP ACK 10.244.0.2:41000 -> 10.96.0.10:80, no flow: dropped out of state, nothing recorded",
            tcp_ack(client, vip, 5_000_001),
            Counter::CtOutOfState,
        )
        .then(no_flow_recorded),
        Case::translated("TCP SYN -> 10.96.0.10:80: DNAT, both entries unconfirmed", tcp_syn(client, vip), tcp_syn(client, backend), Counter::NewFlow)
            .then(flow_is_unconfirmed),
        Case::new("the backend's SYN-ACK (seq 5000000): a reply; still unconfirmed", tcp_syn_ack(backend, client), TC_ACT_OK, Expect::Unchanged, &[Counter::Reply])
            .leaves_mark(REVERSE_NAT_MARK)
            .then(handshake_ack_recorded),
        established("a client ACK of 5000002 (a blind guess): translated, not confirmed", |c, d| tcp_ack(c, d, 5_000_002), &[Counter::Established])
            .then(flow_is_unconfirmed),
        established(
            "the client's ACK of 5000001: the handshake completes, both entries confirmed",
            |c, d| tcp_ack(c, d, 5_000_001),
            &[Counter::Established, Counter::CtPromoted, Counter::CtPromoted],
        )
        .then(flow_is_confirmed),
        established("the next segment: established, as before", |c, d| tcp_data(c, d, b"GET /"), &[Counter::Established]),
        // Masqueraded: the SNAT reply entry and the SNAT choice move too.
        masqueraded_syn("TCP SYN 203.0.113.2:62100 -> 10.96.0.10:80 from outside: DNAT, marked for masquerade", ext),
        Case::new(
            "egress: from the node address, port kept",
            tcp_syn(ext, backend),
            TC_ACT_OK,
            Expect::Translated(tcp_syn((NODE_IP, 62100), backend)),
            &[],
        )
        .at_egress(MASQUERADE_MARK),
        Case::new(
            "SYN-ACK to 192.168.0.2:62100: back to 203.0.113.2:62100",
            tcp_syn_ack(backend, (NODE_IP, 62100)),
            TC_ACT_OK,
            Expect::Translated(tcp_syn_ack(backend, ext)),
            &[Counter::Reply],
        )
        .leaves_mark(REVERSE_NAT_MARK),
        Case::new(
            "the client's ACK: confirmed, its three entries",
            tcp_ack(ext, vip, 5_000_001),
            TC_ACT_OK,
            Expect::Translated(tcp_ack(ext, backend, 5_000_001)),
            &[Counter::Established, Counter::CtPromoted, Counter::CtPromoted, Counter::CtPromoted],
        )
        .leaves_mark(MASQUERADE_MARK)
        .then(masqueraded_flow_is_confirmed),
        Case::new(
            "egress: the confirmed SNAT choice still applies",
            tcp_ack(ext, backend, 5_000_001),
            TC_ACT_OK,
            Expect::Translated(tcp_ack((NODE_IP, 62100), backend, 5_000_001)),
            &[],
        )
        .at_egress(MASQUERADE_MARK),
    ]
}

fn no_flow_recorded(maps: &Maps) -> Result<(), String> {
    let n = maps.conntrack.keys().count() + maps.ct_unconfirmed.keys().count();
    if n == 0 { Ok(()) } else { Err(format!("{n} conntrack entries, want none")) }
}

/// Where the 10.244.0.2:41000 flow's two entries are: (unconfirmed, confirmed).
fn handshake_flow_entries(maps: &Maps) -> [(bool, bool); 2] {
    [ct_key((CLIENT, 41000), (VIP, 80), IPPROTO_TCP), ct_key((BACKEND, 8080), (CLIENT, 41000), IPPROTO_TCP)]
        .map(|k| (maps.ct_unconfirmed.get(&k, 0).is_ok(), maps.conntrack.get(&k, 0).is_ok()))
}

fn flow_is_unconfirmed(maps: &Maps) -> Result<(), String> {
    let at = handshake_flow_entries(maps);
    if at == [(true, false); 2] { Ok(()) } else { Err(format!("(unconfirmed, confirmed) of original and reply: {at:?}")) }
}

fn flow_is_confirmed(maps: &Maps) -> Result<(), String> {
    let at = handshake_flow_entries(maps);
    let pending = [ct_key((CLIENT, 41000), (VIP, 80), IPPROTO_TCP), ct_key((BACKEND, 8080), (CLIENT, 41000), IPPROTO_TCP)]
        .iter()
        .filter_map(|k| maps.conntrack.get(k, 0).ok())
        .any(|e| e.flags & CT_PENDING != 0);
    if at == [(false, true); 2] && !pending { Ok(()) } else { Err(format!("(unconfirmed, confirmed) of original and reply: {at:?}, pending flag: {pending}")) }
}

fn handshake_ack_recorded(maps: &Maps) -> Result<(), String> {
    flow_is_unconfirmed(maps)?;
    let e = maps.conntrack_entry(&ct_key((CLIENT, 41000), (VIP, 80), IPPROTO_TCP)).map_err(|e| e.to_string())?;
    let want = 5_000_001u32.to_be();
    if e.handshake_ack == want { Ok(()) } else { Err(format!("handshake_ack {:#x}, want {want:#x}", e.handshake_ack)) }
}

fn masqueraded_flow_is_confirmed(maps: &Maps) -> Result<(), String> {
    for key in [
        ct_key((EXTERNAL, 62100), (VIP, 80), IPPROTO_TCP),
        ct_key((BACKEND, 8080), (EXTERNAL, 62100), IPPROTO_TCP),
        ct_key((BACKEND, 8080), (NODE_IP, 62100), IPPROTO_TCP),
    ] {
        let e = maps.conntrack.get(&key, 0).map_err(|e| format!("confirmed entry {key:?}: {e}"))?;
        if e.flags & CT_PENDING != 0 || maps.ct_unconfirmed.get(&key, 0).is_ok() {
            return Err(format!("{key:?} still pending"));
        }
    }
    Ok(())
}

/// Frames the program must leave alone. The services are installed, so a
/// frame that was wrongly parsed as ours would show as a translation.
fn untouched_cases() -> Vec<Case> {
    let syn = tcp_syn((CLIENT, 40000), (VIP, 80));
    vec![
        Case::untouched(
            "TCP -> 10.96.0.99:80, no such service",
            tcp_syn((CLIENT, 40000), (UNALLOCATED, 80)),
            Counter::Passed,
        ),
        Case::untouched(
            "TCP -> 10.96.0.10:81, service address but not its port",
            tcp_syn((CLIENT, 40000), (VIP, 81)),
            Counter::Passed,
        ),
        Case::untouched(
            "UDP -> 10.96.0.10:80, service port but not its protocol",
            udp((CLIENT, 40000), (VIP, 80), b"x"),
            Counter::Passed,
        ),
        Case::untouched(
            "ICMP echo -> 10.96.0.10, neither TCP nor UDP",
            icmp_echo(CLIENT, VIP),
            Counter::Passed,
        ),
        Case::untouched(
            "ARP who-has 10.96.0.10 (ethertype 0x0806)",
            arp_request(CLIENT.octets(), VIP.octets()),
            Counter::Passed,
        ),
        Case::untouched(
            "IPv6 TCP -> [fd00::10]:80",
            tcp_syn((Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 2), 40000), (Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 0x10), 80)),
            Counter::Passed,
        ),
        // The kernel (6.18) refuses, with EINVAL, test input under the
        // ethertype's base header: an IPv4 frame needs 14 + 20 bytes, an
        // IPv6 one 14 + 40. Only other ethertypes run with 14 bytes.
        Case::untouched(
            "Ethernet header only, 14 bytes (ARP ethertype: the kernel refuses IPv4 ones under 34 bytes)",
            arp_request(CLIENT.octets(), VIP.octets())[..ETH_HLEN].to_vec(),
            Counter::Passed,
        ),
        Case::untouched(
            "Ethernet + bare IPv4 header, no L4 bytes (34 bytes, the least the kernel takes for IPv4)",
            syn[..ETH_HLEN + 20].to_vec(),
            Counter::Malformed,
        ),
        Case::untouched(
            "IPv4 header cut in the middle: IHL 15 (60 bytes), 20 present (34-byte frame)",
            with_ipv4_header(syn[..ETH_HLEN + 20].to_vec(), |ip| {
                ip[0] = 0x4f;
                ip[2..4].copy_from_slice(&80u16.to_be_bytes());
            }),
            Counter::Malformed,
        ),
        Case::untouched(
            "TCP header cut after 10 bytes, IP total length claims the whole segment",
            syn[..ETH_HLEN + 20 + 10].to_vec(),
            Counter::Malformed,
        ),
        Case::untouched(
            "IP total length 30 (valid checksum): too short for a TCP header",
            with_ipv4_header(syn[..ETH_HLEN + 30].to_vec(), |ip| ip[2..4].copy_from_slice(&30u16.to_be_bytes())),
            Counter::Malformed,
        ),
        Case::untouched("IHL 4 (< 5)", with_ipv4_header(syn.clone(), |ip| ip[0] = 0x44), Counter::Malformed),
        Case::untouched(
            "IP version 6 under the IPv4 ethertype",
            with_ipv4_header(syn.clone(), |ip| ip[0] = 0x65),
            Counter::Malformed,
        ),
        Case::untouched(
            "IP total length 100 bytes more than the frame holds",
            with_ipv4_header(syn.clone(), |ip| {
                let len = u16::from_be_bytes([ip[2], ip[3]]) + 100;
                ip[2..4].copy_from_slice(&len.to_be_bytes());
            }),
            Counter::Malformed,
        ),
        // (Fragments that follow their first: fragment_fixtures.rs.)
        Case::untouched(
            "non-first fragment (offset 1480) -> 10.96.0.10:80, its first not seen",
            with_ipv4_header(syn.clone(), |ip| ip[6..8].copy_from_slice(&(1480u16 / 8).to_be_bytes())),
            Counter::Fragment,
        ),
    ]
}

#[test]
#[ignore = "needs root (BPF)"]
fn translation_fixtures() {
    let fx = Fixture::new("fixtures-xlate", install_services).unwrap();
    run_table(&fx, "translation", translation_cases());
}

#[test]
#[ignore = "needs root (BPF)"]
fn handshake_fixtures() {
    let mut fx = Fixture::new("fixtures-handshake", install_services).unwrap();
    install_policy(&mut fx.maps).expect("filling the policy maps");
    run_table(&fx, "handshake", handshake_cases());
}

#[test]
#[ignore = "needs root (BPF)"]
fn verdict_fixtures() {
    let mut fx = Fixture::new("fixtures-verdict", install_services).unwrap();
    install_policy(&mut fx.maps).expect("filling the policy maps");
    run_table(&fx, "verdict", verdict_cases());
}

// The same tables through xdp_ingress in front of tc_ingress, as on a node
// with --xdp-devices (see `run_table_through_xdp`).

#[test]
#[ignore = "needs root (BPF)"]
fn translation_fixtures_through_xdp() {
    let fx = Fixture::with_xdp("fixtures-xlate-xdp", install_services).unwrap();
    run_table_through_xdp(&fx, "translation", translation_cases());
}

#[test]
#[ignore = "needs root (BPF)"]
fn handshake_fixtures_through_xdp() {
    let mut fx = Fixture::with_xdp("fixtures-handshake-xdp", install_services).unwrap();
    install_policy(&mut fx.maps).expect("filling the policy maps");
    run_table_through_xdp(&fx, "handshake", handshake_cases());
}

#[test]
#[ignore = "needs root (BPF)"]
fn verdict_fixtures_through_xdp() {
    let mut fx = Fixture::with_xdp("fixtures-verdict-xdp", install_services).unwrap();
    install_policy(&mut fx.maps).expect("filling the policy maps");
    run_table_through_xdp(&fx, "verdict", verdict_cases());
}

/// XDP sending a frame it translated out itself (`xdp_send_out`), in a
/// namespace whose FIB routes BACKEND through a veth to a next hop with a
/// known neighbour (BPF_PROG_TEST_RUN runs XDP as if the frame came in on
/// the namespace's loopback, so the interface out is another one: a
/// redirect). A masqueraded external client's SYN leaves as TC egress would
/// have sent it, with the next hop's MAC addresses and TTL - 1; out of an
/// interface XDP is not on, or with TTL 1, it goes up the stack instead.
#[test]
#[ignore = "needs root (BPF)"]
fn send_out_fixtures_through_xdp() {
    const OUT_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x10];
    const NEXT_HOP_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x20];
    let ns = Netns::new(&format!("fx-xdpout-{}", unique_suffix())).unwrap();
    for args in [
        &["link", "add", "out0", "address", "02:00:00:00:00:10", "type", "veth", "peer", "name", "out1"][..],
        &["link", "set", "out0", "up"],
        &["link", "set", "out1", "up"],
        &["link", "set", "lo", "up"],
        &["addr", "add", "192.0.2.1/24", "dev", "out0"],
        &["route", "add", &format!("{BACKEND}/32"), "via", "192.0.2.2", "dev", "out0"],
        &["neigh", "replace", "192.0.2.2", "lladdr", "02:00:00:00:00:20", "dev", "out0", "nud", "permanent"],
    ] {
        ns.ip(args).unwrap();
    }
    // `all` sets every interface's, loopback's (the frame's way in) too.
    ns.sysctl("net.ipv4.conf.all.forwarding", "1").unwrap();
    let checked = ns.run(move || -> Result<(), String> {
        let out0 = nix::net::if_::if_nametoindex("out0").map_err(|e| format!("out0: {e}"))?;
        let mut fx = Fixture::with_xdp("fixtures-xdp-send-out", install_services).map_err(|e| format!("{e:#}"))?;
        install_policy(&mut fx.maps).map_err(|e| format!("{e:#}"))?;
        let run = |fx: &Fixture, what: &str, input: &[u8]| {
            let run = fx.run_xdp(input).map_err(|e| format!("{what}: test run: {e}"))?;
            println!("{what}: {} ({} bytes)", xdp_verdict_name(run.verdict), run.frame.len());
            Ok::<_, String>(run)
        };

        let before = run(&fx, "out of an interface XDP is not on", &tcp_syn((EXTERNAL, 40100), (VIP, 80)))?;
        if before.verdict != XDP_PASS || !before.finished {
            return Err(format!("not allowed out of out0: want a translated frame up the stack, got {}", xdp_verdict_name(before.verdict)));
        }

        fx.allow_xdp_sending(out0).map_err(|e| format!("{e:#}"))?;
        // The SYN as it leaves masqueraded to `port`: TTL - 1, the next hop's MACs.
        let sent_out = |port: u16| {
            let mut frame = with_ipv4_header(tcp_syn((NODE_IP, port), (BACKEND, 8080)), |h| h[8] -= 1);
            frame[..6].copy_from_slice(&NEXT_HOP_MAC);
            frame[6..12].copy_from_slice(&OUT_MAC);
            frame
        };
        let sent = run(&fx, "masqueraded SYN, out of out0", &tcp_syn((EXTERNAL, 40101), (VIP, 80)))?;
        let want = sent_out(40101);
        if sent.verdict != XDP_REDIRECT || sent.frame != want {
            return Err(format!("want XDP_REDIRECT and the SNATed frame, got {}: {}", xdp_verdict_name(sent.verdict), diff(&want, &sent.frame)));
        }
        frames::check_checksums(&sent.frame)?;
        if fx.xdp_sent(out0).map_err(|e| format!("{e:#}"))? != 1 {
            return Err("XDP_DEVICES did not count the frame sent out of out0".into());
        }

        // The source chosen is kept in the flow's own entry too, and the
        // flow's next frames leave with the one that entry holds, with no
        // SNAT lookup: an entry made to hold another port shows which.
        let original = ct_key((EXTERNAL, 40101), (VIP, 80), IPPROTO_TCP);
        let mut entry = fx.maps.conntrack_entry(&original).map_err(|e| format!("the flow's entry: {e}"))?;
        if (entry.rev_addr, entry.rev_port) != (addr(NODE_IP), 40101u16.to_be()) {
            return Err(format!("the flow's entry holds source {:?}:{}, want {NODE_IP}:40101", entry.rev_addr, u16::from_be(entry.rev_port)));
        }
        entry.rev_port = 41101u16.to_be();
        fx.maps.ct_unconfirmed.insert(&original, &entry, 0).map_err(|e| format!("rewriting the flow's entry: {e}"))?;
        let again = run(&fx, "the SYN again, its entry holding port 41101", &tcp_syn((EXTERNAL, 40101), (VIP, 80)))?;
        let want_again = sent_out(41101);
        if again.verdict != XDP_REDIRECT || again.frame != want_again {
            return Err(format!("want the source its entry holds, got {}: {}", xdp_verdict_name(again.verdict), diff(&want_again, &again.frame)));
        }
        frames::check_checksums(&again.frame)?;

        let last_hop = with_ipv4_header(tcp_syn((EXTERNAL, 40102), (VIP, 80)), |h| h[8] = 1);
        let expiring = run(&fx, "TTL 1", &last_hop)?;
        if expiring.verdict != XDP_PASS {
            return Err(format!("TTL 1: want it up the stack (its ICMP time exceeded), got {}", xdp_verdict_name(expiring.verdict)));
        }
        Ok(())
    });
    checked.unwrap().unwrap();
}

/// A frame can reach XDP with metadata already, even a handoff of ours:
/// veth carries a frame's metadata along, so a frame XDP sent out can come
/// back in with it. XDP replaces whatever is there with one fresh handoff.
/// Stacked in front instead, two handoffs and a third would pass the
/// kernel's 32 bytes, and the stale one, saying "translated", would make TC
/// let the untranslated frame through.
#[test]
#[ignore = "needs root (BPF)"]
fn xdp_replaces_the_metadata_a_frame_arrives_with() {
    let fx = Fixture::with_xdp("fixtures-xdp-stale-metadata", install_services).unwrap();
    let stale: Vec<u8> = [XDP_HANDOFF_MAGIC, XDP_HANDOFF_TRANSLATED, 0, 0].iter().flat_map(|w| w.to_ne_bytes()).collect();
    assert_eq!(stale.len(), XDP_HANDOFF_LEN);
    for handoffs in 1..=2u16 {
        let client = (CLIENT, 40000 + handoffs);
        let run = match fx.run_xdp_with_metadata(&stale.repeat(handoffs.into()), &tcp_syn(client, (VIP, 80))) {
            Err(e) if KernelVersion::current().unwrap() < KernelVersion::new(5, 13, 0) => {
                println!("this kernel's test run takes no metadata ({e}): nothing to check");
                return;
            }
            run => run.unwrap(),
        };
        let want = tcp_syn(client, (BACKEND, 8080));
        println!("{handoffs} stale handoff(s): {}, decided in XDP: {}", xdp_verdict_name(run.verdict), run.finished);
        assert!(run.finished && run.frame == want, "with {handoffs} stale handoff(s): want the frame translated in XDP, got {} (decided in XDP: {}): {}", xdp_verdict_name(run.verdict), run.finished, diff(&want, &run.frame));
        // (`marks` is Some only when exactly one handoff came back.)
        assert_eq!(run.marks, Some(0), "with {handoffs} stale handoff(s): want one fresh handoff, no marks");
    }
}

#[test]
#[ignore = "needs root (BPF)"]
fn untouched_fixtures_through_xdp() {
    let fx = Fixture::with_xdp("fixtures-untouched-xdp", install_services).unwrap();
    run_table_through_xdp(&fx, "left untouched", untouched_cases());
    let flows = fx.maps.conntrack.keys().count() + fx.maps.ct_unconfirmed.keys().count();
    assert_eq!(flows, 0, "untouched frames created {flows} conntrack entries");
}

#[test]
#[ignore = "needs root (BPF)"]
fn closed_port_reuse_fixtures() {
    let mut fx = Fixture::new("fixtures-snat-reuse", install_services).unwrap();
    install_policy(&mut fx.maps).expect("filling the policy maps");
    hold_ports_of_closed_flows(&mut fx.maps).expect("holding SNAT ports 62000 and 62001");
    run_table(&fx, "closed SNAT port reuse", closed_port_reuse_cases());
}

#[test]
#[ignore = "needs root (BPF)"]
fn unanswered_port_fixtures() {
    let mut fx = Fixture::new("fixtures-unanswered", install_services).unwrap();
    install_policy(&mut fx.maps).expect("filling the policy maps");
    hold_unanswered_flow(&mut fx.maps, (EXTERNAL_2, 62010), 62010, 5).expect("holding port 62010");
    hold_unanswered_flow(&mut fx.maps, (EXTERNAL_2, 62011), 62011, 31).expect("holding port 62011");
    run_table(&fx, "unanswered flow's SNAT port", unanswered_port_cases());
}

#[test]
#[ignore = "needs root (BPF)"]
fn full_snat_range_fixtures() {
    let mut fx = Fixture::new("fixtures-snat-full", install_services).unwrap();
    install_policy(&mut fx.maps).expect("filling the policy maps");
    hold_every_snat_port(&mut fx.maps).expect("holding the SNAT ports");
    run_table(&fx, "full SNAT range", full_snat_range_cases());
}

#[test]
#[ignore = "needs root (BPF)"]
fn node_socket_fixtures() {
    let mut fx = Fixture::new("fixtures-snat-socket", install_services).unwrap();
    install_policy(&mut fx.maps).expect("filling the policy maps");
    let listener = std::net::TcpListener::bind("0.0.0.0:0").expect("a listener on a free port");
    let port = listener.local_addr().unwrap().port();
    NODE_LISTENER_PORT.store(port, std::sync::atomic::Ordering::Relaxed);
    std::mem::forget(listener);
    run_table(&fx, "node socket on the client's port", node_socket_cases(port));
}

#[test]
#[ignore = "needs root (BPF)"]
fn untouched_fixtures() {
    let fx = Fixture::new("fixtures-untouched", install_services).unwrap();
    run_table(&fx, "left untouched", untouched_cases());
    let flows = fx.maps.conntrack.keys().count() + fx.maps.ct_unconfirmed.keys().count();
    assert_eq!(flows, 0, "untouched frames created {flows} conntrack entries");
}

/// REJECT is rate-limited per source, as the kernel limits its ICMP errors:
/// a source that keeps knocking on a port without endpoints gets its burst
/// answered, then silence (counted), while another source is still answered.
/// The clock runs while the fixture does, so the bound on answers grows
/// with the time the runs took.
#[test]
#[ignore = "needs root (BPF)"]
fn reject_rate_limit_fixtures() {
    use proxy_common::reject_limit::{REJECT_BURST, REJECTS_PER_SEC};
    let fx = Fixture::new("fixtures-reject-limit", install_services).unwrap();
    let syn = |src: Ipv4Addr| tcp_syn((src, 40000), (VIP_EMPTY, 80));
    let before = fx.counters();
    let started = std::time::Instant::now();
    let mut answered = 0u64;
    let mut limited = false;
    for _ in 0..REJECT_BURST + 60 * REJECTS_PER_SEC {
        let (verdict, _, _) = fx.run(proxy_user::maps::TC_INGRESS, &syn(CLIENT), 0).unwrap();
        match verdict {
            TC_ACT_REDIRECT => answered += 1,
            TC_ACT_SHOT => {
                limited = true;
                break;
            }
            other => panic!("verdict {other} for a SYN to a port without endpoints"),
        }
    }
    let took = started.elapsed().as_secs_f64();
    assert!(limited, "{answered} rejects answered, none limited");
    let most = REJECT_BURST + (REJECTS_PER_SEC as f64 * (took + 1.0)) as u64;
    assert!((REJECT_BURST..=most).contains(&answered), "{answered} answered in {took:.2}s (burst {REJECT_BURST})");
    let (verdict, _, _) = fx.run(proxy_user::maps::TC_INGRESS, &syn(EXTERNAL), 0).unwrap();
    assert_eq!(verdict, TC_ACT_REDIRECT, "another source is still answered");
    let after = fx.counters();
    let moved = |c: Counter| after[c as usize] - before[c as usize];
    assert_eq!(moved(Counter::RejectLimited), 1);
    assert_eq!(moved(Counter::Rejected), answered + 1);
    println!("reject rate limit: {answered} answered from one source in {took:.3}s, then dropped");
}

// ---------------------------------------------------------------- map checks

fn ct_key(src: Endpoint, dst: Endpoint, proto: u8) -> CtKey {
    CtKey {
        src: addr(src.0),
        dst: addr(dst.0),
        sport: src.1.to_be(),
        dport: dst.1.to_be(),
        proto,
        _pad: [0; 3],
    }
}

fn original_entry_is_closing(maps: &Maps) -> Result<(), String> {
    let key = ct_key((CLIENT, 40000), (VIP, 80), IPPROTO_TCP);
    let e = maps.conntrack_entry(&key).map_err(|e| format!("conntrack {key:?}: {e}"))?;
    if e.flags & CT_CLOSING == 0 {
        return Err(format!("ORIGINAL entry after a FIN has flags {:#x}, want CT_CLOSING", e.flags));
    }
    Ok(())
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

/// 10.96.0.10:80/TCP -> 10.244.0.11:8080 and :53/UDP -> :5353, one backend
/// each so the choice is deterministic; 10.96.0.20:80/TCP with none.
fn install_services(m: &mut Maps) -> anyhow::Result<()> {
    let backend = |port: u16, proto| Backend {
        addr: addr(BACKEND),
        port: port.to_be(),
        proto,
        flags: BACKEND_READY | BACKEND_SERVING,
    };
    m.put_backend(TCP_BACKEND_ID, &backend(8080, IPPROTO_TCP))?;
    m.put_backend(UDP_BACKEND_ID, &backend(5353, IPPROTO_UDP))?;
    m.put_slot(&SlotKey { service_id: TCP_SERVICE_ID, slot: 0 }, TCP_BACKEND_ID)?;
    m.put_slot(&SlotKey { service_id: UDP_SERVICE_ID, slot: 0 }, UDP_BACKEND_ID)?;
    let services = [
        (VIP, 80, IPPROTO_TCP, TCP_SERVICE_ID, 1, "default/web:http"),
        (VIP, 53, IPPROTO_UDP, UDP_SERVICE_ID, 1, "default/web:dns"),
        (VIP_EMPTY, 80, IPPROTO_TCP, EMPTY_SERVICE_ID, 0, "default/empty:http"),
    ];
    for (vip, port, proto, service_id, backend_count, name) in services {
        let key = FrontendKey { addr: addr(vip), port: u16::to_be(port), proto, scope: SCOPE_INTERNAL };
        let entry = ServiceEntry { service_id, backend_count, kind: KIND_CLUSTER_IP, ..Default::default() };
        m.put_frontend(&key, &entry)?;
        m.put_name(service_id, &ServiceName::new(name, SCOPE_INTERNAL))?;
    }
    Ok(())
}

/// What the agent adds for kube-proxy's policies: cluster and service CIDRs,
/// the node address to masquerade with, ClusterIP markers, a LoadBalancer
/// frontend with source ranges, a masquerading external-scope frontend and a
/// Local-policy frontend without local endpoints.
fn install_policy(m: &mut Maps) -> anyhow::Result<()> {
    let snat = [(0u32, std::net::IpAddr::from(NODE_IP))].into_iter().collect();
    m.write_node_config(&snat, &[CLUSTER_CIDR.parse()?])?;
    m.put_service_cidr(&SERVICE_CIDR.parse()?)?;
    for vip in [VIP, VIP_EMPTY] {
        m.put_frontend(&cluster_ip_marker(addr(vip)), &ServiceEntry { kind: KIND_CLUSTER_IP, ..Default::default() })?;
    }
    let tcp = |ip: Ipv4Addr, scope| FrontendKey { addr: addr(ip), port: 80u16.to_be(), proto: IPPROTO_TCP, scope };
    let served = ServiceEntry { service_id: TCP_SERVICE_ID, backend_count: 1, kind: KIND_CLUSTER_IP, ..Default::default() };
    m.put_frontend(&tcp(VIP, SCOPE_EXTERNAL), &ServiceEntry { flags: SVC_MASQUERADE, ..served })?;
    m.put_source_range(TCP_SERVICE_ID, &LB_SOURCE_RANGE.parse()?)?;
    m.put_frontend(&tcp(LB_IP, SCOPE_EXTERNAL), &ServiceEntry { kind: KIND_LOAD_BALANCER, flags: SVC_SOURCE_RANGES, ..served })?;
    let local_empty = ServiceEntry { service_id: LOCAL_EMPTY_SERVICE_ID, flags: SVC_DROP_IF_EMPTY, ..Default::default() };
    m.put_frontend(&tcp(LOCAL_EMPTY, SCOPE_INTERNAL), &local_empty)?;
    Ok(())
}

// ---------------------------------------------------------------- frames

/// With a router alert option (RFC 2113), 4 bytes: IHL 6.
fn with_router_alert(mut frame: Vec<u8>) -> Vec<u8> {
    insert_ipv4_options(&mut frame, &[0x94, 0x04, 0x00, 0x00]);
    frame
}

fn without_udp_checksum(mut frame: Vec<u8>) -> Vec<u8> {
    let at = ETH_HLEN + 20 + 6;
    frame[at..at + 2].copy_from_slice(&[0, 0]);
    frame
}
