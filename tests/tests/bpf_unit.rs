//! BPF unit tests: one concern's code at a time (conntrack, nat, lb,
//! reject), on the real kernel, as Cilium's bpf/tests do. Each test loads
//! the unit object (proxy-ebpf/src/bpf_unit.rs: the production modules and
//! one small program per operation, proxy-ebpf/src/unit/), fills its maps,
//! runs a program on a frame with BPF_PROG_TEST_RUN and checks the verdict,
//! the frame, the maps and the program's report. The whole-program
//! fixtures (fixtures.rs and the others) run the same code as the agent
//! attaches it; these say which concern broke.
//!
//! Frames come from the shared builder (`frames`), checked byte for byte
//! against a frame built for the expected result, checksums recomputed from
//! scratch. Needs root (BPF).

#![feature(custom_test_frameworks)]
#![test_runner(proxy_tests::harness::run)]

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    time::Duration,
};

use aya::maps::lpm_trie::Key;
use etherparse::{
    Icmpv4Type, Icmpv6Type, NetSlice, PacketHeaders, SlicedPacket, TransportHeader, TransportSlice, icmpv4, icmpv6,
};
use proxy_common::{
    unit::{
        UNIT_MISS_DROP_UNALLOCATED, UNIT_MISS_NONE, UNIT_MISS_NOT_OURS, UNIT_MISS_REJECT, UNIT_SCOPE_OF_SOURCE,
        UnitReport, UnitSetup,
    },
    *,
};
use proxy_tests::{
    addrs::{BACKEND, BACKEND6, CLIENT, CLIENT6, EXTERNAL, UNALLOCATED, VIP, VIP6, addr},
    bpf_unit::{Run, Unit},
    fixture::{TC_ACT_OK, TC_ACT_SHOT, diff},
    frames::{
        self, ETH_HLEN, MAC_DST, MAC_SRC, insert_ipv4_options, sctp_frame, tcp_ack, tcp_data, tcp_fin, tcp_rst,
        tcp_syn, tcp_syn_ack, udp,
    },
    sctp::chunk,
};

// ---------------------------------------------------------------- the world

/// A client, a Service's frontend and its backend, in one family.
#[derive(Clone, Copy)]
struct World {
    name: &'static str,
    client: IpAddr,
    vip: IpAddr,
    backend: IpAddr,
    /// A second backend of the same Service, and a second client.
    backend_2: IpAddr,
    client_2: IpAddr,
    /// In the service CIDR, no Service's.
    unallocated: IpAddr,
    /// The cluster CIDR (CLIENT and BACKEND are in it) and the service CIDR,
    /// as the LPM maps hold them.
    cluster_cidr: (u32, IpAddr),
    service_cidr: (u32, IpAddr),
}

const V4: World = World {
    name: "IPv4",
    client: IpAddr::V4(CLIENT),
    vip: IpAddr::V4(VIP),
    backend: IpAddr::V4(BACKEND),
    backend_2: IpAddr::V4(Ipv4Addr::new(10, 244, 0, 12)),
    client_2: IpAddr::V4(Ipv4Addr::new(10, 244, 0, 3)),
    unallocated: IpAddr::V4(UNALLOCATED),
    cluster_cidr: (96 + 16, IpAddr::V4(Ipv4Addr::new(10, 244, 0, 0))),
    service_cidr: (96 + 16, IpAddr::V4(Ipv4Addr::new(10, 96, 0, 0))),
};

const V6: World = World {
    name: "IPv6",
    client: IpAddr::V6(CLIENT6),
    vip: IpAddr::V6(VIP6),
    backend: IpAddr::V6(BACKEND6),
    backend_2: IpAddr::V6(Ipv6Addr::new(0xfd00, 0x244, 0, 0, 0, 0, 0, 0x12)),
    client_2: IpAddr::V6(Ipv6Addr::new(0xfd00, 0x244, 0, 0, 0, 0, 0, 3)),
    unallocated: IpAddr::V6(Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x99)),
    cluster_cidr: (64, IpAddr::V6(Ipv6Addr::new(0xfd00, 0x244, 0, 0, 0, 0, 0, 0))),
    service_cidr: (64, IpAddr::V6(Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0))),
};

const WORLDS: [World; 2] = [V4, V6];

const CLIENT_PORT: u16 = 40000;
const FRONTEND_PORT: u16 = 80;
const BACKEND_PORT: u16 = 8080;
const SERVICE_ID: u32 = 7;
const BACKEND_ID: u32 = 3;

fn load(label: &str) -> Unit {
    Unit::load(label).expect("loading the unit object")
}

fn backend_entry(ip: IpAddr, port: u16, proto: u8) -> Backend {
    Backend { addr: addr(ip), port: port.to_be(), proto, flags: BACKEND_READY }
}

fn service_entry(backend_count: u32, affinity_timeout_s: u32) -> ServiceEntry {
    ServiceEntry { service_id: SERVICE_ID, backend_count, affinity_timeout_s, ..Default::default() }
}

fn key(src: (IpAddr, u16), dst: (IpAddr, u16), proto: u8) -> CtKey {
    CtKey { src: addr(src.0), dst: addr(dst.0), sport: src.1.to_be(), dport: dst.1.to_be(), proto, _pad: [0; 3] }
}

/// One run that must get to its concern's call.
fn run(unit: &mut Unit, program: &str, frame: &[u8], what: &str) -> Run {
    let run = unit.run(program, frame).unwrap_or_else(|e| panic!("{what}: {e:#}"));
    assert_eq!(run.report.ran, 1, "{what}: {program} never reached its call (the frame did not parse?)");
    run
}

/// The frame out of a program is `want`, byte for byte, and its checksums,
/// recomputed from scratch, are right.
fn same_frame(what: &str, got: &[u8], want: &[u8]) {
    assert!(got == want, "{what}: the frame differs from the one expected: {}", diff(want, got));
    if let Err(e) = frames::recheck(got, want) {
        panic!("{what}: {e}");
    }
}

