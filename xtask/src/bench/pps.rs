//! Packets per second one node forwards for a NodePort, per datapath. A
//! generator namespace sends UDP from an external address to the NodePort
//! on the node's address over a veth; the node translates it (masquerade:
//! externalTrafficPolicy Cluster) and routes it to the backends through a
//! next hop back on the generator's side, where a sink counts it. The
//! generator and sink are XDP programs (tests/src/bench/xdp_gen.rs), so
//! no socket is involved and the node's forwarding is the cost measured.
//!
//! Datapaths: ebpf-proxy with native XDP on the node's veth, ebpf-proxy on
//! TC only, kube-proxy's nftables and iptables rules (traffic.rs's peers),
//! no proxy (the generator sends to a backend directly: plain forwarding,
//! the stack path's ceiling), and a reflector (an XDP program on the node's
//! veth that turns each frame around: the floor). As in traffic.rs, each
//! has its own topology, and rounds visit them in turn.
//!
//! The generator's send runs the node's and the sink's work too: a veth
//! runs its receiver's NAPI where the frame was sent, so one CPU carries
//! generator, node and sink in series. The floor is what the generator,
//! the veth's two crossings and the sink cost; a datapath's time per packet
//! less the floor's is its own. For ebpf-proxy's datapaths one more window,
//! with the kernel's run-time statistics on, splits that own cost into its
//! programs' run time and the kernel's path around them.

use std::{
    collections::BTreeMap,
    net::Ipv4Addr,
    path::Path,
    sync::atomic::{AtomicBool, Ordering},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Result, ensure};
use proxy_tests::{
    agent::Agent,
    bench::{
        services::{ServiceSet, UDP_NODE_PORT, UDP_TARGET, probe_endpoints},
        xdp_gen::{Pktgen, udp_frame},
    },
    bpffs::Bpffs,
    cgroup::Cgroup,
    topology::{External, Node, mac_of},
};

use super::{
    cpu_busy,
    traffic::{NODE_IP, Peer, PeerFiles, SCALES, program},
};

const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 2);
/// The next hop to the backends: the generator's end of the veth.
const NEXT_HOP: Ipv4Addr = Ipv4Addr::new(192, 168, 0, 254);
/// Source ports the generator cycles through: one conntrack flow each.
pub const FLOWS: u32 = 4096;
/// Under this share of delivered frames sent out by XDP itself, the XDP
/// column measures the stack path and says so.
pub const XDP_SHARE_MIN: f64 = 0.9;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Datapath {
    Xdp,
    Tc,
    Nftables,
    IptablesNft,
    IptablesLegacy,
    NoProxy,
    Reflector,
}

impl Datapath {
    pub const ALL: [Datapath; 7] = [
        Datapath::Xdp,
        Datapath::Tc,
        Datapath::Nftables,
        Datapath::IptablesNft,
        Datapath::IptablesLegacy,
        Datapath::NoProxy,
        Datapath::Reflector,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Datapath::Xdp => "ebpf-proxy XDP",
            Datapath::Tc => "ebpf-proxy TC",
            Datapath::Reflector => "reflector (floor)",
            other => other.peer().label(),
        }
    }

    fn peer(self) -> Peer {
        match self {
            Datapath::Xdp | Datapath::Tc => Peer::EbpfProxy,
            Datapath::Nftables => Peer::Nftables,
            Datapath::IptablesNft => Peer::IptablesNft,
            Datapath::IptablesLegacy => Peer::IptablesLegacy,
            Datapath::NoProxy | Datapath::Reflector => Peer::NoProxy,
        }
    }

    /// The generator sends to an endpoint itself, not to the NodePort.
    fn dials_endpoint(self) -> bool {
        matches!(self, Datapath::NoProxy | Datapath::Reflector)
    }
}

#[derive(Clone, Debug)]
pub struct Row {
    pub services: usize,
    pub datapath: Datapath,
    /// Million packets per second delivered to the sink: median of the rounds.
    pub mpps: f64,
    pub rounds: Vec<f64>,
    /// Busy CPU seconds (the whole machine) per million packets: median.
    pub cpu_per_mpkt: f64,
    /// XDP only: the share of delivered frames XDP sent out itself (median).
    pub xdp_share: Option<f64>,
    /// ebpf-proxy only: each of its programs that ran, with its run time
    /// per delivered packet (ns), from a window of its own (`program_time`).
    pub programs: Vec<(String, f64)>,
}

impl Row {
    /// Nanoseconds per delivered packet.
    pub fn ns_per_packet(&self) -> f64 {
        1e3 / self.mpps
    }

