//! Real traffic through a node namespace: a client pod (to the ClusterIP), an
//! external host on the node's LAN (to the NodePort on the node's address), a
//! backend pod with the probe Service's 10 endpoint addresses, and between
//! them, in turn,
//! ebpf-proxy, kube-proxy's nftables rules, kube-proxy's iptables rules (the
//! nf_tables backend Debian's `iptables` uses, and the legacy one), and no
//! proxy at all (the client dials the endpoints itself: the ceiling). Each
//! peer has its own topology (netfilter hooks and TC programs are per
//! namespace, so peers never see each other's traffic), all set up at once;
//! then each load runs in rounds that visit every peer in turn, so a burst of
//! background load hits all peers alike, and the median of the rounds counts.

use std::{
    io::Write as _,
    net::{Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    process::Stdio,
    time::{Duration, Instant},
};

use anyhow::{Result, ensure};
use proxy_tests::{
    agent::Agent,
    bench::{
        load::{self, Load, Mode, Server},
        rules,
        services::{ServiceSet, TCP_NODE_PORT, TCP_PORT, TCP_TARGET, UDP_NODE_PORT, UDP_PORT, UDP_TARGET},
    },
    bpffs::Bpffs,
    cgroup::Cgroup,
    netns::Netns,
    topology::{External, Node, Pod},
};

pub const SCALES: [usize; 2] = [1, 10_000];
const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(10, 244, 0, 2);
pub(super) const NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 0, 2);
const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 2);
/// Given to the agent as to the rule sets: pod sources are not masqueraded.
const AGENT_FLAGS: [&str; 2] = ["--cluster-cidr", rules::CLUSTER_CIDR];
const CLIENT_THREADS: usize = 4;
const SERVER_THREADS: usize = 4;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Peer {
    EbpfProxy,
    Nftables,
    IptablesNft,
    IptablesLegacy,
    NoProxy,
}

impl Peer {
    pub const ALL: [Peer; 5] = [Peer::EbpfProxy, Peer::Nftables, Peer::IptablesNft, Peer::IptablesLegacy, Peer::NoProxy];

    pub fn label(self) -> &'static str {
        match self {
            Peer::EbpfProxy => "ebpf-proxy",
            Peer::Nftables => "nftables (kube-proxy)",
            Peer::IptablesNft => "iptables-nft (kube-proxy)",
            Peer::IptablesLegacy => "iptables-legacy (kube-proxy)",
            Peer::NoProxy => "no proxy",
        }
    }
}

/// How the traffic reaches the Service: a pod to its ClusterIP, or a host
/// outside the cluster to its NodePort on the node's address (masqueraded,
/// externalTrafficPolicy Cluster).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    ClusterIp,
    NodePort,
}

