//! Runs the cases of one setup: plans and builds its cluster, starts the
//! agents with the setup's flags, applies each phase, and judges every case.

use std::{
    collections::BTreeSet,
    net::{IpAddr, SocketAddr},
    path::Path,
};

use anyhow::Result;

use super::{
    cluster::{Client, Cluster, EndpointSpec, LAN_IF, Plan, TEST_NODE, is_node_local},
    data::{Case, Expect, Family, Protocol, Setup},
    frontends, probe, verdict,
};
use crate::echo::EchoServer;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Pass,
    Fail,
    Skip,
}

/// What a result is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Check {
    /// One of kube-proxy's packet-flow cases.
    Packet,
    /// `dump services` lists every frontend of a phase (not a kube-proxy case).
    Dump,
}

#[derive(Debug, Clone)]
pub struct CaseResult {
    pub check: Check,
    /// `proxier/Setup[ (after phase)]/case [proto]`, or `dump services:
    /// proxier/Setup[ (after phase)]`: stable, unique.
    pub id: String,
    pub status: Status,
    /// The packet, in kube-proxy's terms.
    pub packet: String,
    pub detail: String,
}

/// Where a case's client sits, by its source address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Origin {
    /// A process on the node (a node address or loopback).
    Node,
    /// A node's connection to its own LB IP, handed back by the cloud load
    /// balancer SNATted to the LB IP ("same node to LB, SNATted to LB"): the
    /// upstream router, which owns the LB IPs, sends it.
    LbHairpin,
    Pod,
    External,
}

fn origin(case: &Case) -> Origin {
    match case.source_ip {
        ip if is_node_local(ip) => Origin::Node,
        src if src == case.dest_ip => Origin::LbHairpin,
        ip if is_pod_ip(ip) => Origin::Pod,
        _ => Origin::External,
    }
}

/// kube-proxy's pod addresses: 10.0.0.0/8, and fd00:10::/32 (which holds
/// both the IPv6 pod CIDR and the endpoints fd00:10:180::/48).
fn is_pod_ip(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.octets()[0] == 10,
        IpAddr::V6(v6) => v6.segments()[..2] == [0xfd00, 0x10],
    }
}

/// kube-proxy's test CIDRs; an IPv6 setup gets the IPv6 ones too
/// (fd00:10::/64 is the IPv6 fake proxier's pod CIDR; the service CIDR
/// holds its ClusterIPs fd00:172:30::/112).
pub const SERVICE_CIDR: &str = "172.30.0.0/16";
pub const CLUSTER_CIDR: &str = "10.0.0.0/8";
pub const SERVICE_CIDR6: &str = "fd00:172:30::/112";
pub const CLUSTER_CIDR6: &str = "fd00:10::/64";

/// The agent flags for a setup, in ebpf-proxy's (kube-proxy's) names.
pub fn agent_flags(setup: &Setup) -> Vec<String> {
    let both = |v4: &str, v6: &str| if setup.family == Family::IPv6 { format!("{v4},{v6}") } else { v4.to_string() };
    let mut flags = vec!["--service-cidr".to_string(), both(SERVICE_CIDR, SERVICE_CIDR6)];
    if setup.config.local_detector {
        flags.extend(["--cluster-cidr".to_string(), both(CLUSTER_CIDR, CLUSTER_CIDR6)]);
    }
    if let Some(cidrs) = &setup.config.node_port_addresses {
        flags.extend(["--node-port-addresses".to_string(), cidrs.join(",")]);
    }
    if setup.config.masquerade_all {
        flags.push("--masquerade-all".to_string());
    }
    // Unset: kube-proxy's default (on; the nftables proxier has no such
    // cases).
    if let Some(on) = setup.config.localhost_node_ports {
        flags.extend(["--localhost-nodeports".to_string(), on.to_string()]);
    }
    flags
}

