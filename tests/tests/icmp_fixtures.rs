//! ICMP errors about translated flows, as packet fixtures (see fixtures.rs):
//! the real `tc_ingress` and `tc_egress` hand ICMP packets to
//! `tc_icmp_error_in(6)` and `tc_icmp_error_out(6)`. For each family, and
//! for a port unreachable, a fragmentation needed (IPv6: packet too big) and
//! a time exceeded: an error about a flow to a ClusterIP gets the frontend
//! back in its quote at egress (and as its source when the backend sent it),
//! an error about a masqueraded flow is sent back to the client at ingress
//! first; errors about no flow, echo requests and cut quotes are left
//! alone, and an echo request or a GRE packet to an unallocated service
//! address is dropped (an ARP frame whose bytes read like one is not).
//! Every checksum of each output (outer, ICMP, the quote's IP and
//! TCP/UDP) is recomputed by etherparse, never taken from the program.
//!
//! Run with `-- --nocapture` to see the tables. Needs root (BPF).

#![feature(custom_test_frameworks)]
#![test_runner(proxy_tests::harness::run)]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use proxy_common::*;
use proxy_tests::{
    addrs::{BACKEND, BACKEND6, CLIENT, CLIENT6, EXTERNAL, NODE_IP, UNALLOCATED, VIP, VIP6, addr},
    fixture::{Case, Expect, Fixture, TC_ACT_OK, TC_ACT_SHOT, TC_ACT_UNSPEC, run_table},
    frames::{Endpoint, IcmpError, icmp_echo, icmp_error, ip_of, ip_packet, tcp_syn, udp},
};
use proxy_user::maps::{MapWriter, Maps};

/// One family's addresses.
struct Net {
    client: IpAddr,
    backend: IpAddr,
    vip: IpAddr,
    /// A router between the node and the backend.
    router: IpAddr,
    /// The node's address, which masqueraded flows leave with.
    node: IpAddr,
    /// A client outside the cluster, masqueraded.
    external: IpAddr,
    /// In the service CIDR, no Service's.
    unallocated: IpAddr,
    service_cidr: &'static str,
    /// Service and backend IDs: TCP, then UDP.
    ids: [u32; 2],
}

const V4: Net = Net {
    client: IpAddr::V4(CLIENT),
    backend: IpAddr::V4(BACKEND),
    vip: IpAddr::V4(VIP),
    router: IpAddr::V4(Ipv4Addr::new(192, 168, 5, 1)),
    node: IpAddr::V4(NODE_IP),
    external: IpAddr::V4(EXTERNAL),
    unallocated: IpAddr::V4(UNALLOCATED),
    service_cidr: "10.96.0.0/16",
    ids: [1, 2],
};

const V6: Net = Net {
    client: IpAddr::V6(CLIENT6),
    backend: IpAddr::V6(BACKEND6),
    vip: IpAddr::V6(VIP6),
    router: IpAddr::V6(Ipv6Addr::new(0xfd00, 5, 0, 0, 0, 0, 0, 1)),
    node: IpAddr::V6(Ipv6Addr::new(0xfd00, 0x168, 0, 0, 0, 0, 0, 2)),
    external: IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 2)),
    unallocated: IpAddr::V6(Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x99)),
    service_cidr: "fd00:96::/64",
    ids: [3, 4],
};

const HTTP: u16 = 80;
/// An IP protocol the datapath does not translate.
const GRE: u8 = 47;
const HTTP_TARGET: u16 = 8080;
const DNS: u16 = 53;
const DNS_TARGET: u16 = 5353;
/// Masqueraded flows' source ports, as the conntrack state installed below holds them.
const SNAT_TCP_PORT: u16 = 61000;
const SNAT_UDP_PORT: u16 = 61001;
const QUERY: &[u8] = b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x03web\x00\x00\x01\x00\x01";

fn quote_udp(src: Endpoint, dst: Endpoint) -> Vec<u8> {
    ip_of(&udp(src, dst, QUERY))
}

fn quote_syn(src: Endpoint, dst: Endpoint) -> Vec<u8> {
    ip_of(&tcp_syn(src, dst))
}

fn translated_at_egress(what: &str, input: Vec<u8>, want: Vec<u8>) -> Case {
    Case::new(what, input, TC_ACT_OK, Expect::Translated(want), &[Counter::IcmpErrorTranslated]).at_egress(0)
}

