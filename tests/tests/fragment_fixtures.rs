//! IP fragments, as packet fixtures (see fixtures.rs): the real `tc_ingress`
//! and `tc_egress` hand fragments to `tc_ingress_fragment(6)` and
//! `tc_egress_fragment(6)`. For each family: a 4000-byte UDP datagram to a
//! ClusterIP, cut into three fragments, leaves as the same three fragments
//! of the datagram to the backend (the first with the new port and UDP
//! checksum, the later ones with the new address only); the backend's
//! fragmented reply gets the frontend back at egress; a later fragment
//! whose first was not seen and a TCP fragment are left alone, and the
//! first fragment of a datagram to a Service without endpoints (which
//! would be REJECTed) is dropped (its later ones find no flow and are left
//! alone).
//!
//! The expected fragments are cut from a datagram etherparse built whole,
//! so the UDP checksum the program updated in the first fragment is
//! checked against one computed over the whole translated datagram.
//!
//! Run with `-- --nocapture` to see the tables. Needs root (BPF).

#![feature(custom_test_frameworks)]
#![test_runner(proxy_tests::harness::run)]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use proxy_common::*;
use proxy_tests::{
    addrs::{CLIENT, CLIENT6, VIP, VIP6, addr},
    fixture::{Case, Expect, Fixture, TC_ACT_OK, TC_ACT_SHOT, TC_ACT_UNSPEC, run_table},
    frames::{Endpoint, fragments, set_ipv4_checksum, udp},
};
use proxy_user::maps::{MapWriter, Maps};

struct Net {
    client: IpAddr,
    backend: IpAddr,
    vip: IpAddr,
    /// Service IDs: the served one, the one without endpoints.
    ids: [u32; 2],
}

/// The backend on another node's pod CIDR.
const V4: Net = Net {
    client: IpAddr::V4(CLIENT),
    backend: IpAddr::V4(Ipv4Addr::new(10, 244, 1, 11)),
    vip: IpAddr::V4(VIP),
    ids: [1, 2],
};

const V6: Net = Net {
    client: IpAddr::V6(CLIENT6),
    backend: IpAddr::V6(Ipv6Addr::new(0xfd00, 0x244, 0, 1, 0, 0, 0, 0x11)),
    vip: IpAddr::V6(VIP6),
    ids: [3, 4],
};

const DNS: u16 = 53;
const DNS_TARGET: u16 = 5353;
/// A UDP port of the ClusterIP whose Service has no endpoints.
const EMPTY: u16 = 54;
const CLIENT_PORT: u16 = 40001;
/// Fragment payloads: 4008 bytes of UDP in 1480-byte pieces, as an MTU of
/// 1500 cuts an IPv4 datagram.
const CHUNK: usize = 1480;

/// A 4000-byte datagram from `src` to `dst`, in fragments with IP ID `id`.
fn datagram(src: Endpoint, dst: Endpoint, id: u32) -> Vec<Vec<u8>> {
    let payload: Vec<u8> = (0..4000u32).map(|i| (i * 7 % 251) as u8).collect();
    fragments(&udp(src, dst, &payload), CHUNK, id)
}

/// The fragment with its protocol (IPv4's, or the IPv6 Fragment header's
/// next header) made TCP; an IPv4 header checksum made right again.
fn as_tcp(fragment: &[u8]) -> Vec<u8> {
    let mut f = fragment.to_vec();
    if f[14] >> 4 == 6 {
        f[14 + 40] = IPPROTO_TCP;
    } else {
        f[14 + 9] = IPPROTO_TCP;
        set_ipv4_checksum(&mut f, 20);
    }
    f
}

