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
use etherparse::{IpNumber, NetHeaders, PacketBuilder, PacketHeaders, PayloadSlice, TransportHeader};
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
    /// How the service picks a new flow's backend: `random` or `maglev`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub algorithm: Option<&'static str>,
    /// A new flow's cell of the Maglev table (`flow hash % table size`),
    /// when the backend came from it (not from the client's affinity).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub maglev_cell: Option<u32>,
    /// The table size the cell is taken modulo.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub maglev_table_size: Option<u32>,
    pub masquerade: bool,
    /// For a masqueraded flow: the ports masquerade holds, and how often it
    /// ran out (as `dump conntrack` ends with).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub masquerade_ports: Option<String>,
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
                let how = match (t.existing_flow, t.maglev_cell, t.algorithm) {
                    (true, _, _) => "existing flow".to_string(),
                    (false, Some(cell), _) => format!("new flow, Maglev cell {cell} of {}", t.maglev_table_size.unwrap_or(0)),
                    (false, None, Some("maglev")) => "new flow, the client's affinity".to_string(),
                    (false, None, _) => "new flow, chosen at random".to_string(),
                };
                println!("backend     {b} ({how})");
            }
            if !t.candidates.is_empty() {
                println!("candidates  {}", t.candidates.join(", "));
            }
            if t.verdict == "ACCEPT" && !t.existing_flow || t.masquerade {
                println!("masquerade  {}", if t.masquerade { "yes (the backend sees a node address)" } else { "no (the backend sees the client)" });
            }
            if let Some(ports) = &t.masquerade_ports {
                println!("            {ports}");
            }
            println!("counters    {}", t.counters.join(", "));
        }
    }
    Ok(())
}

pub fn trace(from: Source, to: Destination, root: &Path) -> Result<Trace> {
    let (src, dst) = (from.0.ip(), to.addr.ip());
    anyhow::ensure!(src.is_ipv4() == dst.is_ipv4(), "trace: --from {src} and --to {dst} are of different IP families");
    // Adopt the live maps; never create them: an empty dataplane would answer "PASS".
    let frontends = root.join(MAP_FRONTENDS);
    anyhow::ensure!(
        frontends.exists(),
        "no pinned maps under {} (is --bpffs-root right, and has the agent run on this node?)",
        root.display()
    );
    let (mut ebpf, maps) = maps::load(root)?;
    let maglev_table_size = maps.maglev_settings.get(&MAGLEV_SETTING_TABLE_SIZE, 0)?;
    maps::load_tc(&mut ebpf, TC_TRACE)?;
    let prog: &mut SchedClassifier = ebpf.program_mut(TC_TRACE).context("tc_trace missing from the BPF object")?.try_into()?;

    let frame = synthetic_frame(from.0, to.addr, to.proto)?;
    let mut out = vec![0u8; frame.len() + 256];
    let res = prog
        .test_run(TestRunOptions { data_in: Some(&frame), data_out: Some(&mut out), ..TestRunOptions::new() })
        .context("BPF_PROG_TEST_RUN")?;
    out.truncate(res.data_size_out as usize);
    let report: Array<_, TraceReport> = ebpf.take_map(MAP_TRACE_REPORT).context("trace report map")?.try_into()?;
    let report = report.get(&0, 0)?;
    let noted = report.counters;
    let counters: Vec<&'static str> = Counter::ALL.iter().filter(|c| noted & (1 << **c as u32) != 0).map(|c| c.name()).collect();
    let has = |c: Counter| noted & (1 << c as u32) != 0;
    let (service_id, backend_id, how) = (report.service_id, report.backend_id, report.how);
    let existing_flow = how == TRACE_FROM_CONNTRACK;

    let contents = maps.read_contents()?;
    let name = |id: u32| contents.names.get(&id).map(|(n, _)| n.clone());
    let addr_of = |b: &Backend| SocketAddr::new(b.addr.to_ip(), u16::from_be(b.port)).to_string();
    let reached_service = service_id != 0 || existing_flow;
    let (kind, scope) = if reached_service && !existing_flow {
        let key = FrontendKey { addr: Addr::from(dst), port: to.addr.port().to_be(), proto: to.proto, scope: how as u8 };
        let kind = contents.frontends.get(&key).map(|e| kind_name(e.kind).to_string());
        (kind, Some(if how as u8 == SCOPE_EXTERNAL { "external" } else { "internal" }.to_string()))
    } else {
        (None, None)
    };
    let entry = contents.frontends.values().find(|e| e.service_id == service_id && service_id != 0);
    let algorithm = entry.filter(|_| !existing_flow).map(|e| crate::dump::algorithm_name(e.flags));
    let maglev_cell = (algorithm == Some("maglev") && report.maglev_cell != TRACE_NO_MAGLEV_CELL && backend_id != 0)
        .then_some(report.maglev_cell);
    let candidates = match entry {
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
        algorithm,
        maglev_cell,
        maglev_table_size: maglev_cell.map(|_| maglev_table_size),
        masquerade: has(Counter::Masqueraded),
        masquerade_ports: if has(Counter::Masqueraded) {
            Some(crate::dump::masquerade_summary(&crate::dump::conntrack(&maps)?, &maps.read_counters()?))
        } else {
            None
        },
        existing_flow,
        counters,
    })
}

