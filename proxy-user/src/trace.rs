//! `ebpf-proxy trace`: what the dataplane would do with one packet. The real
//! program logic (`tc_trace`, the ingress path compiled in report mode) runs
//! on a synthetic packet against the live pinned maps through
//! BPF_PROG_TEST_RUN; it changes no conntrack, affinity or counter, and
//! reports what it decided in the skb's control block.

use std::{
    net::{IpAddr, SocketAddr},
    path::Path,
    str::FromStr,
};

use anyhow::{Context, Result, bail};
use aya::{
    maps::Array,
    programs::{SchedClassifier, TestRun, TestRunOptions},
};
use etherparse::{NetHeaders, PacketBuilder, PacketHeaders, TransportHeader};
use proxy_common::*;
use serde::Serialize;

use crate::{
    dump::{Output, kind_name, protocol_name},
    maps::{self, TC_TRACE},
};

const TC_ACT_OK: u32 = 0;
const TC_ACT_SHOT: u32 = 2;
const TC_ACT_REDIRECT: u32 = 7;
/// The source port used when `--from` names none.
const DEFAULT_SOURCE_PORT: u16 = 40000;

/// `IP:PORT/PROTO`, e.g. `10.96.0.10:80/TCP`.
#[derive(Debug, Clone, Copy)]
pub struct Destination {
    pub addr: SocketAddr,
    pub proto: u8,
}

impl FromStr for Destination {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (addr, proto) = s.rsplit_once('/').ok_or("expected IP:PORT/PROTO, e.g. 10.96.0.10:80/TCP")?;
        let proto = match proto.to_ascii_uppercase().as_str() {
            "TCP" => IPPROTO_TCP,
            "UDP" => IPPROTO_UDP,
            "SCTP" => IPPROTO_SCTP,
            other => return Err(format!("unknown protocol {other:?} (TCP, UDP or SCTP)")),
        };
        let addr = addr.parse().map_err(|e| format!("{addr:?}: {e}"))?;
        Ok(Destination { addr, proto })
    }
}

/// `IP` or `IP:PORT`.
#[derive(Debug, Clone, Copy)]
pub struct Source(pub SocketAddr);

impl FromStr for Source {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if let Ok(addr) = s.parse::<SocketAddr>() {
            return Ok(Source(addr));
        }
        let ip: IpAddr = s.parse().map_err(|e| format!("{s:?}: {e} (expected IP or IP:PORT)"))?;
        Ok(Source(SocketAddr::new(ip, DEFAULT_SOURCE_PORT)))
    }
}

#[derive(Debug, Serialize)]
pub struct Trace {
    pub packet: String,
    /// ACCEPT (translated), REJECT, DROP, or PASS (not a service: left to the kernel).
    pub verdict: &'static str,
    pub reason: String,
    pub service: Option<String>,
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub scope: Option<String>,
    /// For a flow conntrack already holds, its backend; for a new flow the
    /// backend this run drew, one of `candidates`.
    pub backend: Option<String>,
    pub candidates: Vec<String>,
    pub masquerade: bool,
    pub existing_flow: bool,
    /// Every datapath counter the packet would have moved.
    pub counters: Vec<&'static str>,
}

pub fn print(from: Source, to: Destination, output: Output, root: &Path) -> Result<()> {
    let t = trace(from, to, root)?;
    match output {
        Output::Json => println!("{}", serde_json::to_string_pretty(&t)?),
        Output::Table => {
            println!("packet      {}", t.packet);
            println!("verdict     {} ({})", t.verdict, t.reason);
            if let Some(s) = &t.service {
                println!("service     {s} ({}, {} scope)", t.kind.as_deref().unwrap_or("?"), t.scope.as_deref().unwrap_or("?"));
            }
            if let Some(b) = &t.backend {
                let how = if t.existing_flow { "existing flow" } else { "new flow, chosen at random" };
                println!("backend     {b} ({how})");
            }
            if !t.candidates.is_empty() {
                println!("candidates  {}", t.candidates.join(", "));
            }
            if t.verdict == "ACCEPT" && !t.existing_flow || t.masquerade {
                println!("masquerade  {}", if t.masquerade { "yes (the backend sees a node address)" } else { "no (the backend sees the client)" });
            }
            println!("counters    {}", t.counters.join(", "));
        }
    }
    Ok(())
}