fn cases(n: &Net, family: &str) -> Vec<Case> {
    let client_dns = (n.client, 40001);
    let client_http = (n.client, 40000);
    let (vip_dns, vip_http) = ((n.vip, DNS), (n.vip, HTTP));
    let (backend_dns, backend_http) = ((n.backend, DNS_TARGET), (n.backend, HTTP_TARGET));
    let too_big = IcmpError::TooBig(if family == "IPv4" { 1400 } else { 1280 });
    // The quoted packet as it left the node, and as the client sent it.
    let sent_dns = quote_udp(client_dns, backend_dns);
    let dialled_dns = quote_udp(client_dns, vip_dns);
    let sent_syn = quote_syn(client_http, backend_http);
    let dialled_syn = quote_syn(client_http, vip_http);
    let external_dns = (n.external, 40001);
    let external_http = (n.external, 40000);
    vec![
        Case::translated(
            &format!("{family}: UDP to the ClusterIP's port 53 goes to the backend (the flow the errors are about)"),
            udp(client_dns, vip_dns, QUERY),
            udp(client_dns, backend_dns, QUERY),
            Counter::NewFlow,
        ),
        Case::untouched(
            &format!("{family}: port unreachable from the backend, at ingress: not masqueraded, nothing to do there"),
            icmp_error(n.backend, n.client, IcmpError::PortUnreachable, &sent_dns),
            Counter::Passed,
        ),
        translated_at_egress(
            &format!("{family}: port unreachable from the backend, at egress: from the ClusterIP, quoting the datagram to it"),
            icmp_error(n.backend, n.client, IcmpError::PortUnreachable, &sent_dns),
            icmp_error(n.vip, n.client, IcmpError::PortUnreachable, &dialled_dns),
        ),
        Case::translated(
            &format!("{family}: TCP SYN to the ClusterIP's port 80 goes to the backend"),
            tcp_syn(client_http, vip_http),
            tcp_syn(client_http, backend_http),
            Counter::NewFlow,
        ),
        translated_at_egress(
            &format!("{family}: too big for a router's MTU, at egress: the router stays the source, the quote names the ClusterIP"),
            icmp_error(n.router, n.client, too_big, &sent_syn),
            icmp_error(n.router, n.client, too_big, &dialled_syn),
        ),
        translated_at_egress(
            &format!("{family}: time exceeded from a router, at egress"),
            icmp_error(n.router, n.client, IcmpError::TimeExceeded, &sent_syn),
            icmp_error(n.router, n.client, IcmpError::TimeExceeded, &dialled_syn),
        ),
        Case::new(
            &format!("{family}: an error about no flow, at egress: left alone"),
            icmp_error(n.router, n.client, IcmpError::TimeExceeded, &quote_syn((n.client, 40999), backend_http)),
            TC_ACT_UNSPEC,
            Expect::Unchanged,
            &[],
        )
        .at_egress(0),
        Case::untouched(
            &format!("{family}: an echo request to the ClusterIP: not translated"),
            icmp_echo(n.client, n.vip),
            Counter::Passed,
        ),
        Case::new(
            &format!("{family}: an echo request to an unallocated address of the service CIDR: dropped"),
            icmp_echo(n.client, n.unallocated),
            TC_ACT_SHOT,
            Expect::Unchanged,
            &[Counter::DropUnallocated],
        ),
        Case::untouched(
            &format!("{family}: GRE to the ClusterIP: not translated"),
            ip_packet(n.client, n.vip, GRE, b"tunnel"),
            Counter::Passed,
        ),
        Case::new(
            &format!("{family}: GRE to an unallocated address of the service CIDR: dropped, as any protocol is"),
            ip_packet(n.client, n.unallocated, GRE, b"tunnel"),
            TC_ACT_SHOT,
            Expect::Unchanged,
            &[Counter::DropUnallocated],
        ),
        Case::new(
            &format!("{family}: an error whose quote stops inside the ports: left alone"),
            icmp_error(n.backend, n.client, IcmpError::PortUnreachable, &sent_dns[..sent_dns.len() - QUERY.len() - 6]),
            TC_ACT_UNSPEC,
            Expect::Unchanged,
            &[],
        )
        .at_egress(0),
        // A masqueraded flow (its conntrack state is installed by `masquerade`).
        Case::translated(
            &format!("{family}: too big about a masqueraded flow, at ingress: back to the client, quoting its own port"),
            icmp_error(n.router, n.node, too_big, &quote_syn((n.node, SNAT_TCP_PORT), backend_http)),
            icmp_error(n.router, n.external, too_big, &quote_syn(external_http, backend_http)),
            Counter::IcmpErrorTranslated,
        ),
        translated_at_egress(
            &format!("{family}: ... and at egress, the quote names the frontend"),
            icmp_error(n.router, n.external, too_big, &quote_syn(external_http, backend_http)),
            icmp_error(n.router, n.external, too_big, &quote_syn(external_http, vip_http)),
        ),
        Case::translated(
            &format!("{family}: port unreachable from the backend about a masqueraded datagram, at ingress"),
            icmp_error(n.backend, n.node, IcmpError::PortUnreachable, &quote_udp((n.node, SNAT_UDP_PORT), backend_dns)),
            icmp_error(n.backend, n.external, IcmpError::PortUnreachable, &quote_udp(external_dns, backend_dns)),
            Counter::IcmpErrorTranslated,
        ),
        translated_at_egress(
            &format!("{family}: ... and at egress, from the frontend"),
            icmp_error(n.backend, n.external, IcmpError::PortUnreachable, &quote_udp(external_dns, backend_dns)),
            icmp_error(n.vip, n.external, IcmpError::PortUnreachable, &quote_udp(external_dns, vip_dns)),
        ),
    ]
}