/// A TCP SYN, a small UDP datagram or an SCTP INIT, as a client would send it.
fn synthetic_frame(from: SocketAddr, to: SocketAddr, proto: u8) -> Result<Vec<u8>> {
    let eth = PacketBuilder::ethernet2([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2]);
    let ip = match (from.ip(), to.ip()) {
        (IpAddr::V4(s), IpAddr::V4(d)) => eth.ipv4(s.octets(), d.octets(), 64),
        (IpAddr::V6(s), IpAddr::V6(d)) => eth.ipv6(s.octets(), d.octets(), 64),
        _ => bail!("trace: {from} and {to} are of different IP families"),
    };
    let (sport, dport) = (from.port(), to.port());
    let mut v = Vec::new();
    match proto {
        IPPROTO_TCP => ip.tcp(sport, dport, 1, 64240).syn().write(&mut v, &[])?,
        IPPROTO_UDP => ip.udp(sport, dport).write(&mut v, b"trace")?,
        IPPROTO_SCTP => ip.write(&mut v, IpNumber(IPPROTO_SCTP), &sctp_init(sport, dport))?,
        _ => bail!("trace: {} is not translated by the datapath", protocol_name(proto)),
    }
    Ok(v)
}

/// An SCTP packet with one INIT chunk (RFC 9260 3.3.2) and a valid CRC32c.
fn sctp_init(sport: u16, dport: u16) -> Vec<u8> {
    const INIT: u8 = 1;
    let mut p = Vec::with_capacity(32);
    p.extend_from_slice(&sport.to_be_bytes());
    p.extend_from_slice(&dport.to_be_bytes());
    p.extend_from_slice(&[0; 8]); // verification tag 0 (as an INIT has), checksum below
    p.extend_from_slice(&[INIT, 0]);
    p.extend_from_slice(&20u16.to_be_bytes()); // chunk length
    p.extend_from_slice(&1u32.to_be_bytes()); // initiate tag
    p.extend_from_slice(&65_535u32.to_be_bytes()); // a_rwnd
    p.extend_from_slice(&[0, 1, 0, 1]); // outbound, inbound streams
    p.extend_from_slice(&1u32.to_be_bytes()); // initial TSN
    let crc = proxy_common::crc32c::sctp_checksum(&p);
    p[8..12].copy_from_slice(&crc.to_le_bytes()); // SCTP stores it LSB first
    p
}

/// Where a translated frame now goes, e.g. "10.244.0.11:8080".
fn describe(frame: &[u8]) -> Option<String> {
    let h = PacketHeaders::from_ethernet_slice(frame).ok()?;
    let ip: IpAddr = match h.net? {
        NetHeaders::Ipv4(ip, _) => ip.destination.into(),
        NetHeaders::Ipv6(ip, _) => ip.destination.into(),
        _ => return None,
    };
    let port = match (h.transport, h.payload) {
        (Some(TransportHeader::Tcp(t)), _) => t.destination_port,
        (Some(TransportHeader::Udp(u)), _) => u.destination_port,
        // etherparse leaves SCTP unparsed: its common header starts with the ports.
        (None, PayloadSlice::Ip(p)) => u16::from_be_bytes(p.payload.get(2..4)?.try_into().ok()?),
        _ => return None,
    };
    Some(SocketAddr::new(ip, port).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every frame trace builds parses back to the destination it was built
    /// for (the check `describe` makes of a translated frame).
    #[test]
    fn synthetic_frames_for_both_families_and_every_protocol() {
        let pairs = [("10.244.0.2:40000", "10.96.0.10:80"), ("[fd00:244::2]:40000", "[fd00:96::10]:80")];
        for (from, to) in pairs {
            let (from, to): (SocketAddr, SocketAddr) = (from.parse().unwrap(), to.parse().unwrap());
            for proto in [IPPROTO_TCP, IPPROTO_UDP, IPPROTO_SCTP] {
                let frame = synthetic_frame(from, to, proto).unwrap();
                assert_eq!(describe(&frame), Some(to.to_string()), "{from} -> {to} proto {proto}");
            }
        }
        let mixed = synthetic_frame("10.244.0.2:1".parse().unwrap(), "[fd00:96::10]:80".parse().unwrap(), IPPROTO_TCP);
        assert!(mixed.is_err());
    }

    #[test]
    fn sctp_init_carries_its_crc32c() {
        let p = sctp_init(40000, 2905);
        assert_eq!(p.len(), 32);
        assert_eq!(u32::from_le_bytes(p[8..12].try_into().unwrap()), proxy_common::crc32c::sctp_checksum(&p));
    }
}