/// CLOCK_MONOTONIC, the clock conntrack and affinity stamp entries with.
fn monotonic() -> Duration {
    Duration::from(nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).expect("clock_gettime"))
}

/// An entry stamped at time 0 is `idle` old only once the machine has been
/// up that long (a VM's tests start seconds after boot): waits until then.
fn stamp_zero_is_older_than(idle: Duration) {
    let up = monotonic();
    if up <= idle {
        std::thread::sleep(idle - up + Duration::from_secs(1));
    }
}

// ---------------------------------------------------------------- conntrack

type Endpoint = (IpAddr, u16);

impl World {
    /// The client's, the frontend's and the backend's address and port.
    fn ends(&self) -> (Endpoint, Endpoint, Endpoint) {
        ((self.client, CLIENT_PORT), (self.vip, FRONTEND_PORT), (self.backend, BACKEND_PORT))
    }
}

/// The setup of a new flow from `w.client` to the frontend, to `w.backend`.
fn flow_setup(w: &World, proto: u8) -> UnitSetup {
    UnitSetup {
        service: service_entry(1, 0),
        backend: backend_entry(w.backend, BACKEND_PORT, proto),
        backend_id: BACKEND_ID,
        ..Default::default()
    }
}

/// `frame`'s flow as `conntrack::lookup_flow` finds it.
fn lookup(unit: &mut Unit, frame: &[u8], what: &str) -> UnitReport {
    run(unit, "unit_ct_lookup", frame, what).report
}

/// The entry under `k` in the conntrack table `map`.
fn entry(unit: &mut Unit, map: &str, k: &CtKey) -> Option<CtEntry> {
    unit.hash::<CtKey, CtEntry>(map).unwrap().get(k, 0).ok()
}

/// The entry under `k` made idle since boot (stamped at time 0).
fn idle_since_boot(unit: &mut Unit, map: &str, k: &CtKey) {
    let e = entry(unit, map, k).expect("the entry to age");
    unit.hash::<CtKey, CtEntry>(map).unwrap().insert(k, &CtEntry { last_seen_ns: 0, ..e }, 0).unwrap();
}

/// A new flow's entries: the original (client -> frontend, to the backend)
/// and the reply (backend -> client, from the frontend), both unconfirmed.
/// TCP waits for its handshake; UDP and SCTP are confirmed by any reply.
#[test]
#[ignore = "needs root (BPF)"]
fn conntrack_opening_creates_unconfirmed_entries() {
    let mut unit = load("unit-ct-open");
    for w in WORLDS {
        let (client, vip, backend) = w.ends();
        for (proto, opening, confirm_on_reply) in [
            (IPPROTO_TCP, tcp_syn(client, vip), 0),
            (IPPROTO_UDP, udp(client, vip, b"q"), CT_CONFIRM_ON_REPLY),
            (IPPROTO_SCTP, sctp_init(w.client, w.vip), CT_CONFIRM_ON_REPLY),
        ] {
            let what = format!("{} proto {proto} opening", w.name);
            unit.setup(flow_setup(&w, proto)).unwrap();
            let created = run(&mut unit, "unit_ct_create", &opening, &what);
            assert_eq!(created.report.rc, 0, "{what}: conntrack::create failed");

            let o = entry(&mut unit, MAP_CT_UNCONFIRMED, &key(client, vip, proto));
            let o = o.unwrap_or_else(|| panic!("{what}: no unconfirmed original entry"));
            let r = entry(&mut unit, MAP_CT_UNCONFIRMED, &key(backend, client, proto));
            let r = r.unwrap_or_else(|| panic!("{what}: no unconfirmed reply entry"));
            assert_eq!(o.direction, CT_ORIGINAL, "{what}: original entry's direction");
            let to_backend = (addr(w.backend), BACKEND_PORT.to_be());
            assert_eq!((o.nat_addr, o.nat_port), to_backend, "{what}: original goes to the backend");
            assert_eq!(o.flags, CT_PENDING | confirm_on_reply, "{what}: original entry's flags");
            let ids = (o.service_id, o.backend_id);
            assert_eq!(ids, (SERVICE_ID, BACKEND_ID), "{what}: original entry's service and backend");
            assert_eq!(o.handshake_ack, 0, "{what}: no SYN-ACK seen yet");
            assert_eq!(r.direction, CT_REPLY, "{what}: reply entry's direction");
            let from_frontend = (addr(w.vip), FRONTEND_PORT.to_be());
            assert_eq!((r.nat_addr, r.nat_port), from_frontend, "{what}: reply comes from the frontend");
            assert_eq!(r.flags, CT_PENDING | confirm_on_reply, "{what}: reply entry's flags");
            let confirmed = unit.hash::<CtKey, CtEntry>(MAP_CONNTRACK).unwrap().keys().count();
            assert_eq!(confirmed, 0, "{what}: nothing is confirmed before a reply");
        }
    }
}

/// Either direction's packet finds its flow in one lookup, with the
/// translation its direction needs; another tuple finds nothing.
#[test]
#[ignore = "needs root (BPF)"]
fn conntrack_lookup_finds_each_direction() {
    let mut unit = load("unit-ct-lookup");
    for w in WORLDS {
        let (client, vip, backend) = w.ends();
        unit.setup(flow_setup(&w, IPPROTO_TCP)).unwrap();
        run(&mut unit, "unit_ct_create", &tcp_syn(client, vip), w.name);

        let what = format!("{}: the client's retransmitted SYN", w.name);
        let found = lookup(&mut unit, &tcp_syn(client, vip), &what);
        assert_eq!(found.found, 1, "{what}: finds its flow");
        assert_eq!(found.entry.direction, CT_ORIGINAL, "{what}: original direction");
        let to = (found.entry.nat_addr, found.entry.nat_port);
        assert_eq!(to, (addr(w.backend), BACKEND_PORT.to_be()), "{what}: to the backend");

        let what = format!("{}: the backend's SYN-ACK (the reverse tuple)", w.name);
        let found = lookup(&mut unit, &tcp_syn_ack(backend, client), &what);
        assert_eq!(found.found, 1, "{what}: finds the flow");
        assert_eq!(found.entry.direction, CT_REPLY, "{what}: reply direction");
        let from = (found.entry.nat_addr, found.entry.nat_port);
        assert_eq!(from, (addr(w.vip), FRONTEND_PORT.to_be()), "{what}: from the frontend");

        let what = format!("{}: another client port", w.name);
        assert_eq!(lookup(&mut unit, &tcp_syn((w.client, CLIENT_PORT + 1), vip), &what).found, 0, "{what}: no flow");
        let what = format!("{}: the frontend answering (not the backend)", w.name);
        assert_eq!(lookup(&mut unit, &tcp_syn_ack(vip, client), &what).found, 0, "{what}: no flow");
    }
}

