//! Spoofed SYN floods against a NodePort: how many SYNs a second the node
//! absorbs before an established flow through the same NodePort loses a
//! packet, for ebpf-proxy and for kube-proxy's nftables rules (the kernel's
//! conntrack) in the same run. At each rate in turn, for one window: a busy
//! TCP stream and a steady UDP flow (tests/src/flows.rs) and idle TCP
//! connections, all through the NodePort from the external host, while the
//! flood comes from that host too. A rate is held when no datagram was lost,
//! the stream neither stalled nor reset, and every idle connection still
//! answers. The ramp stops at the first rate not held.

use std::{
    net::{SocketAddr, SocketAddrV4, TcpStream},
    path::Path,
    time::Duration,
};

use anyhow::Result;
use proxy_tests::{
    bench::services::{ServiceSet, TCP_NODE_PORT, TCP_TARGET, UDP_NODE_PORT, UDP_TARGET},
    flood::spoofed_syns,
    flows::{RawEcho, SteadyFlows, echo_round_trip},
    netns::Netns,
};

use super::traffic::{NODE_IP, Peer, PeerFiles, probe_topology, program};

pub const PEERS: [Peer; 2] = [Peer::EbpfProxy, Peer::Nftables];
/// Connections idle through each window.
pub const IDLE: usize = 16;

pub struct Step {
    /// SYNs a second asked for, and sent.
    pub rate: u32,
    pub sent_rate: f64,
    pub held: bool,
    /// What broke, if anything.
    pub broke: String,
}

pub struct Row {
    pub peer: Peer,
    pub steps: Vec<Step>,
}

impl Row {
    /// The highest rate held, if any.
    pub fn absorbed(&self) -> Option<f64> {
        self.steps.iter().filter(|s| s.held).map(|s| s.sent_rate).reduce(f64::max)
    }

    /// Every rate held: the figure is the sender's ceiling, not the peer's.
    pub fn never_broke(&self) -> bool {
        self.steps.iter().all(|s| s.held)
    }

    /// The absorbed rate in words.
    pub fn shown(&self) -> String {
        match self.absorbed() {
            None => "none of the rates".to_string(),
            Some(r) if self.never_broke() => format!("{r:.0} SYN/s or more (every rate held: the sender's ceiling)"),
            Some(r) => format!("{r:.0} SYN/s"),
        }
    }
}

pub struct Results {
    pub window: Duration,
    pub rows: Vec<Row>,
}

pub fn run(work: &Path, window: Duration, rates: &[u32]) -> Result<Results> {
    let PeerFiles { manifests, ipt, nft } = PeerFiles::write(&ServiceSet::new(1), &work.join("flood"))?;
    let mut rows = Vec::new();
    for peer in PEERS {
        let (node, backend, external) = probe_topology("flood")?;
        let endpoints = proxy_tests::bench::services::probe_endpoints();
        let _echo = RawEcho::start_on(&backend.ns, TCP_TARGET, UDP_TARGET, &endpoints)?;
        let _proxy = program(&node.ns, peer, &manifests, &ipt, &nft, &[])?;
        let mut steps = Vec::new();
        for &rate in rates {
            let step = step(&external.ns, rate, window)?;
            eprintln!(
                "    flood: {:<22} {:>7} SYN/s asked, {:>9.0} sent: {}",
                peer.label(),
                rate,
                step.sent_rate,
                if step.held { "held".to_string() } else { format!("lost ({})", step.broke) }
            );
            let held = step.held;
            steps.push(step);
            if !held {
                break;
            }
        }
        rows.push(Row { peer, steps });
    }
    let (ours, theirs) = (rows[0].absorbed(), rows[1].absorbed());
    eprintln!(
        "    flood: absorbed before an established flow lost a packet: ebpf-proxy {}, nftables {}{}",
        rows[0].shown(),
        rows[1].shown(),
        match (ours, theirs) {
            (Some(a), Some(b)) if b > 0.0 => format!(" (ratio {:.2})", a / b),
            _ => String::new(),
        }
    );
    Ok(Results { window, rows })
}

fn step(client: &Netns, rate: u32, window: Duration) -> Result<Step> {
    let tcp_to = SocketAddr::from((NODE_IP, TCP_NODE_PORT));
    let flows = SteadyFlows::start(client, tcp_to, SocketAddr::from((NODE_IP, UDP_NODE_PORT)))?;
    flows.wait_progress(flows.progress(), 20)?;
    let mut idle = Vec::new();
    for i in 0..IDLE {
        let mut conn = client.run(move || TcpStream::connect_timeout(&tcp_to, Duration::from_secs(2)))??;
        round_trip(&mut conn, i)?;
        idle.push(conn);
    }
    let count = (f64::from(rate) * window.as_secs_f64()) as u32;
    let took = spoofed_syns(client, SocketAddrV4::new(NODE_IP, TCP_NODE_PORT), count, Some(rate))?;
    let mut broke = Vec::new();
    let reset = idle.iter_mut().enumerate().map(|(i, c)| round_trip(c, i)).filter(Result::is_err).count();
    if reset > 0 {
        broke.push(format!("{reset} of {IDLE} idle connections"));
    }
    let report = flows.finish();
    if !report.udp_lost.is_empty() {
        broke.push(format!("{} of {} datagrams", report.udp_lost.len(), report.udp_sent));
    }
    if !report.errors.is_empty() {
        broke.push(format!("TCP stream: {}", report.errors.join("; ")));
    }
    Ok(Step { rate, sent_rate: f64::from(count) / took.as_secs_f64(), held: broke.is_empty(), broke: broke.join(", ") })
}

fn round_trip(conn: &mut TcpStream, i: usize) -> Result<()> {
    echo_round_trip(conn, &format!("idle {i}\n"))
}
