//! Datapath micro-benchmark: the compiled `tc_ingress` run by
//! BPF_PROG_TEST_RUN on crafted frames, with the maps filled for 1 to 100 000
//! Services of 10 endpoints, TCP, UDP and SCTP (each with a targetPort other
//! than its port, so every translation rewrites the port and its checksum:
//! for SCTP the CRC32c).
//!
//! Method. A TC program may rewrite the frame, and with `repeat` the kernel
//! runs it again on the rewritten frame: after the first NAT the packet is
//! addressed to the backend and takes another path. So every sample is one
//! run (`repeat` = 1) on a fresh copy of a frame, and the kernel's
//! in-kernel duration for it is kept (it excludes the syscall, includes one
//! clock read). A new flow is a connection's opening (TCP SYN, SCTP INIT,
//! a UDP datagram) of a tuple never seen (distinct client address and port,
//! Service drawn at random among all installed, so lookups touch the whole
//! map); the chosen backend's answer (SYN-ACK, INIT-ACK, a datagram back)
//! and, for TCP, the client's ACK then confirm the flow, as a real exchange
//! does (a flow starts unconfirmed, and only an opening starts one); an
//! established flow is then the client's next packet (TCP data with ACK,
//! SCTP DATA, a datagram), measured. A frame the
//! program leaves at once (ARP) gives the floor of the method. The counters
//! prove each sample took the path it is filed under.
//!
//! Steady state. `repeat` does work for a pair of Services that point at
//! each other: A:80 has the one endpoint B:8080 and B:8080 has A:80. The
//! first run translates a frame for A into one for B, the second one for B
//! back into one for A. Both flows are opened and confirmed first (as
//! above), so every repeat is an established flow
//! with a full rewrite (address and port, with their checksums) and hot
//! caches: the kernel's average over the repeats is the established cost in a
//! tight loop, the figure usually quoted; the median of `BATCHES` such runs
//! is kept. Its floor is the same `repeat` on
//! a frame the program leaves at once (ARP): what the kernel's loop costs
//! per run without the program's work, so program minus floor is the
//! program's own cost.

use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use aya::{
    Ebpf,
    programs::{SchedClassifier, TestRun, TestRunOptions},
};
use proxy_common::*;
use proxy_tests::{
    bench::services::{ServiceSet, TCP_PORT, TCP_TARGET, UDP_PORT, UDP_TARGET},
    bpffs::Bpffs,
    frames,
    sctp::chunk,
};
use proxy_user::maps::{self, MapWriter, Maps, TC_INGRESS};
use rand::{Rng, SeedableRng, rngs::StdRng};

pub const SCALES: [usize; 4] = [1, 1_000, 10_000, 100_000];
pub const PROTOCOLS: [u8; 3] = [IPPROTO_TCP, IPPROTO_UDP, IPPROTO_SCTP];
/// SCTP 2905 -> 3905 (the micro-benchmark's own; the real-traffic topology
/// has no SCTP: this kernel has no SCTP module).
const SCTP_PORT: u16 = 2905;
const SCTP_TARGET: u16 = 3905;
const TC_ACT_OK: u32 = 0;
const TC_ACT_UNSPEC: u32 = u32::MAX;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    New,
    Established,
}

#[derive(Clone, Debug)]
pub struct Row {
    pub services: usize,
    pub proto: &'static str,
    pub flow: Flow,
    pub median_ns: f64,
    pub p90_ns: f64,
}