/// With no flow, only an opening may start one (a TCP SYN, an SCTP INIT,
/// any UDP datagram): anything else is out of state, and the datapath
/// drops it (`ct_out_of_state`).
#[test]
#[ignore = "needs root (BPF)"]
fn conntrack_without_flow_only_an_opening_is_in_state() {
    let mut unit = load("unit-ct-state");
    for w in WORLDS {
        let (client, vip, _) = w.ends();
        for (what, frame, may_open) in [
            ("TCP SYN", tcp_syn(client, vip), true),
            ("UDP datagram", udp(client, vip, b"q"), true),
            ("SCTP INIT", sctp_init(w.client, w.vip), true),
            ("TCP ACK", tcp_ack(client, vip, 2_000_001), false),
            ("TCP data", tcp_data(client, vip, b"GET /"), false),
            ("TCP FIN", tcp_fin(client, vip), false),
            ("TCP RST", tcp_rst(client, vip), false),
            ("TCP SYN-ACK", tcp_syn_ack(client, vip), false),
            ("SCTP DATA", sctp_frame(client, vip, 0x1234, &[chunk::data(1, b"x")]), false),
        ] {
            let what = format!("{} {what} with no flow", w.name);
            let seen = lookup(&mut unit, &frame, &what);
            assert_eq!(seen.found, 0, "{what}: no entry");
            assert_eq!(seen.may_open_flow == 1, may_open, "{what}: may open a flow (else out of state)");
        }
    }
}

/// A TCP flow is confirmed by the client's ACK of the backend's SYN-ACK:
/// the SYN-ACK records the number that ACK must carry, only that number
/// completes the handshake, and confirming moves both entries to the
/// confirmed table.
#[test]
#[ignore = "needs root (BPF)"]
fn conntrack_tcp_handshake_confirms_the_flow() {
    let mut unit = load("unit-ct-handshake");
    for w in WORLDS {
        let (client, vip, backend) = w.ends();
        let (original, reply) = (key(client, vip, IPPROTO_TCP), key(backend, client, IPPROTO_TCP));
        unit.setup(flow_setup(&w, IPPROTO_TCP)).unwrap();
        run(&mut unit, "unit_ct_create", &tcp_syn(client, vip), w.name);

        let what = format!("{}: ACK before any SYN-ACK", w.name);
        let early = run(&mut unit, "unit_ct_handshake", &tcp_ack(client, vip, 5_000_001), &what).report;
        assert_eq!(early.completes_handshake, 0, "{what}: completes nothing");

        // frames::tcp_syn_ack's sequence number is 5000000.
        let what = format!("{}: the backend's SYN-ACK", w.name);
        let seen = run(&mut unit, "unit_ct_syn_ack", &tcp_syn_ack(backend, client), &what).report;
        assert_eq!(seen.found, 1, "{what}: finds its flow");
        let o = entry(&mut unit, MAP_CT_UNCONFIRMED, &original).unwrap();
        assert_eq!(u32::from_be(o.handshake_ack), 5_000_001, "{what}: the ACK expected is its sequence number + 1");
        assert_eq!(o.flags & CT_PENDING, CT_PENDING, "{what}: a SYN-ACK does not confirm");

        for (what, frame, completes) in [
            ("an ACK of another number", tcp_ack(client, vip, 4_999_999), false),
            ("the SYN again", tcp_syn(client, vip), false),
            ("a RST", tcp_rst(client, vip), false),
            ("the ACK of the SYN-ACK", tcp_ack(client, vip, 5_000_001), true),
        ] {
            let what = format!("{}: {what}", w.name);
            let seen = run(&mut unit, "unit_ct_handshake", &frame, &what).report;
            assert_eq!(seen.completes_handshake == 1, completes, "{what}: completes the handshake");
        }

        let what = format!("{}: confirming on the handshake's ACK", w.name);
        run(&mut unit, "unit_ct_confirm", &tcp_ack(client, vip, 5_000_001), &what);
        for (name, k) in [("original", &original), ("reply", &reply)] {
            let left = entry(&mut unit, MAP_CT_UNCONFIRMED, k).is_none();
            assert!(left, "{what}: the {name} entry left the unconfirmed table");
        }
        let o = entry(&mut unit, MAP_CONNTRACK, &original).unwrap_or_else(|| panic!("{what}: original not confirmed"));
        let r = entry(&mut unit, MAP_CONNTRACK, &reply).unwrap_or_else(|| panic!("{what}: reply not confirmed"));
        assert_eq!((o.flags & CT_PENDING, r.flags & CT_PENDING), (0, 0), "{what}: neither entry is pending");
        assert_eq!((o.direction, r.direction), (CT_ORIGINAL, CT_REPLY), "{what}: directions kept");
        assert_eq!(o.nat_addr, addr(w.backend), "{what}: translation kept");
        let found = lookup(&mut unit, &tcp_data(client, vip, b"GET /"), &what);
        let confirmed = (found.found, found.entry.flags & CT_PENDING);
        assert_eq!(confirmed, (1, 0), "{what}: the client's data finds the confirmed flow");
    }
}