    /// XDP sent out most of the frames delivered itself (else its figures
    /// are the stack path's).
    pub fn sent_out_by_xdp(&self) -> bool {
        self.xdp_share.is_some_and(|s| s >= XDP_SHARE_MIN)
    }
}

#[derive(Clone, Debug, Default)]
pub struct Results {
    pub rows: Vec<Row>,
    pub warmup: Duration,
    pub window: Duration,
    pub rounds: usize,
}

impl Results {
    pub fn row(&self, services: usize, datapath: Datapath) -> Option<&Row> {
        self.rows.iter().find(|r| r.services == services && r.datapath == datapath)
    }

    /// Nanoseconds per packet `datapath` adds to the floor's (the
    /// reflector's) at `services`: the node's own cost.
    pub fn own_ns(&self, services: usize, datapath: Datapath) -> Option<f64> {
        let (row, floor) = (self.row(services, datapath)?, self.row(services, Datapath::Reflector)?);
        (row.mpps > 0.0 && floor.mpps > 0.0).then(|| row.ns_per_packet() - floor.ns_per_packet())
    }

    /// `datapath`'s own cost over XDP's at `services` (none while XDP's is
    /// within the floor's noise: no divisor).
    pub fn own_ratio(&self, services: usize, datapath: Datapath) -> Option<f64> {
        let (other, xdp) = (self.own_ns(services, datapath)?, self.own_ns(services, Datapath::Xdp)?);
        (xdp > 0.0).then(|| other / xdp)
    }

    /// The lowest and highest of XDP's rate over `datapath`'s within one
    /// round (each round visits every datapath), at `services`: how far
    /// the host's noise moves the ratio.
    pub fn round_ratio_range(&self, services: usize, datapath: Datapath) -> Option<(f64, f64)> {
        let (xdp, other) = (self.row(services, Datapath::Xdp)?, self.row(services, datapath)?);
        let ratios: Vec<f64> = xdp.rounds.iter().zip(&other.rounds).filter(|(_, o)| **o > 0.0).map(|(x, o)| x / o).collect();
        let lo = ratios.iter().cloned().reduce(f64::min)?;
        Some((lo, ratios.iter().cloned().fold(lo, f64::max)))
    }

    /// The highest rate XDP could reach over `datapath` at `services` if
    /// XDP itself cost nothing: `datapath`'s time per packet over the
    /// floor's, which every rate here includes.
    pub fn ceiling_over(&self, services: usize, datapath: Datapath) -> Option<f64> {
        let (row, floor) = (self.row(services, datapath)?, self.row(services, Datapath::Reflector)?);
        (row.mpps > 0.0).then(|| floor.mpps / row.mpps)
    }
}

/// One window's figures.
struct Sample {
    mpps: f64,
    cpu_per_mpkt: f64,
    xdp_share: Option<f64>,
    /// With run-time statistics on: ebpf-proxy's programs' time per
    /// delivered packet (`program_time`); else empty.
    programs: Vec<(String, f64)>,
}

/// ebpf-proxy's programs: the ones the agent attaches (tail-called ones
/// run inside them, and the kernel counts their time there). The bench's
/// generator, sink and pass programs are `xdp_pkt*` and `xdp_pass`.
fn is_ours(program: &str) -> bool {
    program.starts_with("tc_") || program == "xdp_ingress"
}

/// Run count and total run time of each of ebpf-proxy's loaded programs,
/// by id (the kernel keeps them while run-time statistics are on).
fn program_runs() -> Result<BTreeMap<u32, (String, u64, Duration)>> {
    let mut runs = BTreeMap::new();
    for info in aya::programs::loaded_programs() {
        let info = info?;
        let name = info.name_as_str().unwrap_or_default();
        if is_ours(name) {
            runs.insert(info.id(), (name.to_string(), info.run_count(), info.run_time()));
        }
    }
    Ok(runs)
}

/// Time per delivered packet of each program that ran between `before`
/// and `after`, summed by name.
fn program_time(
    before: &BTreeMap<u32, (String, u64, Duration)>,
    after: &BTreeMap<u32, (String, u64, Duration)>,
    delivered: u64,
) -> Vec<(String, f64)> {
    let mut by_name: BTreeMap<String, f64> = BTreeMap::new();
    for (id, (name, runs, time)) in after {
        let (runs0, time0) = before.get(id).map_or((0, Duration::ZERO), |b| (b.1, b.2));
        if *runs > runs0 {
            *by_name.entry(name.clone()).or_default() += (*time - time0).as_nanos() as f64 / delivered.max(1) as f64;
        }
    }
    by_name.into_iter().collect()
}