/// Every pod, client and host port the setup's phases need.
pub fn plan(setup: &Setup) -> Plan {
    let mut plan = Plan { ipv6: setup.family == Family::IPv6, ..Plan::default() };
    for phase in &setup.phases {
        for obj in &phase.objects {
            if obj["kind"].as_str() != Some("EndpointSlice") {
                continue;
            }
            let ports: Vec<u16> = obj["ports"]
                .as_sequence()
                .into_iter()
                .flatten()
                .filter(|p| matches!(p["protocol"].as_str(), None | Some("TCP") | Some("UDP")))
                .filter_map(|p| p["port"].as_u64().and_then(|n| u16::try_from(n).ok()))
                .collect();
            for ep in obj["endpoints"].as_sequence().into_iter().flatten() {
                let on_test_node = ep["nodeName"].as_str() == Some(TEST_NODE);
                for addr in ep["addresses"].as_sequence().into_iter().flatten() {
                    let Some(ip) = addr.as_str().and_then(|s| s.parse::<IpAddr>().ok()) else { continue };
                    let spec = plan.endpoints.entry(ip).or_insert_with(|| EndpointSpec { on_test_node, ..Default::default() });
                    spec.ports.extend(&ports);
                }
            }
        }
    }
    // The agent serves these itself (kube-proxy's health-check servers).
    let health_checks: BTreeSet<u16> = setup
        .phases
        .iter()
        .flat_map(|p| &p.objects)
        .filter(|o| o["kind"].as_str() == Some("Service") && o["spec"]["externalTrafficPolicy"].as_str() == Some("Local"))
        .filter_map(|o| o["spec"]["healthCheckNodePort"].as_u64().and_then(|p| u16::try_from(p).ok()))
        .collect();
    for phase in &setup.phases {
        for case in &phase.cases {
            let (src, dst) = (case.source_ip, case.dest_ip);
            if is_node_local(dst) {
                if !health_checks.contains(&case.dest_port) {
                    plan.host_ports.insert(case.dest_port);
                }
            } else if !is_pod_ip(dst) {
                plan.upstream_ips.insert(dst);
                plan.upstream_ports.insert(case.dest_port);
            }
            if plan.endpoints.contains_key(&src) {
                continue;
            }
            match origin(case) {
                Origin::Pod => {
                    plan.pod_clients.insert(src);
                }
                Origin::External => {
                    plan.external_clients.insert(src);
                }
                Origin::LbHairpin => {
                    if let IpAddr::V4(src) = src {
                        plan.lb_hairpin_ips.insert(src);
                    }
                }
                Origin::Node => {}
            }
        }
    }
    plan
}

fn after(setup: &Setup, phase: usize) -> String {
    if phase == 0 { String::new() } else { format!(" (after {})", setup.phases[phase].name) }
}

fn case_id(kind: &str, setup: &Setup, phase: usize, case: &Case) -> String {
    format!("{kind}/{}{}/{} [{}]", setup.name, after(setup, phase), case.name, case.protocol)
}

fn dump_id(kind: &str, setup: &Setup, phase: usize) -> String {
    format!("dump services: {kind}/{}{}", setup.name, after(setup, phase))
}

fn packet(case: &Case) -> String {
    let output = if case.output.is_empty() { "\"\"" } else { &case.output };
    format!(
        "{} {} -> {} expect {output}{}",
        case.protocol,
        case.source_ip,
        SocketAddr::new(case.dest_ip, case.dest_port),
        if case.masq { " masqueraded" } else { "" }
    )
}

/// Which hook the agents translate external traffic in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Datapath {
    /// The TC programs (the default).
    Tc,
    /// `--xdp-devices` on each node's LAN interface, native XDP on the veth,
    /// in front of TC. Each IPv4 case from an external client that reaches
    /// an endpoint must have been decided in XDP (its counter moved).
    Xdp,
}