/// A UDP flow is confirmed by its first reply.
#[test]
#[ignore = "needs root (BPF)"]
fn conntrack_udp_reply_confirms_the_flow() {
    let mut unit = load("unit-ct-udp");
    for w in WORLDS {
        let (client, vip, backend) = w.ends();
        unit.setup(flow_setup(&w, IPPROTO_UDP)).unwrap();
        run(&mut unit, "unit_ct_create", &udp(client, vip, b"q"), w.name);
        let what = format!("{}: the backend's reply", w.name);
        let seen = run(&mut unit, "unit_ct_confirm", &udp(backend, client, b"a"), &what).report;
        assert_eq!(seen.found, 1, "{what}: finds its flow");
        for (name, k) in [("original", key(client, vip, IPPROTO_UDP)), ("reply", key(backend, client, IPPROTO_UDP))] {
            let e = entry(&mut unit, MAP_CONNTRACK, &k).unwrap_or_else(|| panic!("{what}: {name} entry not confirmed"));
            assert_eq!(e.flags & CT_PENDING, 0, "{what}: {name} entry no longer pending");
        }
        let unconfirmed = unit.hash::<CtKey, CtEntry>(MAP_CT_UNCONFIRMED).unwrap().keys().count();
        assert_eq!(unconfirmed, 0, "{what}: nothing left unconfirmed");
    }
}

/// An unanswered flow's entries count as gone once idle for
/// CT_UNCONFIRMED_TIMEOUT_NS; a confirmed flow's do not lapse by idling.
#[test]
#[ignore = "needs root (BPF)"]
fn conntrack_unanswered_flow_lapses() {
    stamp_zero_is_older_than(Duration::from_nanos(CT_UNCONFIRMED_TIMEOUT_NS));
    let mut unit = load("unit-ct-lapse");
    let (client, vip, backend) = V4.ends();
    let (original, reply) = (key(client, vip, IPPROTO_UDP), key(backend, client, IPPROTO_UDP));
    unit.setup(flow_setup(&V4, IPPROTO_UDP)).unwrap();
    run(&mut unit, "unit_ct_create", &udp(client, vip, b"q"), "opening");
    idle_since_boot(&mut unit, MAP_CT_UNCONFIRMED, &original);
    idle_since_boot(&mut unit, MAP_CT_UNCONFIRMED, &reply);
    let what = "an unanswered flow idle past CT_UNCONFIRMED_TIMEOUT_NS";
    assert_eq!(lookup(&mut unit, &udp(client, vip, b"q"), what).found, 0, "{what}: the client's datagram: no flow");
    assert_eq!(lookup(&mut unit, &udp(backend, client, b"a"), what).found, 0, "{what}: a late reply: no flow");

    // The same flow opened again and answered: confirmed, then idle as long.
    run(&mut unit, "unit_ct_create", &udp(client, vip, b"q"), "opening again");
    run(&mut unit, "unit_ct_confirm", &udp(backend, client, b"a"), "its reply");
    idle_since_boot(&mut unit, MAP_CONNTRACK, &original);
    let what = "a confirmed flow idle as long";
    assert_eq!(lookup(&mut unit, &udp(client, vip, b"q"), what).found, 1, "{what}: still found");
}

/// A FIN or RST marks its direction closing: a SYN then opens a new flow
/// instead of finding the old one (a SYN before it is a retransmission and
/// finds it), and once idle for CT_CLOSING_TIMEOUT_NS the entry is gone.
#[test]
#[ignore = "needs root (BPF)"]
fn conntrack_closing_flow_makes_way() {
    stamp_zero_is_older_than(Duration::from_nanos(CT_CLOSING_TIMEOUT_NS));
    let mut unit = load("unit-ct-close");
    for w in WORLDS {
        let (client, vip, backend) = w.ends();
        let original = key(client, vip, IPPROTO_TCP);
        unit.setup(flow_setup(&w, IPPROTO_TCP)).unwrap();
        run(&mut unit, "unit_ct_create", &tcp_syn(client, vip), w.name);
        run(&mut unit, "unit_ct_syn_ack", &tcp_syn_ack(backend, client), w.name);
        run(&mut unit, "unit_ct_confirm", &tcp_ack(client, vip, 5_000_001), w.name);

        let what = format!("{}: data on the open flow", w.name);
        let touched = run(&mut unit, "unit_ct_touch", &tcp_data(client, vip, b"x"), &what).report;
        assert_eq!(touched.found, 1, "{what}: touches its entry");
        assert_eq!(entry(&mut unit, MAP_CONNTRACK, &original).unwrap().flags & CT_CLOSING, 0, "{what}: not closing");
        assert_eq!(lookup(&mut unit, &tcp_syn(client, vip), &what).found, 1, "{what}: a SYN is a retransmission");

        let what = format!("{}: the client's FIN", w.name);
        run(&mut unit, "unit_ct_touch", &tcp_fin(client, vip), &what);
        let closing = entry(&mut unit, MAP_CONNTRACK, &original).unwrap().flags & CT_CLOSING;
        assert_eq!(closing, CT_CLOSING, "{what}: marks the original entry closing");
        let what = format!("{}: after the FIN", w.name);
        assert_eq!(lookup(&mut unit, &tcp_syn(client, vip), &what).found, 0, "{what}: a SYN opens a new flow");
        let last_ack = tcp_ack(client, vip, 2_000_001);
        assert_eq!(lookup(&mut unit, &last_ack, &what).found, 1, "{what}: the last ACK finds the flow");

        idle_since_boot(&mut unit, MAP_CONNTRACK, &original);
        let what = format!("{}: closed and idle past CT_CLOSING_TIMEOUT_NS", w.name);
        assert_eq!(lookup(&mut unit, &last_ack, &what).found, 0, "{what}: gone");
    }
}

// ---------------------------------------------------------------- nat

fn sctp_init(src: IpAddr, dst: IpAddr) -> Vec<u8> {
    sctp_frame((src, CLIENT_PORT), (dst, FRONTEND_PORT), 0, &[chunk::init(0x0102_0304)])
}

/// A frame of `proto` from `src` to `dst`, with a payload.
fn datagram(proto: u8, src: (IpAddr, u16), dst: (IpAddr, u16)) -> Vec<u8> {
    match proto {
        IPPROTO_TCP => tcp_data(src, dst, b"GET / HTTP/1.1\r\n\r\n"),
        IPPROTO_UDP => udp(src, dst, b"\x12\x34\x01\x00\x00\x01"),
        IPPROTO_SCTP => sctp_frame(src, dst, 0x0a0b_0c0d, &[chunk::data(7, b"hello")]),
        _ => unreachable!(),
    }
}