#[derive(Clone, Debug, Default)]
pub struct Results {
    pub rows: Vec<Row>,
    /// Median of a frame the program leaves at once, per scale.
    pub floor_ns: Vec<(usize, f64)>,
    /// (services, proto, ns): established flow averaged over `repeat` runs.
    pub steady: Vec<(usize, &'static str, f64)>,
    /// Per scale: the ARP frame averaged over the same `repeat` runs.
    pub steady_floor_ns: Vec<(usize, f64)>,
    pub samples: usize,
    pub repeat: u32,
}

pub fn run(samples: usize, repeat: u32) -> Result<Results> {
    let bpffs = Bpffs::new("bench-micro")?;
    let result = measure(&bpffs, samples, repeat);
    drop(bpffs);
    result
}

fn measure(bpffs: &Bpffs, samples: usize, repeat: u32) -> Result<Results> {
    let (mut ebpf, mut maps) = maps::load(bpffs.path())?;
    maps::load_tc(&mut ebpf, TC_INGRESS).context("verifier rejected tc_ingress")?;
    // Every source in-cluster, so only internal frontends are needed.
    maps.write_node_config(&Default::default(), &["0.0.0.0/0".parse()?])?;

    let largest = *SCALES.last().unwrap();
    let set = ServiceSet::new(largest);
    let mut out = Results { samples, repeat, ..Results::default() };
    let mut installed = Installed::default();
    installed.add_ping_pong(&mut maps)?;
    let mut rng = StdRng::seed_from_u64(7);
    let mut next_client: u32 = 0;
    for &scale in &SCALES {
        let t = std::time::Instant::now();
        installed.fill(&set, scale, &mut maps)?;
        eprintln!("    micro: {scale} services installed ({:.1}s); measuring", t.elapsed().as_secs_f64());
        out.floor_ns.push((scale, median(&floor(&ebpf, samples)?)));
        out.steady_floor_ns.push((scale, steady_floor(&ebpf, repeat)?));
        for proto in PROTOCOLS {
            next_client += 1;
            let ns = steady(&ebpf, &maps, proto, next_client, repeat)?;
            out.steady.push((scale, proto_name(proto), ns));
        }
        for proto in PROTOCOLS {
            // Each series starts from an empty conntrack, so the LRU never
            // evicts a flow the established pass is about to send again.
            clear_conntrack(&mut maps)?;
            let vips = installed.frontends(proto);
            let flows: Vec<(([u8; 4], u16), ([u8; 4], u16))> = (0..samples)
                .map(|_| {
                    next_client += 1;
                    (client_of(next_client), (vips[rng.random_range(0..vips.len())], ports(proto).0))
                })
                .collect();
            // Each backend chosen, from the opening's frame out.
            let mut backends = Vec::with_capacity(samples);
            for flow in [Flow::New, Flow::Established] {
                let want = if flow == Flow::New { Counter::NewFlow } else { Counter::Established };
                if flow == Flow::Established {
                    for (&(client, vip), &backend) in flows.iter().zip(&backends) {
                        confirm(&ebpf, proto, client, vip, backend)?;
                    }
                }
                let before = maps.read_counters()?;
                let mut ns = Vec::with_capacity(samples);
                for (i, &(client, vip)) in flows.iter().enumerate() {
                    let f = if flow == Flow::New { opening(proto, client, vip) } else { frame(proto, client, vip) };
                    let (verdict, d, out) = test_run(&ebpf, &f)?;
                    ensure!(verdict == TC_ACT_OK, "verdict {verdict:#x} for a {flow:?} flow at {scale} services");
                    if i == 0 {
                        check_translated(&out, ports(proto).1).with_context(|| format!("{flow:?} {} flow at {scale} services", proto_name(proto)))?;
                    }
                    if flow == Flow::New {
                        backends.push(destination(&out)?);
                    }
                    ns.push(d.as_nanos() as f64);
                }
                let after = maps.read_counters()?;
                let moved = after[want as usize] - before[want as usize];
                ensure!(
                    moved == samples as u64,
                    "{flow:?} at {scale} services: counter {want:?} moved {moved}, want {samples}"
                );
                out.rows.push(Row {
                    services: scale,
                    proto: proto_name(proto),
                    flow,
                    median_ns: median(&ns),
                    p90_ns: percentile(&ns, 0.90),
                });
            }
        }
    }
    Ok(out)
}

/// What is in the maps so far: Services `0..count` of the set.
#[derive(Default)]
struct Installed {
    count: usize,
    next_service_id: u32,
    next_backend_id: u32,
    tcp: Vec<[u8; 4]>,
    udp: Vec<[u8; 4]>,
    sctp: Vec<[u8; 4]>,
}

impl Installed {
    /// The ping-pong pair, for each protocol, outside the measured set.
    fn add_ping_pong(&mut self, maps: &mut Maps) -> Result<()> {
        let flags = BACKEND_READY | BACKEND_SERVING;
        for proto in PROTOCOLS {
            let (port, target) = ports(proto);
            for ((from, from_port), (to, to_port)) in [((PING_VIP, port), (PONG_VIP, target)), ((PONG_VIP, target), (PING_VIP, port))] {
                self.next_service_id += 1;
                self.next_backend_id += 1;
                let backend = Backend { addr: Addr::from_v4_octets(to), port: to_port.to_be(), proto, flags };
                maps.put_backend(self.next_backend_id, &backend)?;
                maps.put_slot(&SlotKey { service_id: self.next_service_id, slot: 0 }, self.next_backend_id)?;
                let key = FrontendKey { addr: Addr::from_v4_octets(from), port: from_port.to_be(), proto, scope: SCOPE_INTERNAL };
                let entry =
                    ServiceEntry { service_id: self.next_service_id, backend_count: 1, kind: KIND_CLUSTER_IP, ..Default::default() };
                maps.put_frontend(&key, &entry)?;
            }
        }
        Ok(())
    }