pub fn run(work: &Path, warmup: Duration, window: Duration, rounds: usize) -> Result<Results> {
    let mut out = Results { warmup, window, rounds, ..Results::default() };
    for &scale in &SCALES {
        let files = PeerFiles::write(&ServiceSet::new(scale), &work.join(format!("pps-{scale}")))?;
        let mut benches = Vec::new();
        for dp in Datapath::ALL {
            eprintln!("    pps: {scale} services: programming {}", dp.label());
            benches.push(Bench::new(dp, &files)?);
        }
        let mut samples: Vec<Vec<Sample>> = benches.iter().map(|_| Vec::new()).collect();
        for round in 0..rounds {
            // A different datapath goes first each round.
            for k in 0..benches.len() {
                let i = (k + round) % benches.len();
                let s = benches[i].measure(warmup, window, false)?;
                ensure!(s.mpps > 0.0, "{} at {scale} services: nothing got through", benches[i].datapath.label());
                samples[i].push(s);
            }
        }
        for (bench, samples) in benches.iter().zip(&samples) {
            // The statistics cost each program run a clock read or two, so
            // they are on only in a window of their own, whose rate is not kept.
            let programs = match bench.proxy {
                Some(_) => bench.measure(warmup, window, true)?.programs,
                None => Vec::new(),
            };
            let rates: Vec<f64> = samples.iter().map(|s| s.mpps).collect();
            let cpu: Vec<f64> = samples.iter().map(|s| s.cpu_per_mpkt).collect();
            let shares: Vec<f64> = samples.iter().filter_map(|s| s.xdp_share).collect();
            let row = Row {
                services: scale,
                datapath: bench.datapath,
                mpps: super::micro::median(&rates),
                cpu_per_mpkt: super::micro::median(&cpu),
                xdp_share: (!shares.is_empty()).then(|| super::micro::median(&shares)),
                rounds: rates,
                programs,
            };
            eprintln!(
                "      {:<30} {:>6.2} Mpps  {:>5.2} CPU s/Mpkt{}  rounds {:?}{}",
                row.datapath.label(),
                row.mpps,
                row.cpu_per_mpkt,
                row.xdp_share.map_or(String::new(), |s| format!("  sent out by XDP {:.0}%", s * 100.0)),
                row.rounds.iter().map(|r| (r * 100.0).round() / 100.0).collect::<Vec<_>>(),
                row.programs.iter().map(|(name, ns)| format!("  {name} {ns:.0} ns/packet")).collect::<String>()
            );
            out.rows.push(row);
        }
    }
    Ok(out)
}

/// One datapath's topology: node <-> generator over one veth.
struct Bench {
    datapath: Datapath,
    // Drop order: the agent (and its XDP) first, then the generator's
    // programs, then the namespaces.
    proxy: Option<(Agent, Bpffs, Cgroup)>,
    pktgen: Pktgen,
    lan: External,
    _node: Node,
}

impl Bench {
    fn new(datapath: Datapath, files: &PeerFiles) -> Result<Bench> {
        let mut node = Node::new("pps")?;
        let lan = node.add_external("gen", NODE_IP, &[EXTERNAL_IP], &[])?;
        let n0 = lan.node_if.clone();
        // Forwarded frames leave by the interface they came in on: no ICMP redirects.
        node.ns.sysctl("net.ipv4.conf.all.send_redirects", "0")?;
        node.ns.sysctl(&format!("net.ipv4.conf.{n0}.send_redirects"), "0")?;
        let gen_mac = mac_of(&lan.ns, "eth0")?;
        node.ns.ip(&["neigh", "replace", &NEXT_HOP.to_string(), "lladdr", &gen_mac, "dev", &n0, "nud", "permanent"])?;
        let endpoints = probe_endpoints();
        for ep in &endpoints {
            node.ns.ip(&["route", "add", &format!("{ep}/32"), "via", &NEXT_HOP.to_string(), "dev", &n0])?;
        }

        let xdp_flags = ["--xdp-devices", n0.as_str(), "--xdp-mode", "native"];
        let agent_flags: &[&str] = if datapath == Datapath::Xdp { &xdp_flags } else { &[] };
        let proxy = program(&node.ns, datapath.peer(), &files.manifests, &files.ipt, &files.nft, agent_flags)?;

        let (dst, dport) = if datapath.dials_endpoint() { (endpoints[0], UDP_TARGET) } else { (NODE_IP, UDP_NODE_PORT) };
        let frame = udp_frame(mac(&gen_mac)?, mac(&mac_of(&node.ns, &n0)?)?, EXTERNAL_IP, dst, dport)?;
        let mut pktgen = Pktgen::new("pps", frame, FLOWS, UDP_TARGET)?;
        pktgen.attach_sink(&lan.ns, "eth0")?;
        match datapath {
            Datapath::Xdp => {}
            Datapath::Reflector => pktgen.attach_reflector(&node.ns, &n0)?,
            _ => pktgen.attach_pass(&node.ns, &n0)?,
        }
        Ok(Bench { datapath, proxy, pktgen, lan, _node: node })
    }