/// Runs `program` rewriting to `to` on `frame`: the result must equal `want`.
fn rewrite(unit: &mut Unit, program: &str, frame: &[u8], to: (IpAddr, u16), want: &[u8], what: &str) -> Vec<u8> {
    unit.setup(UnitSetup { backend: backend_entry(to.0, to.1, 0), ..Default::default() }).unwrap();
    let out = run(unit, program, frame, what);
    assert_eq!(out.verdict, TC_ACT_OK, "{what}: rewrite failed (error {})", out.report.rc);
    same_frame(what, &out.frame, want);
    out.frame
}

/// Destination and source rewrites, address and port, of TCP, UDP and SCTP
/// in both families: the frame out is the one built for the new tuple (IP
/// and L4 checksums right, recomputed from scratch), and rewriting back
/// gives the original frame byte for byte.
#[test]
#[ignore = "needs root (BPF)"]
fn nat_rewrites_keep_checksums_and_reverse_exactly() {
    let mut unit = load("unit-nat");
    for w in WORLDS {
        let (client, vip, backend) = w.ends();
        for proto in [IPPROTO_TCP, IPPROTO_UDP, IPPROTO_SCTP] {
            let what = format!("{} proto {proto}: DNAT client -> frontend to the backend", w.name);
            let original = datagram(proto, client, vip);
            let translated = datagram(proto, client, backend);
            let out = rewrite(&mut unit, "unit_nat_dst", &original, backend, &translated, &what);
            let what = format!("{} proto {proto}: DNAT reversed", w.name);
            rewrite(&mut unit, "unit_nat_dst", &out, vip, &original, &what);

            let what = format!("{} proto {proto}: SNAT backend -> client to the frontend", w.name);
            let reply = datagram(proto, backend, client);
            let out = rewrite(&mut unit, "unit_nat_src", &reply, vip, &datagram(proto, vip, client), &what);
            let what = format!("{} proto {proto}: SNAT reversed", w.name);
            rewrite(&mut unit, "unit_nat_src", &out, backend, &reply, &what);

            let what = format!("{} proto {proto}: port only", w.name);
            let to = (w.vip, BACKEND_PORT);
            rewrite(&mut unit, "unit_nat_dst", &original, to, &datagram(proto, client, to), &what);
            let what = format!("{} proto {proto}: address only", w.name);
            let to = (w.backend, FRONTEND_PORT);
            rewrite(&mut unit, "unit_nat_dst", &original, to, &datagram(proto, client, to), &what);
        }
    }
}

/// An IPv4 UDP datagram without a checksum (0) keeps none after a rewrite.
#[test]
#[ignore = "needs root (BPF)"]
fn nat_keeps_udp_without_checksum() {
    let mut unit = load("unit-nat-udp0");
    let no_checksum = |mut f: Vec<u8>| {
        f[ETH_HLEN + 20 + 6..ETH_HLEN + 20 + 8].fill(0);
        f
    };
    let (client, vip, backend) = V4.ends();
    let (input, want) = (no_checksum(udp(client, vip, b"q")), no_checksum(udp(client, backend, b"q")));
    rewrite(&mut unit, "unit_nat_dst", &input, backend, &want, "UDP without checksum, DNAT");
}

// ---------------------------------------------------------------- lb

/// `count` backends in the service's slots 0..count (IDs 11, 12, ...), and
/// a stale slot past them (a backend the set no longer counts).
fn backend_set(unit: &mut Unit, w: &World, count: u32) -> BTreeMap<u32, Backend> {
    let mut all = BTreeMap::new();
    let mut slots = unit.hash::<SlotKey, u32>(MAP_BACKEND_SLOTS).unwrap();
    for slot in 0..=count {
        slots.insert(&SlotKey { service_id: SERVICE_ID, slot }, &(11 + slot), 0).unwrap();
    }
    let mut backends = unit.hash::<u32, Backend>(MAP_BACKENDS).unwrap();
    for slot in 0..=count {
        let ip = match w.backend {
            IpAddr::V4(v4) => IpAddr::V4(Ipv4Addr::from(u32::from(v4) + slot)),
            IpAddr::V6(v6) => IpAddr::V6(Ipv6Addr::from(u128::from(v6) + slot as u128)),
        };
        let b = backend_entry(ip, BACKEND_PORT, IPPROTO_TCP);
        backends.insert(&(11 + slot), &b, 0).unwrap();
        if slot < count {
            all.insert(11 + slot, b);
        }
    }
    all
}

/// A backend choice for `service`, remembered for affinity or not (a trace's).
fn choosing(service: ServiceEntry, remember: bool) -> UnitSetup {
    UnitSetup { service, remember: remember as u8, ..Default::default() }
}

fn affinities(unit: &mut Unit) -> usize {
    unit.hash::<AffinityKey, AffinityEntry>(MAP_AFFINITY).unwrap().keys().count()
}

fn choose(unit: &mut Unit, w: &World, client: IpAddr, what: &str) -> Run {
    run(unit, "unit_lb_choose", &tcp_syn((client, CLIENT_PORT), (w.vip, FRONTEND_PORT)), what)
}

