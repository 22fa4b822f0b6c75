//! The agent's batched map writes (`MapWriter::put_backends`, `put_slots`,
//! `put_frontends` on the real pinned maps): many entries land as written,
//! across the writer's chunks, and a map that fills up stops the writes at
//! its last free entry with the same named error a single write gives.
//! Needs root (BPF).

#![feature(custom_test_frameworks)]
#![test_runner(proxy_tests::harness::run)]

use anyhow::{Context, Result, ensure};
use proxy_common::*;
use proxy_tests::bpffs::Bpffs;
use proxy_user::{
    kernel,
    map_sizes::{MapSizes, ServiceMapSize},
    maps::{self, LoadOptions, MapWriter, Maps, full_map},
    snat_ports::SnatPorts,
};

fn load(bpffs: &Bpffs, service_map_entries: u32) -> Result<Maps> {
    let options = LoadOptions {
        root: bpffs.path().to_path_buf(),
        ports: SnatPorts::default(),
        sizes: MapSizes { services: ServiceMapSize::from_flag(service_map_entries)?, ..Default::default() },
        features: kernel::probe()?,
        maglev: Default::default(),
    };
    let (_ebpf, maps) = maps::load_with(&options).context("loading the BPF object")?;
    Ok(maps)
}

fn backend(i: u32) -> Backend {
    let [a, b, c, d] = (0x0af4_0000 + i).to_be_bytes();
    Backend { addr: Addr::from_v4_octets([a, b, c, d]), port: 8080u16.to_be(), proto: IPPROTO_TCP, flags: BACKEND_READY | BACKEND_SERVING }
}

#[test]
#[ignore = "needs root (BPF)"]
fn many_entries_land_as_written() -> Result<()> {
    let bpffs = Bpffs::new("map-writes")?;
    let mut maps = load(&bpffs, 65_536)?;
    // More than one of the writer's chunks (8,192 entries).
    let backends: Vec<(u32, Backend)> = (1..=20_000).map(|id| (id, backend(id))).collect();
    let slots: Vec<(SlotKey, u32)> = (0..20_000).map(|i| (SlotKey { service_id: 1 + i / 100, slot: i % 100 }, i + 1)).collect();
    let frontends: Vec<(FrontendKey, ServiceEntry)> = (0..200)
        .map(|i| {
            let key = FrontendKey { addr: backend(i).addr, port: 80u16.to_be(), proto: IPPROTO_TCP, scope: SCOPE_INTERNAL };
            (key, ServiceEntry { service_id: 1 + i, backend_count: 100, kind: KIND_CLUSTER_IP, ..Default::default() })
        })
        .collect();
    let (n, result) = maps.put_backends(&backends);
    result?;
    ensure!(n == backends.len(), "{n} backends written, want {}", backends.len());
    let (n, result) = maps.put_slots(&slots);
    result?;
    ensure!(n == slots.len(), "{n} slots written, want {}", slots.len());
    let (n, result) = maps.put_frontends(&frontends);
    result?;
    ensure!(n == frontends.len(), "{n} frontends written, want {}", frontends.len());

    let held = maps.read_contents()?;
    ensure!(held.backends == backends.iter().copied().collect(), "BACKENDS holds other entries than were written");
    ensure!(held.slots == slots.iter().copied().collect(), "BACKEND_SLOTS holds other entries than were written");
    ensure!(held.frontends == frontends.iter().copied().collect(), "FRONTENDS holds other entries than were written");
    Ok(())
}

#[test]
#[ignore = "needs root (BPF)"]
fn a_full_map_stops_the_writes_at_its_capacity_and_is_named() -> Result<()> {
    let bpffs = Bpffs::new("map-writes-full")?;
    let capacity = 1024;
    let mut maps = load(&bpffs, capacity)?;
    let backends: Vec<(u32, Backend)> = (1..=capacity + 10).map(|id| (id, backend(id))).collect();
    let (n, result) = maps.put_backends(&backends);
    let e = result.err().context("writing past the map's capacity succeeded")?;
    ensure!(n == capacity as usize, "{n} written before the error, want {capacity}");
    ensure!(
        full_map(&e).is_some_and(|full| full.map == MAP_BACKENDS && full.capacity == u64::from(capacity)),
        "the error does not name BACKENDS as full: {e:#}"
    );
    let held = maps.read_contents()?;
    ensure!(held.backends == backends[..n].iter().copied().collect(), "BACKENDS does not hold exactly the entries before the error");
    // Rewriting entries it holds still works on a full map.
    let (n, result) = maps.put_backends(&backends[..10]);
    result.context("rewriting held entries of a full map")?;
    ensure!(n == 10);
    Ok(())
}