pub fn trace(from: Source, to: Destination, root: &Path) -> Result<Trace> {
    let (IpAddr::V4(src), IpAddr::V4(dst)) = (from.0.ip(), to.addr.ip()) else {
        bail!("trace: IPv4 addresses only for now (the IPv6 programs are reached from real packets; see docs/ipv6.md)");
    };
    // Adopt the live maps; never create them: an empty dataplane would answer "PASS".
    let frontends = root.join(MAP_FRONTENDS);
    anyhow::ensure!(
        frontends.exists(),
        "no pinned maps under {} (is --bpffs-root right, and has the agent run on this node?)",
        root.display()
    );
    let (mut ebpf, maps) = maps::load(root)?;
    maps::load_tc(&mut ebpf, TC_TRACE)?;
    let prog: &mut SchedClassifier = ebpf.program_mut(TC_TRACE).context("tc_trace missing from the BPF object")?.try_into()?;

    let frame = synthetic_frame(src.octets(), from.0.port(), dst.octets(), to.addr.port(), to.proto)?;
    let mut out = vec![0u8; frame.len() + 256];
    let res = prog
        .test_run(TestRunOptions { data_in: Some(&frame), data_out: Some(&mut out), ..TestRunOptions::new() })
        .context("BPF_PROG_TEST_RUN")?;
    out.truncate(res.data_size_out as usize);
    let report: Array<_, TraceReport> = ebpf.take_map(MAP_TRACE_REPORT).context("trace report map")?.try_into()?;
    let report = report.get(&0, 0)?;
    let noted = report.counters;
    let counters: Vec<&'static str> = (0..COUNTER_NAMES.len()).filter(|i| noted & (1 << i) != 0).map(|i| COUNTER_NAMES[i]).collect();
    let has = |c: Counter| noted & (1 << c as u32) != 0;
    let (service_id, backend_id, how) = (report.service_id, report.backend_id, report.how);
    let existing_flow = how == TRACE_FROM_CONNTRACK;

    let contents = maps.read_contents()?;
    let name = |id: u32| contents.names.get(&id).map(|(n, _)| n.clone());
    let addr_of = |b: &Backend| SocketAddr::new(b.addr.to_ip(), u16::from_be(b.port)).to_string();
    let reached_service = service_id != 0 || existing_flow;
    let (kind, scope) = if reached_service && !existing_flow {
        let key = FrontendKey { addr: Addr::from(IpAddr::V4(dst)), port: to.addr.port().to_be(), proto: to.proto, scope: how as u8 };
        let kind = contents.frontends.get(&key).map(|e| kind_name(e.kind).to_string());
        (kind, Some(if how as u8 == SCOPE_EXTERNAL { "external" } else { "internal" }.to_string()))
    } else {
        (None, None)
    };
    let candidates = match contents.frontends.values().find(|e| e.service_id == service_id && service_id != 0) {
        Some(e) if !existing_flow => (0..e.backend_count)
            .filter_map(|slot| contents.slots.get(&SlotKey { service_id, slot }))
            .filter_map(|id| contents.backends.get(id))
            .map(addr_of)
            .collect(),
        _ => Vec::new(),
    };
    let backend = (backend_id != 0).then(|| contents.backends.get(&backend_id).map(addr_of)).flatten();
    // What the packet left the program as (for a DNAT, the backend it was sent to).
    debug_assert!(res.return_value != TC_ACT_OK || describe(&out).is_some());

    let (verdict, reason) = match res.return_value {
        TC_ACT_OK if has(Counter::Reply) => ("ACCEPT", "reply of a tracked flow, reverse-translated".to_string()),
        TC_ACT_OK if existing_flow => ("ACCEPT", "tracked flow, same backend".to_string()),
        TC_ACT_OK => ("ACCEPT", "new flow, DNAT to a backend".to_string()),
        TC_ACT_REDIRECT if has(Counter::NoBackend) => ("REJECT", "the service has no usable endpoint".to_string()),
        TC_ACT_REDIRECT => ("REJECT", "a ClusterIP on a port it does not serve".to_string()),
        TC_ACT_SHOT if has(Counter::DropUnallocated) => ("DROP", "unallocated address in the service CIDR".to_string()),
        TC_ACT_SHOT if has(Counter::DropSourceRange) => ("DROP", "source outside loadBalancerSourceRanges".to_string()),
        TC_ACT_SHOT if has(Counter::DropNoLocal) => ("DROP", "Local traffic policy and no local endpoint".to_string()),
        TC_ACT_SHOT => ("DROP", format!("datapath error ({})", counters.join(", "))),
        _ => ("PASS", "not a service address: left to the kernel".to_string()),
    };
    Ok(Trace {
        packet: format!("{} -> {}/{}", from.0, to.addr, protocol_name(to.proto)),
        verdict,
        reason,
        service: reached_service.then(|| name(service_id)).flatten(),
        kind,
        scope,
        backend,
        candidates,
        masquerade: has(Counter::Masqueraded),
        existing_flow,
        counters,
    })
}

/// A TCP SYN or a small UDP datagram, as a client would send it.
fn synthetic_frame(src: [u8; 4], sport: u16, dst: [u8; 4], dport: u16, proto: u8) -> Result<Vec<u8>> {
    let ip = PacketBuilder::ethernet2([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2]).ipv4(src, dst, 64);
    let mut v = Vec::new();
    match proto {
        IPPROTO_TCP => ip.tcp(sport, dport, 1, 64240).syn().write(&mut v, &[])?,
        IPPROTO_UDP => ip.udp(sport, dport).write(&mut v, b"trace")?,
        _ => bail!("trace: {} is not translated by the datapath yet", protocol_name(proto)),
    }
    Ok(v)
}

/// Where a translated frame now goes, e.g. "10.244.0.11:8080".
fn describe(frame: &[u8]) -> Option<String> {
    let h = PacketHeaders::from_ethernet_slice(frame).ok()?;
    let Some(NetHeaders::Ipv4(ip, _)) = h.net else { return None };
    let port = match h.transport? {
        TransportHeader::Tcp(t) => t.destination_port,
        TransportHeader::Udp(u) => u.destination_port,
        _ => return None,
    };
    Some(SocketAddr::from((ip.destination, port)).to_string())
}