/// The backend is drawn at random among the service's `backend_count`
/// slots, never from a slot past them, and is the one BACKENDS holds.
#[test]
#[ignore = "needs root (BPF)"]
fn lb_draws_backends_at_random_within_the_set() {
    let mut unit = load("unit-lb-random");
    for w in WORLDS {
        let set = backend_set(&mut unit, &w, 3);
        unit.setup(choosing(service_entry(3, 0), true)).unwrap();
        let mut drawn: BTreeMap<u32, u32> = BTreeMap::new();
        const DRAWS: u32 = 300;
        for i in 0..DRAWS {
            let what = format!("{} draw {i}", w.name);
            let r = choose(&mut unit, &w, w.client, &what).report;
            assert_eq!(r.found, 1, "{what}: a backend is chosen");
            let Some(b) = set.get(&r.backend_id) else {
                panic!("{what}: backend {} is not in the service's {} slots", r.backend_id, set.len())
            };
            assert_eq!(r.backend, *b, "{what}: the backend is BACKENDS' entry for its ID");
            assert_eq!(r.sticky, 0, "{what}: no affinity");
            *drawn.entry(r.backend_id).or_default() += 1;
        }
        // Each of 3 expects 100 of 300 draws; under 50 is 6 standard deviations out.
        for id in set.keys() {
            let n = drawn.get(id).copied().unwrap_or(0);
            assert!(n >= 50, "{}: backend {id} drawn {n} times of {DRAWS} ({drawn:?}): not uniform", w.name);
        }
        assert_eq!(affinities(&mut unit), 0, "{}: no affinity remembered for a service without it", w.name);
    }
}

/// No backend: an empty set, or a slot whose backend is gone.
#[test]
#[ignore = "needs root (BPF)"]
fn lb_empty_set_has_no_backend() {
    let mut unit = load("unit-lb-empty");
    for w in WORLDS {
        backend_set(&mut unit, &w, 1);
        unit.setup(choosing(service_entry(0, 0), true)).unwrap();
        let what = format!("{}: backend_count 0", w.name);
        assert_eq!(choose(&mut unit, &w, w.client, &what).report.found, 0, "{what}: no backend");
        unit.hash::<u32, Backend>(MAP_BACKENDS).unwrap().remove(&11).unwrap();
        unit.setup(choosing(service_entry(1, 0), true)).unwrap();
        let what = format!("{}: the one slot's backend removed", w.name);
        assert_eq!(choose(&mut unit, &w, w.client, &what).report.found, 0, "{what}: no backend");
    }
}

/// Session affinity: a client's first backend is remembered and chosen
/// again while fresh (a trace remembers nothing); another client draws its
/// own; a stale entry, or one whose backend is gone, is drawn afresh.
#[test]
#[ignore = "needs root (BPF)"]
fn lb_affinity_keeps_a_client_on_its_backend() {
    stamp_zero_is_older_than(Duration::from_secs(2));
    let mut unit = load("unit-lb-affinity");
    for w in WORLDS {
        let set = backend_set(&mut unit, &w, 3);
        let affinity_key = |client| AffinityKey { service_id: SERVICE_ID, client: addr(client) };
        let stuck_to = |unit: &mut Unit, client| {
            let affinity = unit.hash::<AffinityKey, AffinityEntry>(MAP_AFFINITY).unwrap();
            affinity.get(&affinity_key(client), 0).ok().map(|e| e.backend_id)
        };
        let stick = |unit: &mut Unit, client, entry: AffinityEntry| {
            let mut affinity = unit.hash::<AffinityKey, AffinityEntry>(MAP_AFFINITY).unwrap();
            affinity.insert(&affinity_key(client), &entry, 0).unwrap();
        };

        unit.setup(choosing(service_entry(3, 10_800), false)).unwrap();
        let what = format!("{}: a trace's choice", w.name);
        assert_eq!(choose(&mut unit, &w, w.client, &what).report.found, 1, "{what}: a backend");
        assert_eq!(affinities(&mut unit), 0, "{what}: remembers nothing");

        unit.setup(choosing(service_entry(3, 10_800), true)).unwrap();
        let what = format!("{}: first choice", w.name);
        let first = choose(&mut unit, &w, w.client, &what).report;
        assert_eq!((first.found, first.sticky), (1, 0), "{what}: drawn, not sticky");
        assert_eq!(stuck_to(&mut unit, w.client), Some(first.backend_id), "{what}: remembered for the client");
        for i in 0..30 {
            let what = format!("{}: choice {i} after the first", w.name);
            let again = choose(&mut unit, &w, w.client, &what).report;
            assert_eq!((again.backend_id, again.sticky), (first.backend_id, 1), "{what}: the same backend (affinity)");
        }
        let what = format!("{}: another client", w.name);
        let other = choose(&mut unit, &w, w.client_2, &what).report;
        assert_eq!(other.sticky, 0, "{what}: draws its own");
        assert_eq!(stuck_to(&mut unit, w.client_2), Some(other.backend_id), "{what}: remembered too");

        // Stale: the timeout is 1 s and the entry was stamped at boot.
        unit.setup(choosing(service_entry(3, 1), true)).unwrap();
        stick(&mut unit, w.client, AffinityEntry { backend_id: first.backend_id, _pad: 0, last_seen_ns: 0 });
        let what = format!("{}: a stale affinity", w.name);
        let fresh = choose(&mut unit, &w, w.client, &what).report;
        assert_eq!((fresh.found, fresh.sticky), (1, 0), "{what}: drawn afresh");

        unit.setup(choosing(service_entry(3, 10_800), true)).unwrap();
        stick(&mut unit, w.client, AffinityEntry { backend_id: 99, _pad: 0, last_seen_ns: u64::MAX });
        let what = format!("{}: an affinity to a backend that is gone", w.name);
        let fresh = choose(&mut unit, &w, w.client, &what).report;
        assert_eq!(fresh.sticky, 0, "{what}: drawn afresh");
        assert!(set.contains_key(&fresh.backend_id), "{what}: from the set");
        let mut affinity = unit.hash::<AffinityKey, AffinityEntry>(MAP_AFFINITY).unwrap();
        for client in [w.client, w.client_2] {
            affinity.remove(&affinity_key(client)).unwrap();
        }
    }
}

