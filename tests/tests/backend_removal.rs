//! An established flow whose backend is removed moves to a live backend on
//! its next packet, through the real `tc_ingress` (BPF_PROG_TEST_RUN) and the
//! agent's own map writes (`MapWriter`, as the reconciler calls it).
//!
//! The datapath checks an established flow's backend only when the backends
//! epoch moved since the flow's last check, and `Maps::del_backend` moves it:
//! these cases pin that contract down, including an ID reused for another
//! address and a removal that bypassed `del_backend` (not seen until the
//! epoch moves). Needs root (BPF).

#![feature(custom_test_frameworks)]
#![test_runner(proxy_tests::harness::run)]

use anyhow::{Context, Result, ensure};
use etherparse::{PacketBuilder, SlicedPacket, TransportSlice};
use proxy_common::*;
use proxy_tests::fixture::{Fixture, TC_ACT_OK};
use proxy_user::{
    maps::{MapWriter, Maps, TC_INGRESS},
};

const CLIENT: ([u8; 4], u16) = ([10, 244, 0, 2], 40000);
const VIP: [u8; 4] = [10, 96, 0, 53];
const PORT: u16 = 53;
const TARGET: u16 = 5353;
const SERVICE_ID: u32 = 1;
const FIRST: [u8; 4] = [10, 244, 1, 1];
const SECOND: [u8; 4] = [10, 244, 1, 2];
const THIRD: [u8; 4] = [10, 244, 1, 3];

fn backend(addr: [u8; 4]) -> Backend {
    Backend { addr: Addr::from_v4_octets(addr), port: TARGET.to_be(), proto: IPPROTO_UDP, flags: BACKEND_READY | BACKEND_SERVING }
}

/// The Service's only slot points at backend `id`.
fn serve_with(m: &mut Maps, id: u32) -> Result<()> {
    m.put_slot(&SlotKey { service_id: SERVICE_ID, slot: 0 }, id)?;
    Ok(())
}

/// 10.96.0.53:53/UDP with one endpoint, FIRST (backend ID 1).
fn install(m: &mut Maps) -> Result<()> {
    m.put_backend(1, &backend(FIRST))?;
    serve_with(m, 1)?;
    let key = FrontendKey { addr: Addr::from_v4_octets(VIP), port: PORT.to_be(), proto: IPPROTO_UDP, scope: SCOPE_INTERNAL };
    m.put_frontend(&key, &ServiceEntry { service_id: SERVICE_ID, backend_count: 1, kind: KIND_CLUSTER_IP, ..Default::default() })?;
    Ok(())
}

/// Counter names in index order, as `send` lists them.
fn names(counters: &[Counter]) -> Vec<&'static str> {
    let mut at = counters.to_vec();
    at.sort_by_key(|c| *c as u32);
    at.into_iter().map(Counter::name).collect()
}

fn datagram() -> Vec<u8> {
    let mut v = Vec::new();
    PacketBuilder::ethernet2([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2])
        .ipv4(CLIENT.0, VIP, 64)
        .udp(CLIENT.1, PORT)
        .write(&mut v, b"query")
        .unwrap();
    v
}

/// Sends the flow's datagram once: where it went, and the counters that moved.
fn send(fx: &Fixture) -> Result<([u8; 4], Vec<&'static str>)> {
    let before = fx.counters();
    let (verdict, out, _) = fx.run(TC_INGRESS, &datagram(), 0).context("test run")?;
    ensure!(verdict == TC_ACT_OK, "verdict {verdict}, want OK (translated)");
    let p = SlicedPacket::from_ethernet(&out).context("parsing the frame out")?;
    let Some(etherparse::NetSlice::Ipv4(ip)) = &p.net else { anyhow::bail!("no IPv4 out") };
    let Some(TransportSlice::Udp(udp)) = &p.transport else { anyhow::bail!("no UDP out") };
    ensure!(udp.destination_port() == TARGET, "port {} out, want {TARGET}", udp.destination_port());
    let after = fx.counters();
    let moved = (0..after.len()).filter(|&i| after[i] != before[i]).map(|i| Counter::ALL[i].name()).collect();
    Ok((ip.header().destination(), moved))
}

#[test]
#[ignore = "needs root (BPF)"]
fn removed_backend_flow_moves_on_its_next_packet() -> Result<()> {
    let mut fx = Fixture::new("backend-removal", install)?;
    assert_eq!(send(&fx)?, (FIRST, names(&[Counter::NewFlow])), "first datagram: a new flow to the only endpoint");
    assert_eq!(send(&fx)?, (FIRST, names(&[Counter::Established])), "second datagram: the established flow");

    // The agent's order: the new endpoint and its slot, then the removal.
    fx.maps.put_backend(2, &backend(SECOND))?;
    serve_with(&mut fx.maps, 2)?;
    fx.maps.del_backend(1)?;
    assert_eq!(
        send(&fx)?,
        (SECOND, names(&[Counter::Rebalanced, Counter::NewFlow])),
        "after the removal the flow moves to the live endpoint"
    );
    assert_eq!(send(&fx)?, (SECOND, names(&[Counter::Established])), "and stays there");
    Ok(())
}

#[test]
#[ignore = "needs root (BPF)"]
fn reused_backend_id_for_another_address_rebalances_the_flow() -> Result<()> {
    let mut fx = Fixture::new("backend-reuse", install)?;
    assert_eq!(send(&fx)?.0, FIRST);
    // ID 1 removed, then handed to another endpoint (the reconciler reuses
    // the lowest free ID), in a later sync.
    fx.maps.del_backend(1)?;
    fx.maps.put_backend(1, &backend(THIRD))?;
    assert_eq!(send(&fx)?, (THIRD, names(&[Counter::Rebalanced, Counter::NewFlow])), "the flow follows the ID's new address");
    Ok(())
}

#[test]
#[ignore = "needs root (BPF)"]
fn removal_is_seen_when_the_epoch_moves() -> Result<()> {
    let mut fx = Fixture::new("backend-epoch", install)?;
    assert_eq!(send(&fx)?.0, FIRST);
    fx.maps.put_backend(2, &backend(SECOND))?;
    serve_with(&mut fx.maps, 2)?;
    // Removed behind del_backend's back: the epoch did not move, so the
    // datapath has no reason to look the backend up.
    fx.maps.backends.remove(&1)?;
    assert_eq!(send(&fx)?, (FIRST, names(&[Counter::Established])), "no epoch change: the flow's entry is trusted");
    fx.maps.bump_backends_epoch()?;
    assert_eq!(send(&fx)?, (SECOND, names(&[Counter::Rebalanced, Counter::NewFlow])), "epoch moved: checked and moved");
    Ok(())
}