    fn frontends(&self, proto: u8) -> &[[u8; 4]] {
        match proto {
            IPPROTO_TCP => &self.tcp,
            IPPROTO_UDP => &self.udp,
            _ => &self.sctp,
        }
    }

    /// Adds Services up to `count`, written as the reconciler writes them:
    /// backends, then slots, then the frontend. The probe (all three
    /// protocols) comes first, so a single Service has a port of each; the
    /// others have one port, TCP, UDP and SCTP in turn (a third each, so the
    /// maps hold 10 backends per Service as in the other families).
    fn fill(&mut self, set: &ServiceSet, count: usize, maps: &mut Maps) -> Result<()> {
        let order = std::iter::once(set.probe).chain((0..set.services.len()).filter(|&i| i != set.probe));
        for (i, svc) in order.enumerate().skip(self.count).take(count - self.count).map(|(n, i)| (n, &set.services[i])) {
            let vip = svc.cluster_ip.octets();
            for proto in PROTOCOLS {
                if i != 0 && PROTOCOLS[i % PROTOCOLS.len()] != proto {
                    continue;
                }
                let (port, target) = ports(proto);
                self.next_service_id += 1;
                let service_id = self.next_service_id;
                for (slot, ep) in svc.endpoints.iter().enumerate() {
                    self.next_backend_id += 1;
                    let backend = Backend {
                        addr: Addr::from_v4_octets(ep.octets()),
                        port: target.to_be(),
                        proto,
                        flags: BACKEND_READY | BACKEND_SERVING,
                    };
                    maps.put_backend(self.next_backend_id, &backend)?;
                    maps.put_slot(&SlotKey { service_id, slot: slot as u32 }, self.next_backend_id)?;
                }
                let key = FrontendKey { addr: Addr::from_v4_octets(vip), port: port.to_be(), proto, scope: SCOPE_INTERNAL };
                let entry = ServiceEntry {
                    service_id,
                    backend_count: svc.endpoints.len() as u32,
                    kind: KIND_CLUSTER_IP,
                    ..Default::default()
                };
                maps.put_frontend(&key, &entry).with_context(|| format!("frontend {}:{port}", svc.cluster_ip))?;
                match proto {
                    IPPROTO_TCP => self.tcp.push(vip),
                    IPPROTO_UDP => self.udp.push(vip),
                    _ => self.sctp.push(vip),
                }
            }
        }
        self.count = count;
        Ok(())
    }
}

fn clear_conntrack(maps: &mut Maps) -> Result<()> {
    let keys: Vec<CtKey> = maps.conntrack.keys().collect::<Result<_, _>>()?;
    for k in &keys {
        maps.conntrack.remove(k)?;
    }
    Ok(())
}

pub fn proto_name(proto: u8) -> &'static str {
    match proto {
        IPPROTO_TCP => "TCP",
        IPPROTO_UDP => "UDP",
        _ => "SCTP",
    }
}

/// (Service port, targetPort) of each protocol.
fn ports(proto: u8) -> (u16, u16) {
    match proto {
        IPPROTO_TCP => (TCP_PORT, TCP_TARGET),
        IPPROTO_UDP => (UDP_PORT, UDP_TARGET),
        _ => (SCTP_PORT, SCTP_TARGET),
    }
}

/// The ping-pong pair: A's endpoint is B and B's is A (ports 80 <-> 8080,
/// 53 <-> 5353, 2905 <-> 3905).
const PING_VIP: [u8; 4] = [10, 95, 255, 1];
const PONG_VIP: [u8; 4] = [10, 95, 255, 2];

fn client_of(n: u32) -> ([u8; 4], u16) {
    ((u32::from_be_bytes([10, 200, 0, 0]) + n / 50_000).to_be_bytes(), 10_000 + (n % 50_000) as u16)
}