impl Kind {
    pub const ALL: [Kind; 2] = [Kind::ClusterIp, Kind::NodePort];
    pub fn label(self) -> &'static str {
        match self {
            Kind::ClusterIp => "ClusterIP",
            Kind::NodePort => "NodePort",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Row {
    pub services: usize,
    pub kind: Kind,
    pub peer: Peer,
    pub mode: Mode,
    /// Median over the rounds.
    pub rate: f64,
    pub rounds: Vec<f64>,
    pub errors: u64,
}

#[derive(Clone, Debug, Default)]
pub struct Results {
    pub rows: Vec<Row>,
    /// Time to program each peer's rules or maps, per scale.
    pub setup: Vec<(usize, Peer, Duration)>,
    pub warmup: Duration,
    pub window: Duration,
    pub rounds: usize,
    pub client_threads: usize,
}

impl Results {
    pub fn rate(&self, services: usize, kind: Kind, peer: Peer, mode: Mode) -> Option<f64> {
        self.rows
            .iter()
            .find(|r| r.services == services && r.kind == kind && r.peer == peer && r.mode == mode)
            .map(|r| r.rate)
    }
}

pub fn run(work: &Path, warmup: Duration, window: Duration, rounds: usize) -> Result<Results> {
    let mut out = Results { warmup, window, rounds, client_threads: CLIENT_THREADS, ..Results::default() };
    for &scale in &SCALES {
        let set = ServiceSet::new(scale);
        let PeerFiles { manifests, ipt, nft } = PeerFiles::write(&set, &work.join(format!("traffic-{scale}")))?;
        // Every peer in place at once, each in its own namespaces.
        let mut benches = Vec::new();
        for peer in Peer::ALL {
            eprintln!("    traffic: {scale} services: programming {}", peer.label());
            let bench = Bench::new()?;
            let t = Instant::now();
            let proxy = bench.program(peer, &manifests, &ipt, &nft)?;
            out.setup.push((scale, peer, t.elapsed()));
            // The agent goes before its namespaces when these drop.
            benches.push((peer, proxy, bench));
        }
        let probe = set.probe();
        for kind in Kind::ALL {
            for mode in Mode::ALL {
                let tcp = mode.is_tcp();
                let target = if tcp { TCP_TARGET } else { UDP_TARGET };
                let service = match kind {
                    Kind::ClusterIp => SocketAddr::from((probe.cluster_ip, if tcp { TCP_PORT } else { UDP_PORT })),
                    Kind::NodePort => SocketAddr::from((NODE_IP, if tcp { TCP_NODE_PORT } else { UDP_NODE_PORT })),
                };
                let mut rates = vec![Vec::new(); benches.len()];
                let mut errors = vec![0u64; benches.len()];
                for round in 0..rounds {
                    // A different peer goes first each round.
                    for k in 0..benches.len() {
                        let i = (k + round) % benches.len();
                        let (peer, _, bench) = &benches[i];
                        let targets: Vec<SocketAddr> = match peer {
                            Peer::NoProxy => probe.endpoints.iter().map(|ip| SocketAddr::from((*ip, target))).collect(),
                            _ => vec![service],
                        };
                        let client = match kind {
                            Kind::ClusterIp => &bench.client.ns,
                            Kind::NodePort => &bench.external.ns,
                        };
                        let l = Load { mode, targets, threads: CLIENT_THREADS, warmup, window };
                        let o = load::run(client, &l, &|| bench.server.received())?;
                        ensure!(
                            o.ops > 0,
                            "{} {} {} at {scale} services: no traffic got through",
                            peer.label(),
                            kind.label(),
                            mode.label()
                        );
                        rates[i].push(o.rate());
                        errors[i] += o.errors;
                    }
                }
                for (i, (peer, _, _)) in benches.iter().enumerate() {
                    let rate = super::micro::median(&rates[i]);
                    eprintln!(
                        "      {:<9} {:<32} {:<30} {:>10.0}  rounds {:?}",
                        kind.label(),
                        mode.label(),
                        peer.label(),
                        rate,
                        rates[i].iter().map(|r| *r as u64).collect::<Vec<_>>()
                    );
                    out.rows.push(Row {
                        services: scale,
                        kind,
                        peer: *peer,
                        mode,
                        rate,
                        rounds: rates[i].clone(),
                        errors: errors[i],
                    });
                }
            }
        }
    }
    Ok(out)
}

/// What programs each peer: the agent's manifests, kube-proxy's iptables
/// and nftables rule sets, for one set of Services.
pub(super) struct PeerFiles {
    pub manifests: PathBuf,
    pub ipt: PathBuf,
    pub nft: PathBuf,
}

impl PeerFiles {
    pub fn write(set: &ServiceSet, dir: &Path) -> Result<PeerFiles> {
        let files = PeerFiles { manifests: dir.join("manifests"), ipt: dir.join("iptables.rules"), nft: dir.join("kube-proxy.nft") };
        set.write_manifests(&files.manifests, 1000)?;
        std::fs::write(&files.ipt, rules::iptables_restore(set))?;
        std::fs::write(&files.nft, rules::nftables_script(set))?;
        Ok(files)
    }
}

/// The topology of one measurement.
struct Bench {
    // Drop order: the server and pods go before the node.
    server: Server,
    client: Pod,
    external: External,
    _backend: Pod,
    node: Node,
}

impl Bench {
    fn new() -> Result<Bench> {
        let (mut node, backend, external) = probe_topology("bench")?;
        let client = node.add_pod("client", CLIENT_IP)?;
        let endpoints = proxy_tests::bench::services::probe_endpoints();
        let server = Server::start(&backend.ns, TCP_TARGET, SERVER_THREADS, &endpoints, UDP_TARGET)?;
        Ok(Bench { server, client, external, _backend: backend, node })
    }

    fn program(&self, peer: Peer, manifests: &Path, ipt: &Path, nft: &Path) -> Result<Option<(Agent, Bpffs, Cgroup)>> {
        program(&self.node.ns, peer, manifests, ipt, nft, &[])
    }
}

/// A node with the probe Service's backend pod (every endpoint address on
/// it, routed to its veth) and an external host on the node's LAN.
pub(super) fn probe_topology(label: &str) -> Result<(Node, Pod, External)> {
    let mut node = Node::new(label)?;
    let endpoints = proxy_tests::bench::services::probe_endpoints();
    let backend = node.add_pod("backend", endpoints[0])?;
    for ip in &endpoints[1..] {
        backend.ns.ip(&["addr", "add", &format!("{ip}/32"), "dev", "eth0"])?;
        node.ns.ip(&["route", "add", &format!("{ip}/32"), "dev", &backend.host_if])?;
    }
    // Pods are reachable from outside only for the no-proxy ceiling.
    let external = node.add_external("external", NODE_IP, &[EXTERNAL_IP], &["10.244.0.0/16"])?;
    Ok((node, backend, external))
}

/// Puts `peer` in place in the node namespace `ns`; for ebpf-proxy, the
/// agent, its bpffs and the cgroup for its socket hooks, kept while it is
/// measured (rules go with the node namespace). `agent_flags` go to the
/// agent only.
pub(super) fn program(
    ns: &Netns,
    peer: Peer,
    manifests: &Path,
    ipt: &Path,
    nft: &Path,
    agent_flags: &[&str],
) -> Result<Option<(Agent, Bpffs, Cgroup)>> {
    match peer {
        Peer::EbpfProxy => {
            let bpffs = Bpffs::new("bench-traffic")?;
            // The socket hooks go on an empty cgroup of their own: the
            // load generator and every other process on the machine stay
            // outside them, so all traffic here takes the TC path.
            let cgroup = Cgroup::new("bench-traffic")?;
            let mut flags = AGENT_FLAGS.to_vec();
            let cg = cgroup.path().to_string_lossy().into_owned();
            flags.extend(["--cgroup-root", &cg]);
            flags.extend_from_slice(agent_flags);
            let mut agent = Agent::start(ns, manifests, &bpffs.path().join("ebpf-proxy"), &flags)?;
            agent.wait_healthy(ns, Duration::from_secs(300))?;
            Ok(Some((agent, bpffs, cgroup)))
        }
        Peer::Nftables => {
            feed(ns.command("nft").args(["-f", "-"]), nft)?;
            Ok(None)
        }
        Peer::IptablesNft => {
            feed(ns.command("iptables-nft-restore").arg("-w"), ipt)?;
            Ok(None)
        }
        Peer::IptablesLegacy => {
            feed(ns.command("iptables-legacy-restore").arg("-w"), ipt)?;
            Ok(None)
        }
        Peer::NoProxy => Ok(None),
    }
}

/// Runs `cmd` with the file on its standard input.
fn feed(cmd: &mut std::process::Command, file: &Path) -> Result<()> {
    let text = std::fs::read(file)?;
    let mut child = cmd.stdin(Stdio::piped()).stdout(Stdio::null()).stderr(Stdio::piped()).spawn()?;
    child.stdin.take().unwrap().write_all(&text)?;
    let out = child.wait_with_output()?;
    ensure!(out.status.success(), "{cmd:?} < {}: {}", file.display(), String::from_utf8_lossy(&out.stderr).trim());
    Ok(())
}