fn cases(n: &Net, family: &str) -> Vec<Case> {
    let client = (n.client, CLIENT_PORT);
    let (vip, backend) = ((n.vip, DNS), (n.backend, DNS_TARGET));
    let sent = datagram(client, vip, 0x1234);
    let arrives = datagram(client, backend, 0x1234);
    let reply = datagram(backend, client, 0x4321);
    let reply_seen = datagram(vip, client, 0x4321);
    let unseen_first = datagram(client, vip, 0x5555);
    let to_empty = datagram(client, (n.vip, EMPTY), 0x6666);
    assert_eq!(sent.len(), 3, "three fragments");
    let mut cases = vec![Case::new(
        &format!("{family}: first fragment of a 4000-byte datagram to the ClusterIP: to the backend, port and UDP checksum too"),
        sent[0].clone(),
        TC_ACT_OK,
        Expect::Translated(arrives[0].clone()),
        &[Counter::NewFlow, Counter::FragmentFirst],
    )];
    for i in 1..3 {
        cases.push(Case::new(
            &format!("{family}: fragment {} of the datagram follows the first: to the backend's address", i + 1),
            sent[i].clone(),
            TC_ACT_OK,
            Expect::Translated(arrives[i].clone()),
            &[Counter::Established, Counter::FragmentFollowed],
        ));
    }
    // The reply confirms the flow (its two entries move to CONNTRACK), and
    // is marked for egress.
    cases.push(
        Case::new(
            &format!("{family}: the backend's fragmented reply, first fragment at ingress: a reply, marked"),
            reply[0].clone(),
            TC_ACT_OK,
            Expect::Unchanged,
            &[Counter::Reply, Counter::FragmentFirst, Counter::CtPromoted, Counter::CtPromoted],
        )
        .leaves_mark(REVERSE_NAT_MARK),
    );
    cases.push(
        Case::new(
            &format!("{family}: ... its last fragment at ingress: a reply, marked"),
            reply[2].clone(),
            TC_ACT_OK,
            Expect::Unchanged,
            &[Counter::Reply, Counter::FragmentFollowed],
        )
        .leaves_mark(REVERSE_NAT_MARK),
    );
    cases.push(
        Case::new(
            &format!("{family}: ... the reply's first fragment at egress: from the ClusterIP's port 53"),
            reply[0].clone(),
            TC_ACT_OK,
            Expect::Translated(reply_seen[0].clone()),
            &[Counter::FragmentFirst],
        )
        .at_egress(REVERSE_NAT_MARK),
    );
    for i in 1..3 {
        cases.push(
            Case::new(
                &format!("{family}: ... fragment {} of the reply at egress: from the ClusterIP", i + 1),
                reply[i].clone(),
                TC_ACT_OK,
                Expect::Translated(reply_seen[i].clone()),
                &[Counter::FragmentFollowed],
            )
            .at_egress(REVERSE_NAT_MARK),
        );
    }
    cases.push(Case::untouched(
        &format!("{family}: a later fragment whose first was not seen: left alone"),
        unseen_first[1].clone(),
        Counter::Fragment,
    ));
    cases.push(Case::untouched(
        &format!("{family}: a first fragment of TCP (which sizes its segments to the path): left alone"),
        as_tcp(&datagram(client, (n.vip, 80), 0x7777)[0]),
        Counter::Fragment,
    ));
    cases.push(Case::new(
        &format!("{family}: a first fragment to a Service without endpoints: dropped, not rejected (no error for a fragment)"),
        to_empty[0].clone(),
        TC_ACT_SHOT,
        Expect::Unchanged,
        &[Counter::NoBackend, Counter::RejectSuppressed, Counter::FragmentFirst],
    ));
    cases.push(Case::new(
        &format!("{family}: ... and its later fragment, which has no flow to follow: left alone"),
        to_empty[1].clone(),
        TC_ACT_UNSPEC,
        Expect::Unchanged,
        &[Counter::FragmentFollowed, Counter::Fragment],
    ));
    cases
}

/// DNS (53 -> 5353/UDP) on the family's ClusterIP with one backend, and
/// port 54/UDP with none.
fn services(m: &mut Maps, n: &Net) -> anyhow::Result<()> {
    let backend = Backend { addr: addr(n.backend), port: DNS_TARGET.to_be(), proto: IPPROTO_UDP, flags: BACKEND_READY | BACKEND_SERVING };
    m.put_backend(n.ids[0], &backend)?;
    m.put_slot(&SlotKey { service_id: n.ids[0], slot: 0 }, n.ids[0])?;
    for (id, port, count) in [(n.ids[0], DNS, 1), (n.ids[1], EMPTY, 0)] {
        let entry = ServiceEntry { service_id: id, backend_count: count, kind: KIND_CLUSTER_IP, ..Default::default() };
        for scope in [SCOPE_INTERNAL, SCOPE_EXTERNAL] {
            m.put_frontend(&FrontendKey { addr: addr(n.vip), port: port.to_be(), proto: IPPROTO_UDP, scope }, &entry)?;
        }
    }
    Ok(())
}

#[test]
#[ignore = "needs root (BPF)"]
fn fragment_fixtures() {
    let fx = Fixture::new("fragment", |m| {
        for n in [&V4, &V6] {
            services(m, n)?;
        }
        Ok(())
    })
    .unwrap();
    let mut all = cases(&V4, "IPv4");
    all.extend(cases(&V6, "IPv6"));
    run_table(&fx, "IP fragment", all);
}