/// Maglev: the backend is `table[flow_hash % M]` of the service's table,
/// with the seed and M the object was loaded with (not the defaults); the
/// report names that cell. With ClientIP affinity the source port leaves
/// the hash: a client's connections from any port share one cell. A
/// service without its table gets no backend.
#[test]
#[ignore = "needs root (BPF)"]
fn lb_maglev_picks_the_cell_of_the_flows_hash() {
    const SEED: u32 = 0x5eed_1234;
    const M: u32 = 251;
    const FIRST_ID: u32 = 100;
    let mut unit = Unit::load_with_maglev("unit-lb-maglev", SEED, M).expect("loading the unit object");
    for w in WORLDS {
        // One backend per cell, so the ID names the cell it came from.
        let mut backends = unit.hash::<u32, Backend>(MAP_BACKENDS).unwrap();
        let mut by_id = BTreeMap::new();
        for cell in 0..M {
            let ip = match w.backend {
                IpAddr::V4(v4) => IpAddr::V4(Ipv4Addr::from(u32::from(v4) + cell)),
                IpAddr::V6(v6) => IpAddr::V6(Ipv6Addr::from(u128::from(v6) + u128::from(cell))),
            };
            let b = backend_entry(ip, BACKEND_PORT, IPPROTO_TCP);
            backends.insert(&(FIRST_ID + cell), &b, 0).unwrap();
            by_id.insert(FIRST_ID + cell, b);
        }
        let mut table = Box::new(MaglevTable { cells: [0; MAGLEV_TABLE_MAX as usize] });
        for (i, cell) in table.cells.iter_mut().enumerate() {
            // Past M: IDs no backend has, which a wrong modulus would read.
            *cell = if (i as u32) < M { FIRST_ID + i as u32 } else { 9_999 };
        }
        unit.hash::<u32, MaglevTable>(MAP_MAGLEV).unwrap().insert(&SERVICE_ID, &*table, 0).unwrap();
        let maglev = |affinity_timeout_s| ServiceEntry { flags: SVC_MAGLEV, ..service_entry(M, affinity_timeout_s) };

        unit.setup(choosing(maglev(0), true)).unwrap();
        let mut cells = std::collections::BTreeSet::new();
        for i in 0..64u16 {
            let client = if i % 2 == 0 { w.client } else { w.client_2 };
            let sport = 30_000 + i * 7;
            let flow = key((client, sport), (w.vip, FRONTEND_PORT), IPPROTO_TCP);
            let want = maglev::flow_hash(&flow, flow.sport, SEED) % M;
            let what = format!("{} {client}:{sport}", w.name);
            let r = run(&mut unit, "unit_lb_choose", &tcp_syn((client, sport), (w.vip, FRONTEND_PORT)), &what).report;
            assert_eq!((r.found, r.sticky), (1, 0), "{what}: a backend, from the table");
            assert_eq!(r.maglev_cell, want, "{what}: the cell is flow_hash % M");
            assert_eq!(r.backend_id, FIRST_ID + want, "{what}: the backend is table[cell]");
            assert_eq!(r.backend, by_id[&r.backend_id], "{what}: BACKENDS' entry for that ID");
            cells.insert(want);
        }
        assert!(cells.len() > 40, "{}: 64 flows hashed to only {} cells", w.name, cells.len());

        // Affinity: the source port leaves the hash (a trace's choice, so
        // no AFFINITY entry answers first).
        unit.setup(choosing(maglev(10_800), false)).unwrap();
        let flow = key((w.client, 0), (w.vip, FRONTEND_PORT), IPPROTO_TCP);
        let want = maglev::flow_hash(&flow, 0, SEED) % M;
        for sport in [1_024u16, 40_000, 50_001, 65_535] {
            let what = format!("{} {}:{sport} with affinity", w.name, w.client);
            let r = run(&mut unit, "unit_lb_choose", &tcp_syn((w.client, sport), (w.vip, FRONTEND_PORT)), &what).report;
            assert_eq!((r.maglev_cell, r.backend_id), (want, FIRST_ID + want), "{what}: the port does not count");
        }
        assert_eq!(affinities(&mut unit), 0);

        // No table: no backend (the agent writes it before the frontend).
        unit.hash::<u32, MaglevTable>(MAP_MAGLEV).unwrap().remove(&SERVICE_ID).unwrap();
        unit.setup(choosing(maglev(0), true)).unwrap();
        let what = format!("{}: no table", w.name);
        assert_eq!(choose(&mut unit, &w, w.client, &what).report.found, 0, "{what}: no backend");
    }
}

/// The frontend lookup: a served port finds its service in the client's
/// scope (in-cluster by the cluster CIDRs, or external); an unserved port
/// of a ClusterIP is a reject, an unallocated address of the service CIDR
/// a drop, anything else not ours.
#[test]
#[ignore = "needs root (BPF)"]
fn lb_frontend_lookup_by_scope_and_misses() {
    let mut unit = load("unit-lb-frontend");
    for w in WORLDS {
        let internal = ServiceEntry { service_id: 1, backend_count: 2, ..Default::default() };
        let external = ServiceEntry { service_id: 2, backend_count: 1, flags: SVC_MASQUERADE, ..Default::default() };
        let mut frontends = unit.hash::<FrontendKey, ServiceEntry>(MAP_FRONTENDS).unwrap();
        let fk = |scope| FrontendKey { addr: addr(w.vip), port: FRONTEND_PORT.to_be(), proto: IPPROTO_TCP, scope };
        frontends.insert(&fk(SCOPE_INTERNAL), &internal, 0).unwrap();
        frontends.insert(&fk(SCOPE_EXTERNAL), &external, 0).unwrap();
        frontends.insert(&cluster_ip_marker(addr(w.vip)), &ServiceEntry::default(), 0).unwrap();
        for (map, (len, net)) in [(MAP_CLUSTER_CIDRS, w.cluster_cidr), (MAP_SERVICE_CIDRS, w.service_cidr)] {
            let mut cidrs = unit.lpm::<CidrData, u8>(map).unwrap();
            cidrs.insert(&Key::new(len, CidrData { addr: addr(net) }), &1, 0).unwrap();
        }

        let outside = match w.client {
            IpAddr::V4(_) => IpAddr::V4(EXTERNAL),
            IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 2)),
        };
        let syn = |src: IpAddr, dst: IpAddr, port: u16| tcp_syn((src, CLIENT_PORT), (dst, port));
        let (client, vip, _) = w.ends();
        let by_source = UNIT_SCOPE_OF_SOURCE;
        for (what, frame, scope, want) in [
            ("an in-cluster client", syn(w.client, w.vip, FRONTEND_PORT), by_source, Ok(internal)),
            ("an external client", syn(outside, w.vip, FRONTEND_PORT), by_source, Ok(external)),
            ("the external scope asked", syn(w.client, w.vip, FRONTEND_PORT), SCOPE_EXTERNAL, Ok(external)),
            ("a port the ClusterIP does not serve", syn(w.client, w.vip, 81), by_source, Err(UNIT_MISS_REJECT)),
            ("UDP to the TCP port", udp(client, vip, b"q"), SCOPE_INTERNAL, Err(UNIT_MISS_REJECT)),
            (
                "an unallocated service address",
                syn(w.client, w.unallocated, FRONTEND_PORT),
                SCOPE_INTERNAL,
                Err(UNIT_MISS_DROP_UNALLOCATED),
            ),
            ("a pod's address", syn(w.client, w.backend_2, FRONTEND_PORT), SCOPE_INTERNAL, Err(UNIT_MISS_NOT_OURS)),
        ] {
            let what = format!("{}: {what}", w.name);
            unit.setup(UnitSetup { scope, ..Default::default() }).unwrap();
            let r = run(&mut unit, "unit_lb_frontend", &frame, &what).report;
            match want {
                Ok(service) => {
                    assert_eq!((r.found, r.miss), (1, UNIT_MISS_NONE), "{what}: finds a frontend");
                    assert_eq!(r.service, service, "{what}: the service of its scope");
                }
                Err(miss) => {
                    assert_eq!((r.found, r.miss), (0, miss), "{what}: the miss (1 not ours, 2 reject, 3 drop)")
                }
            }
        }
    }
}