/// Steady-state runs are this many batches of `repeat` runs; the median
/// batch is kept, so a burst of load from other processes on the machine
/// during one batch does not move the figure.
pub const BATCHES: usize = 5;

/// A frame to the ping Service run `repeat` times per batch: two new flows
/// (ping, then pong) in the first batch, established ones after; the median
/// of the batches' kernel averages per run.
fn steady(ebpf: &Ebpf, maps: &Maps, proto: u8, client: u32, repeat: u32) -> Result<f64> {
    ensure!(repeat % 2 == 0 && repeat >= 2, "repeat {repeat}: the ping-pong needs an even number of runs");
    let client = client_of(client);
    let (ping, pong) = ((PING_VIP, ports(proto).0), (PONG_VIP, ports(proto).1));
    // Open and confirm both flows: the opening to A comes out addressed to
    // B, and run again opens the flow to B (whose backend is A).
    let (verdict, _, to_pong) = test_run(ebpf, &opening(proto, client, ping))?;
    ensure!(verdict == TC_ACT_OK, "ping-pong opening verdict {verdict:#x}");
    ensure!(test_run(ebpf, &to_pong)?.0 == TC_ACT_OK, "ping-pong second opening refused");
    confirm(ebpf, proto, client, ping, pong)?;
    confirm(ebpf, proto, client, pong, ping)?;
    let f = frame(proto, client, ping);
    let before = maps.read_counters()?;
    let prog: &SchedClassifier = ebpf.program(TC_INGRESS).unwrap().try_into()?;
    let mut batches = Vec::with_capacity(BATCHES);
    for _ in 0..BATCHES {
        let mut out = vec![0u8; f.len() + 64];
        let res = prog.test_run(TestRunOptions { data_in: Some(&f), data_out: Some(&mut out), repeat, ..TestRunOptions::new() })?;
        if res.return_value != TC_ACT_OK {
            // Which counters moved says why the program dropped or passed it.
            let after = maps.read_counters()?;
            let moved: Vec<String> = Counter::ALL
                .iter()
                .filter(|c| after[**c as usize] != before[**c as usize])
                .map(|c| format!("{} +{}", c.name(), after[*c as usize] - before[*c as usize]))
                .collect();
            bail!("ping-pong Services verdict {:#x} (counters: {})", res.return_value, moved.join(", "));
        }
        // An even number of runs leaves the frame addressed to A again.
        check_translated(&out[..f.len()], ports(proto).0).context("ping-pong Services")?;
        batches.push(res.duration.as_nanos() as f64);
    }
    let after = maps.read_counters()?;
    let moved = |c: Counter| after[c as usize] - before[c as usize];
    let runs = u64::from(repeat) * BATCHES as u64;
    ensure!(
        moved(Counter::NewFlow) == 0 && moved(Counter::Established) == runs,
        "ping-pong Services: {} new and {} established runs, want 0 and {}",
        moved(Counter::NewFlow),
        moved(Counter::Established),
        runs
    );
    Ok(median(&batches))
}

fn floor(ebpf: &Ebpf, samples: usize) -> Result<Vec<f64>> {
    let arp = arp_frame();
    let mut ns = Vec::with_capacity(samples);
    for _ in 0..samples {
        let (verdict, d, _) = test_run(ebpf, &arp)?;
        ensure!(verdict == TC_ACT_UNSPEC, "ARP frame verdict {verdict:#x}");
        ns.push(d.as_nanos() as f64);
    }
    Ok(ns)
}

/// The steady state's floor: the ARP frame, which the program leaves at
/// once and unchanged, run `repeat` times per batch; the median of the
/// batches' kernel averages per run.
fn steady_floor(ebpf: &Ebpf, repeat: u32) -> Result<f64> {
    let arp = arp_frame();
    let prog: &SchedClassifier = ebpf.program(TC_INGRESS).unwrap().try_into()?;
    let mut batches = Vec::with_capacity(BATCHES);
    for _ in 0..BATCHES {
        let mut out = vec![0u8; arp.len() + 64];
        let res = prog.test_run(TestRunOptions { data_in: Some(&arp), data_out: Some(&mut out), repeat, ..TestRunOptions::new() })?;
        ensure!(res.return_value == TC_ACT_UNSPEC, "ARP frame verdict {:#x}", res.return_value);
        batches.push(res.duration.as_nanos() as f64);
    }
    Ok(median(&batches))
}