    /// Sends for `warmup` + `window`; counts over the window. With
    /// `programs`, the kernel's run-time statistics are on throughout (as
    /// long as the fd BPF_ENABLE_STATS gives is open), and the window also
    /// gives ebpf-proxy's programs' time per delivered packet.
    fn measure(&self, warmup: Duration, window: Duration, programs: bool) -> Result<Sample> {
        // Before Linux 5.8 this fails, and the table shows no program time.
        let stats = programs
            .then(|| aya::sys::enable_stats(aya::sys::Stats::RunTime))
            .and_then(|on| on.map_err(|e| eprintln!("      no program run times: BPF_ENABLE_STATS failed: {e}")).ok());
        let runs = || if stats.is_some() { program_runs() } else { Ok(BTreeMap::new()) };
        let stop = &AtomicBool::new(false);
        let (pktgen, ns) = (&self.pktgen, &self.lan.ns);
        thread::scope(|s| {
            let sender = s.spawn(move || pktgen.send(ns, "eth0", stop));
            let counted = (|| -> Result<Sample> {
                thread::sleep(warmup);
                let (sunk, xdp, cpu, runs0, t) = (self.pktgen.sunk()?, self.xdp_sent()?, cpu_busy()?, runs()?, Instant::now());
                thread::sleep(window);
                let (sunk1, xdp1, cpu1, runs1, elapsed) =
                    (self.pktgen.sunk()?, self.xdp_sent()?, cpu_busy()?, runs()?, t.elapsed());
                let delivered = (sunk1 - sunk) as f64;
                Ok(Sample {
                    mpps: delivered / elapsed.as_secs_f64() / 1e6,
                    cpu_per_mpkt: (cpu1 - cpu) / (delivered / 1e6).max(1e-9),
                    xdp_share: xdp.zip(xdp1).map(|(a, b)| (b - a) as f64 / delivered.max(1.0)),
                    programs: program_time(&runs0, &runs1, sunk1 - sunk),
                })
            })();
            stop.store(true, Ordering::Relaxed);
            sender.join().map_err(|_| anyhow::anyhow!("the generator panicked"))??;
            counted
        })
    }

    /// Frames ebpf-proxy's XDP sent out itself (XDP_DEVICES), XDP only.
    fn xdp_sent(&self) -> Result<Option<u64>> {
        match (&self.proxy, self.datapath) {
            (Some((_, bpffs, _)), Datapath::Xdp) => {
                let sent = proxy_user::xdp::sent(&bpffs.path().join("ebpf-proxy"))?;
                Ok(Some(sent.iter().map(|(_, n)| n).sum()))
            }
            _ => Ok(None),
        }
    }
}

fn mac(text: &str) -> Result<[u8; 6]> {
    let bytes: Vec<u8> = text.split(':').map(|b| u8::from_str_radix(b, 16)).collect::<Result<_, _>>()?;
    bytes.try_into().map_err(|_| anyhow::anyhow!("not a MAC address: {text}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only programs that ran in the window count, per delivered packet,
    /// summed by name; a program loaded during the window counts from zero.
    #[test]
    fn program_time_is_what_ran_in_the_window_per_packet() {
        let ms = Duration::from_millis;
        let before = BTreeMap::from([
            (1, ("tc_ingress".to_string(), 10, ms(1))),
            (2, ("tc_egress".to_string(), 10, ms(1))),
            (3, ("tc_ingress".to_string(), 5, ms(2))),
        ]);
        let after = BTreeMap::from([
            (1, ("tc_ingress".to_string(), 1010, ms(3))),
            (2, ("tc_egress".to_string(), 10, ms(1))),
            (3, ("tc_ingress".to_string(), 6, ms(3))),
            (4, ("xdp_ingress".to_string(), 1000, ms(4))),
        ]);
        // 1000 packets: tc_ingress ran 2 + 1 ms, xdp_ingress 4 ms; tc_egress not at all.
        let got = program_time(&before, &after, 1000);
        assert_eq!(got, vec![("tc_ingress".to_string(), 3000.0), ("xdp_ingress".to_string(), 4000.0)]);
        assert!(is_ours("tc_egress") && is_ours("xdp_ingress"));
        assert!(!is_ours("xdp_pktgen") && !is_ours("xdp_pktsink") && !is_ours("xdp_pass"));
    }
}