/// An ARP request whose bytes, read as an IPv4 header, say ICMP (the
/// sender's MAC has 0x01 where the protocol would be) to the unallocated
/// service address (the sender's address and the target MAC's first bytes
/// where the destination would be): ARP, and passed as it is.
fn arp_reading_as_icmp() -> Vec<u8> {
    let Net { unallocated: IpAddr::V4(to), .. } = V4 else { unreachable!() };
    let [a, b, c, d] = to.octets();
    let mut f = vec![0xff; 6];
    f.extend_from_slice(&[0x02, 0x01, 0, 0, 0, 1, 0x08, 0x06]);
    // htype 1, ptype IPv4, hlen 6, plen 4, request
    f.extend_from_slice(&[0, 1, 0x08, 0x00, 6, 4, 0, 1]);
    f.extend_from_slice(&[0x02, 0x01, 0, 0, 0, 1]);
    f.extend_from_slice(&[192, 168, a, b]);
    f.extend_from_slice(&[c, d, 0, 0, 0, 0]);
    f.extend_from_slice(&[192, 168, 0, 1]);
    f
}

/// HTTP (80 -> 8080/TCP) and DNS (53 -> 5353/UDP) on the family's ClusterIP,
/// one backend each.
fn services(m: &mut Maps, n: &Net) -> anyhow::Result<()> {
    for (id, port, target, proto, name) in
        [(n.ids[0], HTTP, HTTP_TARGET, IPPROTO_TCP, "default/web:http"), (n.ids[1], DNS, DNS_TARGET, IPPROTO_UDP, "default/web:dns")]
    {
        let backend = Backend { addr: addr(n.backend), port: target.to_be(), proto, flags: BACKEND_READY | BACKEND_SERVING };
        m.put_backend(id, &backend)?;
        m.put_slot(&SlotKey { service_id: id, slot: 0 }, id)?;
        let entry = ServiceEntry { service_id: id, backend_count: 1, kind: KIND_CLUSTER_IP, ..Default::default() };
        for scope in [SCOPE_INTERNAL, SCOPE_EXTERNAL] {
            m.put_frontend(&FrontendKey { addr: addr(n.vip), port: port.to_be(), proto, scope }, &entry)?;
        }
        m.put_name(id, &ServiceName::new(name, SCOPE_INTERNAL))?;
    }
    m.put_frontend(&cluster_ip_marker(addr(n.vip)), &ServiceEntry { kind: KIND_CLUSTER_IP, ..Default::default() })?;
    m.put_service_cidr(&n.service_cidr.parse()?)?;
    Ok(())
}

/// The conntrack state of two masqueraded flows from the external client,
/// as the datapath leaves it once they are confirmed: the reply entries of
/// the masquerade port (back to the client) and the plain ones (back to the
/// frontend).
fn masquerade(m: &mut Maps, n: &Net) -> anyhow::Result<()> {
    for (proto, client_port, snat_port, frontend_port, target, id) in [
        (IPPROTO_TCP, 40000u16, SNAT_TCP_PORT, HTTP, HTTP_TARGET, n.ids[0]),
        (IPPROTO_UDP, 40001, SNAT_UDP_PORT, DNS, DNS_TARGET, n.ids[1]),
    ] {
        let key = |dst: IpAddr, dport: u16| CtKey {
            src: addr(n.backend),
            dst: addr(dst),
            sport: target.to_be(),
            dport: dport.to_be(),
            proto,
            _pad: [0; 3],
        };
        let plain = CtEntry {
            nat_addr: addr(n.vip),
            nat_port: frontend_port.to_be(),
            direction: CT_REPLY,
            service_id: id,
            backend_id: id,
            ..Default::default()
        };
        m.conntrack.insert(&key(n.external, client_port), &plain, 0)?;
        let snat = CtEntry { rev_addr: addr(n.external), rev_port: client_port.to_be(), flags: CT_MASQUERADE, ..plain };
        m.conntrack.insert(&key(n.node, snat_port), &snat, 0)?;
    }
    Ok(())
}

#[test]
#[ignore = "needs root (BPF)"]
fn icmp_error_fixtures() {
    let fx = Fixture::new("icmp", |m| {
        for n in [&V4, &V6] {
            services(m, n)?;
            masquerade(m, n)?;
        }
        Ok(())
    })
    .unwrap();
    let mut all = cases(&V4, "IPv4");
    all.push(Case::untouched("an ARP request whose bytes read as ICMP to an unallocated address: passed", arp_reading_as_icmp(), Counter::Passed));
    all.extend(cases(&V6, "IPv6"));
    run_table(&fx, "ICMP error", all);
}