/// Runs every case of `setup`, calling `report` as each one finishes.
/// `netprobe` is the client binary run as a node process.
pub fn run_setup(
    kind: &str,
    setup: &Setup,
    netprobe: &Path,
    datapath: Datapath,
    report: &(dyn Fn(&CaseResult) + Sync),
) -> Vec<CaseResult> {
    let mut results = Vec::new();
    let mut record = |r: CaseResult| {
        report(&r);
        results.push(r);
    };
    let packet_result = |phase: usize, case: &Case, status: Status, detail: String| CaseResult {
        check: Check::Packet,
        id: case_id(kind, setup, phase, case),
        status,
        packet: packet(case),
        detail,
    };
    let dump_result = |phase: usize, status: Status, detail: String| CaseResult {
        check: Check::Dump,
        id: dump_id(kind, setup, phase),
        status,
        packet: "every frontend kind with its scope".into(),
        detail,
    };
    let everything = |status: Status, detail: &str| -> Vec<CaseResult> {
        let mut all = Vec::new();
        for (i, phase) in setup.phases.iter().enumerate() {
            all.push(dump_result(i, status, detail.to_string()));
            all.extend(phase.cases.iter().map(|c| packet_result(i, c, status, detail.to_string())));
        }
        all
    };

    let cluster = match build(setup, datapath) {
        Ok(c) => c,
        Err(e) => {
            everything(Status::Fail, &format!("setup failed: {e:#}")).into_iter().for_each(&mut record);
            return results;
        }
    };
    let lacking = if cluster.unsupported_flags.is_empty() {
        String::new()
    } else {
        format!(" [agent lacks {}]", cluster.unsupported_flags.join(" "))
    };

    for (i, phase) in setup.phases.iter().enumerate() {
        if i > 0 {
            if let Err(e) = cluster.apply(&phase.objects) {
                let detail = format!("applying the phase failed: {e:#}");
                record(dump_result(i, Status::Fail, detail.clone()));
                phase.cases.iter().for_each(|c| record(packet_result(i, c, Status::Fail, detail.clone())));
                continue;
            }
        }
        let (status, detail) = check_frontends(&cluster, setup, &phase.objects);
        record(dump_result(i, status, if status == Status::Fail { format!("{detail}{lacking}") } else { detail }));
        for case in &phase.cases {
            let (status, detail) = match datapath {
                Datapath::Tc => run_case(&cluster, case, netprobe),
                Datapath::Xdp => run_case_through_xdp(&cluster, case, netprobe),
            };
            let detail = if status == Status::Fail { format!("{detail}{lacking}") } else { detail };
            record(packet_result(i, case, status, detail));
        }
    }
    if std::env::var_os("CONFORMANCE_AGENT_LOGS").is_some() {
        eprintln!("{}", cluster.agent_logs());
    }
    results
}