/// Runs `frame` once; the verdict, the kernel's duration and the frame out.
fn test_run(ebpf: &Ebpf, frame: &[u8]) -> Result<(u32, Duration, Vec<u8>)> {
    let prog: &SchedClassifier = ebpf.program(TC_INGRESS).unwrap().try_into()?;
    let mut out = vec![0u8; frame.len() + 64];
    let res = prog.test_run(TestRunOptions { data_in: Some(frame), data_out: Some(&mut out), ..TestRunOptions::new() })?;
    out.truncate(frame.len());
    Ok((res.return_value, res.duration, out))
}

/// A frame out of the program has the destination port it should have
/// after the rewrite, a valid IPv4 checksum and a valid L4 checksum (for
/// SCTP, the CRC32c the reference computes): the measured path did the
/// whole rewrite, checksums included.
fn check_translated(frame: &[u8], want_dport: u16) -> Result<()> {
    let (_, dport) = frames::ports(frame).context("no TCP, UDP or SCTP header in the frame out")?;
    ensure!(dport == want_dport, "destination port {dport} out, want {want_dport}");
    frames::check_checksums(frame).map_err(|e| anyhow::anyhow!("after the rewrite: {e}"))
}

/// The client's packet that opens a flow: a TCP SYN, an SCTP INIT, a UDP
/// datagram.
fn opening(proto: u8, src: ([u8; 4], u16), dst: ([u8; 4], u16)) -> Vec<u8> {
    match proto {
        IPPROTO_SCTP => frames::sctp_frame(src, dst, 0, &[chunk::init(SCTP_TAG)]),
        IPPROTO_TCP => frames::tcp_syn(src, dst),
        _ => frame(proto, src, dst),
    }
}

/// Confirms the flow `client` opened to `frontend`, served by `backend`:
/// the backend's answer (SYN-ACK, INIT-ACK, a datagram) and, for TCP, the
/// client's ACK of it, which completes the handshake.
fn confirm(ebpf: &Ebpf, proto: u8, client: ([u8; 4], u16), frontend: ([u8; 4], u16), backend: ([u8; 4], u16)) -> Result<()> {
    let answer = match proto {
        IPPROTO_SCTP => frames::sctp_frame(backend, client, SCTP_TAG, &[chunk::init_ack(SCTP_TAG, &[0; 8])]),
        IPPROTO_TCP => frames::tcp_syn_ack(backend, client),
        _ => frames::udp(backend, client, &[0x5a; 32]),
    };
    ensure!(test_run(ebpf, &answer)?.0 == TC_ACT_OK, "the backend's answer to a {} opening refused", proto_name(proto));
    if proto == IPPROTO_TCP {
        // tcp_syn_ack's sequence is 5000000.
        let ack = frames::tcp_ack(client, frontend, 5_000_001);
        ensure!(test_run(ebpf, &ack)?.0 == TC_ACT_OK, "the client's ACK of the handshake refused");
    }
    Ok(())
}

/// The IPv4 destination and port of a frame out of the program.
fn destination(frame: &[u8]) -> Result<([u8; 4], u16)> {
    let (_, port) = frames::ports(frame).context("no ports in the frame out")?;
    let ip = frame.get(frames::ETH_HLEN + 16..frames::ETH_HLEN + 20).context("short frame out")?;
    Ok((ip.try_into()?, port))
}

/// The SCTP verification tag of the micro-benchmark's associations.
const SCTP_TAG: u32 = 0x1122_3344;

/// A flow's packet after its opening: TCP data with ACK, a UDP datagram or
/// an SCTP DATA chunk, 32 bytes of payload.
fn frame(proto: u8, src: ([u8; 4], u16), dst: ([u8; 4], u16)) -> Vec<u8> {
    let payload = [0x5au8; 32];
    match proto {
        IPPROTO_SCTP => frames::sctp_frame(src, dst, SCTP_TAG, &[chunk::data(1, &payload)]),
        IPPROTO_TCP => frames::tcp_data(src, dst, &payload),
        _ => frames::udp(src, dst, &payload),
    }
}

/// What the program leaves at once: the floor of the method.
fn arp_frame() -> Vec<u8> {
    frames::arp_request([10, 200, 0, 1], [10, 96, 0, 1])
}

pub fn median(v: &[f64]) -> f64 {
    percentile(v, 0.5)
}

pub fn percentile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    s[((s.len() - 1) as f64 * q).round() as usize]
}