// ---------------------------------------------------------------- reject

/// Checks the reply's Ethernet and IP headers are the packet's, reversed.
fn addressed_back(what: &str, input: &[u8], out: &[u8]) {
    let macs = (&out[0..6], &out[6..12]);
    assert_eq!(macs, (&MAC_SRC[..], &MAC_DST[..]), "{what}: MACs swapped back to the sender");
    let (i, o) = (SlicedPacket::from_ethernet(input).unwrap(), SlicedPacket::from_ethernet(out).unwrap());
    let ends = |p: &SlicedPacket| -> (IpAddr, IpAddr) {
        match &p.net {
            Some(NetSlice::Ipv4(ip)) => (ip.header().source_addr().into(), ip.header().destination_addr().into()),
            Some(NetSlice::Ipv6(ip)) => (ip.header().source_addr().into(), ip.header().destination_addr().into()),
            _ => panic!("{what}: not IP"),
        }
    };
    let ((src, dst), (reply_src, reply_dst)) = (ends(&i), ends(&o));
    assert_eq!((reply_src, reply_dst), (dst, src), "{what}: from the address dialled back to the sender");
}

/// A TCP segment to nowhere draws a RST, a UDP datagram an ICMP (ICMPv6)
/// port unreachable, in both families: the frame `frames::reject_of`
/// builds (an independent reference), checksums right, addressed back.
#[test]
#[ignore = "needs root (BPF)"]
fn reject_builds_a_reply_to_the_sender() {
    let mut unit = load("unit-reject");
    for w in WORLDS {
        let (client, vip, _) = w.ends();
        for (what, input) in [
            ("TCP SYN", tcp_syn(client, vip)),
            ("TCP data", tcp_data(client, vip, b"GET /")),
            ("UDP datagram", udp(client, vip, b"0123456789abcdef")),
            ("SCTP INIT", sctp_init(w.client, w.vip)),
        ] {
            let what = format!("{}: {what}", w.name);
            let out = run(&mut unit, "unit_reject", &input, &what);
            assert_eq!(out.verdict, TC_ACT_OK, "{what}: the reply was built (error {})", out.report.rc);
            same_frame(&what, &out.frame, &frames::reject_of(&input));
            addressed_back(&what, &input, &out.frame);
            let h = PacketHeaders::from_ethernet_slice(&out.frame).unwrap();
            match h.transport {
                Some(TransportHeader::Tcp(t)) => {
                    assert!(input_is_tcp(&input), "{what}: a RST only for TCP");
                    assert!(t.rst, "{what}: RST set");
                    let ports = (t.source_port, t.destination_port);
                    assert_eq!(ports, (FRONTEND_PORT, CLIENT_PORT), "{what}: ports swapped");
                }
                Some(TransportHeader::Icmpv4(i)) => {
                    let unreachable = Icmpv4Type::DestinationUnreachable(icmpv4::DestUnreachableHeader::Port);
                    assert_eq!(i.icmp_type, unreachable, "{what}: port unreachable");
                }
                Some(TransportHeader::Icmpv6(i)) => {
                    let unreachable = Icmpv6Type::DestinationUnreachable(icmpv6::DestUnreachableCode::Port);
                    assert_eq!(i.icmp_type, unreachable, "{what}: port unreachable");
                }
                _ => panic!("{what}: neither a RST nor an ICMP error"),
            }
        }
    }
}

fn input_is_tcp(frame: &[u8]) -> bool {
    matches!(SlicedPacket::from_ethernet(frame).map(|p| p.transport), Ok(Some(TransportSlice::Tcp(_))))
}

/// A packet with IPv4 options is refused (fixed sizes keep the verifier
/// simple): the datapath drops it rather than answer.
#[test]
#[ignore = "needs root (BPF)"]
fn reject_refuses_ipv4_options() {
    let mut unit = load("unit-reject-opts");
    let (client, vip, _) = V4.ends();
    let mut input = tcp_syn(client, vip);
    insert_ipv4_options(&mut input, &[1, 1, 1, 0]);
    let out = run(&mut unit, "unit_reject", &input, "SYN with IPv4 options");
    assert_eq!(out.verdict, TC_ACT_SHOT, "SYN with IPv4 options: no reply built");
    assert_ne!(out.report.rc, 0, "SYN with IPv4 options: reject returns an error");
}