/// Whether test-node's `dump services` lists every frontend the phase's
/// objects call for, each with a scope. The agent learns node addresses
/// from netlink after its first sync, so NodePort frontends may follow
/// /healthz by a moment: the dump gets a few seconds to converge.
fn check_frontends(cluster: &Cluster, setup: &Setup, objects: &[serde_yaml::Value]) -> (Status, String) {
    let want = frontends::expected(objects, setup.config.node_port_addresses.as_deref());
    if want.is_empty() {
        return (Status::Skip, "no Service with a serving endpoint: nothing to list".into());
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let missing: Vec<String> = match cluster.dump_services() {
            Ok(rows) => want.difference(&frontends::dumped(&rows)).map(|(k, f)| format!("{k} {f}")).collect(),
            Err(e) => return (Status::Fail, format!("dump services failed: {e:#}")),
        };
        if missing.is_empty() {
            return (Status::Pass, format!("all {} frontends listed", want.len()));
        }
        if std::time::Instant::now() > deadline {
            return (Status::Fail, format!("missing {} of {}: {}", missing.len(), want.len(), missing.join(", ")));
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

fn build(setup: &Setup, datapath: Datapath) -> Result<Cluster> {
    let plan = Plan { wire_checksums: datapath == Datapath::Xdp, ..plan(setup) };
    let mut cluster = Cluster::build(&plan)?;
    cluster.apply(&setup.phases[0].objects)?;
    let mut flags = agent_flags(setup);
    if datapath == Datapath::Xdp {
        flags.extend(["--xdp-devices", LAN_IF, "--xdp-mode", "native"].map(String::from));
    }
    cluster.start_agents(&flags)?;
    Ok(cluster)
}

/// `run_case`, and for an IPv4 external client's packet that reaches an
/// endpoint, whether test-node's XDP program decided it (xdp_finished
/// moved while the case ran): XDP must take that traffic, not leave it
/// all to TC. When every endpoint it may reach is on node2 (TCP or UDP),
/// XDP must also have sent it out itself (XDP_TX back onto the LAN), not
/// up test-node's stack.
fn run_case_through_xdp(cluster: &Cluster, case: &Case, netprobe: &Path) -> (Status, String) {
    let expect = case.expect();
    let xdp_finishes = origin(case) == Origin::External
        && case.source_ip.is_ipv4()
        && matches!(expect, Ok(Expect::Endpoints(_)));
    let xdp_sends = xdp_finishes
        && case.protocol != Protocol::SCTP
        && matches!(&expect, Ok(Expect::Endpoints(eps)) if eps.iter().all(|e| cluster.remote_endpoints.contains(&e.ip())));
    let before = cluster.test_node_counters().ok().zip(cluster.test_node_xdp_sent().ok());
    let (status, detail) = run_case(cluster, case, netprobe);
    let after = cluster.test_node_counters().ok().zip(cluster.test_node_xdp_sent().ok());
    let (Some((before, sent_before)), Some((after, sent_after))) = (before, after) else {
        return (Status::Fail, format!("{detail}; test-node's counters could not be read"));
    };
    let moved = |c: proxy_common::Counter| after[c as usize] - before[c as usize];
    let sent = sent_after - sent_before;
    if status != Status::Pass {
        // What test-node's datapath did meanwhile, to tell XDP's part.
        let counters: Vec<String> = proxy_common::Counter::ALL
            .iter()
            .filter(|c| moved(**c) > 0)
            .map(|c| format!("{}+{}", c.name(), moved(*c)))
            .collect();
        return (status, format!("{detail} [test-node counters: {}; sent out by XDP: {sent}]", counters.join(" ")));
    }
    match moved(proxy_common::Counter::XdpFinished) {
        0 if xdp_finishes => (Status::Fail, format!("{detail}, but not in XDP: xdp_finished did not move (all left to TC)")),
        _ if xdp_sends && sent == 0 => {
            (Status::Fail, format!("{detail}, but XDP sent none of it out itself (all up test-node's stack)"))
        }
        0 => (status, detail),
        n => (status, format!("{detail}; {n} packets decided in XDP, {sent} sent out by XDP")),
    }
}

/// In a node case's name: its process runs outside the hooked cgroup root.
const OUTSIDE_THE_HOOKS: &str = "outside the cgroup root";

fn run_case(cluster: &Cluster, case: &Case, netprobe: &Path) -> (Status, String) {
    let expect: Expect = match case.expect() {
        Ok(e) => e,
        Err(e) => return (Status::Fail, format!("bad case: {e:#}")),
    };
    let origin = origin(case);
    let client = match origin {
        Origin::Node => Client::Ns(&cluster.test_node.ns),
        Origin::LbHairpin => cluster.lb_hairpin_client(),
        Origin::Pod | Origin::External => cluster.client(case.source_ip),
    };
    let Client::Ns(ns) = client else {
        return (Status::Fail, format!("harness: no client for source {}", case.source_ip));
    };
    let dest = SocketAddr::new(case.dest_ip, case.dest_port);
    // A node's own address is what masquerading would produce: not observable.
    let masq_observable = origin != Origin::Node;
    // A case named "... outside the cgroup root ..." runs its node process
    // where no socket hook sees it: TC egress must translate it instead.
    let node_cgroup = if case.name.contains(OUTSIDE_THE_HOOKS) { cluster.outside_cgroup() } else { cluster.test_node_cgroup() };
    let node_cgroup = node_cgroup.filter(|_| !masq_observable);
    let pods = cluster.pod_namespaces();
    let send = || match node_cgroup {
        // No SCTP module here: crafted packets, seen arriving at the pods.
        _ if case.protocol == Protocol::SCTP => probe::sctp_request(ns, dest, &pods),
        Some(cg) => probe::request_from_node(netprobe, cg, ns, case.protocol, case.source_ip, dest),
        None => probe::request(ns, case.protocol, case.source_ip, dest),
    };
    // ACCEPT: the packet must reach the node's own stack untranslated. The
    // agent's healthCheckNodePort server answers there when it listens on
    // that address; it listens only on the --node-port-addresses ones, as
    // kube-proxy's, so a stand-in answers where the port is free.
    let _stand_in = (expect == Expect::Accept && case.protocol != Protocol::SCTP)
        .then(|| EchoServer::start_on(&cluster.test_node.ns, &format!("host:{}", dest.port()), dest).ok())
        .flatten();
    match verdict::judge(&expect, case, masq_observable, send) {
        Ok(seen) => (Status::Pass, seen),
        Err(why) if origin == Origin::Node => {
            (Status::Fail, format!("{why} (sent by a process on the node: needs the socket-level hooks)"))
        }
        Err(why) => (Status::Fail, why),
    }
}
