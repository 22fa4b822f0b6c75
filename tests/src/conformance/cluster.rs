//! A two-node cluster in network namespaces, laid out with kube-proxy's test
//! conventions, for one conformance setup:
//!
//! - `test-node` (the node under test) and `node2` share a LAN (a bridge in
//!   its own namespace). `test-node`'s LAN interface holds every node address
//!   of kube-proxy's fake proxier: 192.168.0.2, 192.168.1.2 and 192.168.99.11
//!   (an ExternalIP that is also a node address); `node2` is 192.168.0.3.
//! - An IPv6 setup gets kube-proxy's IPv6 node addresses too: 2001:db8::1
//!   (the LAN's /64) and 2001:db8:1::2 on `test-node`, 2001:db8::3 on
//!   `node2`, 2001:db8::fe upstream, without duplicate address detection;
//!   pods, clients and routes then follow each address's family.
//! - Each endpoint is a pod (own namespace, /32, Calico-style routing) on the
//!   node its `nodeName` names; any other name, or none, lands on `node2`.
//!   Each node routes the other's pod /32s via its LAN address.
//! - Pod clients (source in 10.0.0.0/8) are pods on `test-node`; a client that
//!   is itself an endpoint uses that endpoint's pod (hairpin).
//! - Every other source (203.0.113.x, an LB IP) is a host on the LAN with
//!   that address, routed via `test-node`.
//! - Nothing a case sends may end in an accidental black hole or an
//!   accidental refusal, or DROP and REJECT would pass without the proxy:
//!   `test-node` answers on every port a case sends to one of its own
//!   addresses (server "host:PORT"), and its default route leads to an
//!   "upstream" router that owns every other destination of the cases and
//!   answers there too (server "upstream:PORT"). So a packet the proxy does
//!   not handle gets an answer that names who gave it.
//! - Each node runs its own agent with its own bpffs; both read one
//!   manifests directory. As on a real node, both agents' socket hooks sit
//!   on the cgroup root above every pod (the test process's threads) and
//!   every node process (a child cgroup per node, see cgroup.rs): the hooks
//!   themselves keep to their own node's network namespace.
//!
//! Everything is removed on drop, in dependency order, also on failure.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::Path,
    time::Duration,
};

use anyhow::{Context, Result};

use crate::{
    agent::{Agent, agent_bin, dump_json, wait_until},
    bpf_unit::Unit,
    bpffs::Bpffs,
    cgroup::Cgroup,
    echo::EchoServer,
    netns::Netns,
    topology::{Node, Pod, host_prefix, mac_of},
    unique_suffix,
};

pub const TEST_NODE: &str = "test-node";
pub const NODE2: &str = "node2";
pub const NODE_IPS: [Ipv4Addr; 3] =
    [Ipv4Addr::new(192, 168, 0, 2), Ipv4Addr::new(192, 168, 1, 2), Ipv4Addr::new(192, 168, 99, 11)];
pub const NODE_IPS6: [Ipv6Addr; 2] =
    [Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1), Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 2)];
const NODE2_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 0, 3);
const NODE2_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 3);
const UPSTREAM_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 0, 254);
const UPSTREAM_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0xfe);
pub const LAN_IF: &str = "lan0";
const HEALTHY: Duration = Duration::from_secs(30);

/// An endpoint pod to create: where, and the ports its echo server serves.
#[derive(Debug, Default, Clone)]
pub struct EndpointSpec {
    pub on_test_node: bool,
    pub ports: BTreeSet<u16>,
}

/// What to build for one setup.
#[derive(Debug, Default)]
pub struct Plan {
    /// Give the nodes and the upstream router IPv6 addresses too.
    pub ipv6: bool,
    pub endpoints: BTreeMap<IpAddr, EndpointSpec>,
    /// Pod clients on test-node that are not endpoints.
    pub pod_clients: BTreeSet<IpAddr>,
    pub external_clients: BTreeSet<IpAddr>,
    /// Ports on test-node where a "host" echo server listens.
    pub host_ports: BTreeSet<u16>,
    /// Destinations the upstream router owns, and the ports it answers on.
    pub upstream_ips: BTreeSet<IpAddr>,
    pub upstream_ports: BTreeSet<u16>,
    /// LB IPs the upstream router sends from to themselves, through the node.
    pub lb_hairpin_ips: BTreeSet<Ipv4Addr>,
    /// Frames reach the nodes' LAN interfaces with whole checksums, as
    /// from a wire: the bridge finishes the partial checksums its senders
    /// (sockets in namespaces, with TX offload) leave. XDP needs this: it
    /// sees a frame before the kernel's checksum state, and updates a
    /// checksum as a whole one.
    pub wire_checksums: bool,
}

/// Where a case's client runs.
pub enum Client<'a> {
    Ns(&'a Netns),
    /// Not found in the plan (a harness bug, reported as such).
    Missing,
}

// Field order is drop order: agents stop before their namespaces and bpffs go.
pub struct Cluster {
    agents: Vec<Agent>,
    _servers: Vec<EchoServer>,
    pods: BTreeMap<IpAddr, Pod<IpAddr>>,
    externals: BTreeMap<IpAddr, Netns>,
    upstream: Netns,
    pub test_node: Node,
    pub node2: Node,
    /// Endpoints on node2: the ones test-node forwards to over the LAN.
    pub remote_endpoints: BTreeSet<IpAddr>,
    /// With `wire_checksums`: the bridge ports' pass-everything XDP.
    _lan_xdp: Option<Unit>,
    _lan: Netns,
    bpffs: Vec<Bpffs>,
    /// One per agent, in the agents' order: test-node's first.
    cgroups: Vec<Cgroup>,
    /// Beside the hooked root: a node process no socket hook sees.
    outside: Option<Cgroup>,
    pub manifests: tempfile::TempDir,
    /// Agent flags left out because this agent build does not know them.
    pub unsupported_flags: Vec<String>,
}

impl Cluster {
    pub fn build(plan: &Plan) -> Result<Cluster> {
        let lan = Netns::new(&format!("ep{}-lan", unique_suffix()))?;
        lan.ip(&["link", "add", "br0", "type", "bridge"])?;
        lan.ip(&["link", "set", "br0", "up"])?;
        let mut test_node = Node::new("tn")?;
        let mut node2 = Node::new("n2")?;
        let mut port_no = 0;
        let mut join_lan = |ns: &Netns, ifname: &str| -> Result<String> {
            port_no += 1;
            let br_port = format!("p{port_no}");
            lan.ip(&["link", "add", &br_port, "type", "veth", "peer", "name", ifname, "netns", &ns.name])
                .with_context(|| format!("LAN port for {}", ns.name))?;
            if plan.wire_checksums {
                let out = lan.command("ethtool").args(["-K", &br_port, "tx", "off"]).output()?;
                anyhow::ensure!(out.status.success(), "ethtool -K {br_port} tx off: {}", String::from_utf8_lossy(&out.stderr));
            }
            lan.ip(&["link", "set", &br_port, "master", "br0", "up"])?;
            ns.ip(&["link", "set", ifname, "up"])?;
            mac_of(ns, ifname)
        };

        let tn_mac = join_lan(&test_node.ns, LAN_IF)?;
        // The first address carries the LAN's /24; the others are /32 so
        // their neighbours (192.168.99.22, an ExternalIP) route upstream.
        for (i, ip) in NODE_IPS.iter().enumerate() {
            test_node.ns.ip(&["addr", "add", &format!("{ip}/{}", if i == 0 { 24 } else { 32 }), "dev", LAN_IF])?;
        }
        let n2_mac = join_lan(&node2.ns, LAN_IF)?;
        node2.ns.ip(&["addr", "add", &format!("{NODE2_IP}/24"), "dev", LAN_IF])?;
        let tn_ip = NODE_IPS[0].to_string();
        node2.ns.ip(&["neigh", "replace", &tn_ip, "lladdr", &tn_mac, "dev", LAN_IF, "nud", "permanent"])?;
        node2.ns.ip(&["route", "add", "default", "via", &tn_ip, "dev", LAN_IF])?;
        test_node.ns.ip(&["neigh", "replace", &NODE2_IP.to_string(), "lladdr", &n2_mac, "dev", LAN_IF, "nud", "permanent"])?;
        let tn_ip6 = NODE_IPS6[0].to_string();
        if plan.ipv6 {
            for (i, ip) in NODE_IPS6.iter().enumerate() {
                test_node.ns.ip(&["addr", "add", &format!("{ip}/{}", if i == 0 { 64 } else { 128 }), "dev", LAN_IF, "nodad"])?;
            }
            node2.ns.ip(&["addr", "add", &format!("{NODE2_IP6}/64"), "dev", LAN_IF, "nodad"])?;
            node2.ns.ip(&["neigh", "replace", &tn_ip6, "lladdr", &tn_mac, "dev", LAN_IF, "nud", "permanent"])?;
            node2.ns.ip(&["-6", "route", "add", "default", "via", &tn_ip6, "dev", LAN_IF])?;
            test_node.ns.ip(&["neigh", "replace", &NODE2_IP6.to_string(), "lladdr", &n2_mac, "dev", LAN_IF, "nud", "permanent"])?;
        }

        let upstream = Netns::new(&format!("{}-up", test_node.prefix))?;
        let up_mac = join_lan(&upstream, "eth0")?;
        upstream.ip(&["addr", "add", &format!("{UPSTREAM_IP}/24"), "dev", "eth0"])?;
        upstream.ip(&["neigh", "replace", &tn_ip, "lladdr", &tn_mac, "dev", "eth0", "nud", "permanent"])?;
        upstream.ip(&["route", "add", "default", "via", &tn_ip, "dev", "eth0"])?;
        if plan.ipv6 {
            upstream.ip(&["addr", "add", &format!("{UPSTREAM_IP6}/64"), "dev", "eth0", "nodad"])?;
            upstream.ip(&["neigh", "replace", &tn_ip6, "lladdr", &tn_mac, "dev", "eth0", "nud", "permanent"])?;
            upstream.ip(&["-6", "route", "add", "default", "via", &tn_ip6, "dev", "eth0"])?;
        }
        for ip in &plan.upstream_ips {
            upstream.ip(&["route", "add", "local", &host_prefix(*ip), "dev", "lo"])?;
        }
        if !plan.lb_hairpin_ips.is_empty() {
            // Its own packets to these LB IPs go to the node (table 100 for
            // locally sent packets, before the local table), and the node's
            // answers from an LB IP to an LB IP are accepted.
            upstream.ip(&["rule", "add", "pref", "1000", "lookup", "local"])?;
            upstream.ip(&["rule", "del", "pref", "0"])?;
            upstream.ip(&["rule", "add", "pref", "10", "iif", "lo", "lookup", "100"])?;
            for ip in &plan.lb_hairpin_ips {
                upstream.ip(&["route", "add", &format!("{ip}/32"), "via", &tn_ip, "dev", "eth0", "onlink", "table", "100"])?;
            }
            for key in ["net.ipv4.conf.all.accept_local", "net.ipv4.conf.eth0.accept_local"] {
                upstream.sysctl(key, "1")?;
            }
            for key in ["net.ipv4.conf.all.rp_filter", "net.ipv4.conf.eth0.rp_filter"] {
                upstream.sysctl(key, "0")?;
            }
        }
        test_node.ns.ip(&["neigh", "replace", &UPSTREAM_IP.to_string(), "lladdr", &up_mac, "dev", LAN_IF, "nud", "permanent"])?;
        test_node.ns.ip(&["route", "add", "default", "via", &UPSTREAM_IP.to_string(), "dev", LAN_IF])?;
        if plan.ipv6 {
            test_node.ns.ip(&["neigh", "replace", &UPSTREAM_IP6.to_string(), "lladdr", &up_mac, "dev", LAN_IF, "nud", "permanent"])?;
            test_node.ns.ip(&["-6", "route", "add", "default", "via", &UPSTREAM_IP6.to_string(), "dev", LAN_IF])?;
        }

        let mut externals = BTreeMap::new();
        for ip in &plan.external_clients {
            let ns = Netns::new(&format!("{}-x{}", test_node.prefix, externals.len()))?;
            for key in ["net.ipv4.conf.all.rp_filter", "net.ipv4.conf.default.rp_filter"] {
                ns.sysctl(key, "0")?;
            }
            let mac = join_lan(&ns, "eth0")?;
            let (gw, family) = if ip.is_ipv4() { (&tn_ip, "-4") } else { (&tn_ip6, "-6") };
            if ip.is_ipv4() {
                ns.ip(&["addr", "add", &host_prefix(*ip), "dev", "eth0"])?;
            } else {
                ns.ip(&["addr", "add", &host_prefix(*ip), "dev", "eth0", "nodad"])?;
            }
            ns.ip(&["route", "add", gw, "dev", "eth0", "scope", "link"])?;
            ns.ip(&["neigh", "replace", gw, "lladdr", &tn_mac, "dev", "eth0", "nud", "permanent"])?;
            ns.ip(&[family, "route", "add", "default", "via", gw, "dev", "eth0"])?;
            test_node.ns.ip(&["route", "add", &host_prefix(*ip), "dev", LAN_IF, "scope", "link"])?;
            test_node.ns.ip(&["neigh", "replace", &ip.to_string(), "lladdr", &mac, "dev", LAN_IF, "nud", "permanent"])?;
            externals.insert(*ip, ns);
        }

        // Native XDP on a node's LAN veth sends frames back to the LAN
        // (XDP_TX): its bridge port takes them only when it runs native XDP
        // itself.
        let lan_xdp = if plan.wire_checksums {
            let mut unit = Unit::load(&format!("{}-lan", test_node.prefix))?;
            let ports: Vec<String> = (1..=port_no).map(|n| format!("p{n}")).collect();
            Some(lan.run(move || unit.attach_xdp_pass(&ports).map(|()| unit))??)
        } else {
            None
        };

        let mut pods = BTreeMap::new();
        let mut servers = Vec::new();
        for (n, (ip, spec)) in plan.endpoints.iter().enumerate() {
            let pod = if spec.on_test_node {
                test_node.add_pod(&format!("e{n}"), *ip)?
            } else {
                let pod = node2.add_pod(&format!("e{n}"), *ip)?;
                let via = if ip.is_ipv4() { IpAddr::V4(NODE2_IP) } else { IpAddr::V6(NODE2_IP6) };
                test_node.ns.ip(&["route", "add", &host_prefix(*ip), "via", &via.to_string(), "dev", LAN_IF])?;
                pod
            };
            for port in &spec.ports {
                let addr = std::net::SocketAddr::new(*ip, *port);
                servers.push(EchoServer::start_on(&pod.ns, &addr.to_string(), any_addr(*ip, *port))?);
            }
            pods.insert(*ip, pod);
        }
        for (n, ip) in plan.pod_clients.iter().enumerate() {
            pods.insert(*ip, test_node.add_pod(&format!("c{n}"), *ip)?);
        }
        // On an IPv6 setup `[::]` answers both families.
        let any = if plan.ipv6 { IpAddr::V6(Ipv6Addr::UNSPECIFIED) } else { IpAddr::V4(Ipv4Addr::UNSPECIFIED) };
        for port in &plan.host_ports {
            servers.push(EchoServer::start_on(&test_node.ns, &format!("host:{port}"), any_addr(any, *port))?);
        }
        for port in &plan.upstream_ports {
            servers.push(EchoServer::start_on(&upstream, &format!("upstream:{port}"), any_addr(any, *port))?);
        }

        Ok(Cluster {
            agents: Vec::new(),
            _servers: servers,
            pods,
            externals,
            upstream,
            test_node,
            node2,
            remote_endpoints: plan.endpoints.iter().filter(|(_, spec)| !spec.on_test_node).map(|(ip, _)| *ip).collect(),
            _lan_xdp: lan_xdp,
            _lan: lan,
            bpffs: Vec::new(),
            cgroups: Vec::new(),
            outside: None,
            manifests: tempfile::tempdir()?,
            unsupported_flags: Vec::new(),
        })
    }

    /// Starts one agent per node with `flags` (the ones this agent build
    /// knows) and waits until both report their first sync.
    pub fn start_agents(&mut self, flags: &[String]) -> Result<()> {
        let known = known_run_flags()?;
        let mut args = Vec::new();
        let mut it = flags.iter().peekable();
        while let Some(flag) = it.next() {
            let value = it.next_if(|v| !v.starts_with("--"));
            if known.contains(flag.as_str()) {
                args.push(flag.clone());
                args.extend(value.cloned());
            } else {
                self.unsupported_flags.push(flag.clone());
            }
        }
        for (ns, name) in [(&self.test_node.ns, TEST_NODE), (&self.node2.ns, NODE2)] {
            let bpffs = Bpffs::new(&format!("conf-{name}"))?;
            let root = bpffs.path().join("agent");
            self.bpffs.push(bpffs);
            let node_args: Vec<&str> = args.iter().map(String::as_str).collect();
            // The node's own processes; the agent hooks the root above them
            // and above every pod (Agent's default, as on a real node).
            self.cgroups.push(Cgroup::new(&format!("conf-{name}"))?);
            self.agents.push(Agent::start_as(ns, name, self.manifests.path(), &root, &node_args)?);
        }
        self.outside = Some(Cgroup::outside("conf")?);
        for (agent, ns) in self.agents.iter_mut().zip([&self.test_node.ns, &self.node2.ns]) {
            agent.wait_healthy(ns, HEALTHY)?;
        }
        Ok(())
    }

    /// Replaces the manifests with `objects` and waits until both agents'
    /// maps changed (or a timeout: the next cases then show what stuck).
    pub fn apply(&self, objects: &[serde_yaml::Value]) -> Result<()> {
        let before: Vec<_> = self.agents.iter().map(|a| dump_json("services", &a.bpffs_root).ok()).collect();
        write_manifests(self.manifests.path(), objects)?;
        if self.agents.is_empty() {
            return Ok(());
        }
        let _ = wait_until("the agents to apply the change", Duration::from_secs(10), || {
            Ok(self.agents.iter().zip(&before).all(|(a, b)| dump_json("services", &a.bpffs_root).ok() != *b))
        });
        Ok(())
    }

    /// The pod or LAN host holding `ip`.
    pub fn client(&self, ip: IpAddr) -> Client<'_> {
        if let Some(pod) = self.pods.get(&ip) {
            return Client::Ns(&pod.ns);
        }
        match self.externals.get(&ip) {
            Some(ns) => Client::Ns(ns),
            None => Client::Missing,
        }
    }

    /// Every pod's namespace (endpoints and pod clients, both nodes).
    pub fn pod_namespaces(&self) -> Vec<&Netns> {
        self.pods.values().map(|p| &p.ns).collect()
    }

    /// The upstream router: it owns the LB IPs, and sends to an LB IP from
    /// that same IP through the node (see `Plan::lb_hairpin_ips`).
    pub fn lb_hairpin_client(&self) -> Client<'_> {
        Client::Ns(&self.upstream)
    }

    /// The cgroup of test-node's processes.
    pub fn test_node_cgroup(&self) -> Option<&Cgroup> {
        self.cgroups.first()
    }

    /// A cgroup outside the agents' `--cgroup-root`, for a node process
    /// that no socket hook sees.
    pub fn outside_cgroup(&self) -> Option<&Cgroup> {
        self.outside.as_ref()
    }

    /// The pinned datapath counters of the agent on test-node.
    pub fn test_node_counters(&self) -> Result<Vec<u64>> {
        let agent = self.agents.first().context("no agent started")?;
        proxy_user::maps::pinned_counters(&agent.bpffs_root)
    }

    /// The frames test-node's XDP sent out itself, over its interfaces.
    pub fn test_node_xdp_sent(&self) -> Result<u64> {
        let agent = self.agents.first().context("no agent started")?;
        Ok(proxy_user::xdp::sent(&agent.bpffs_root)?.iter().map(|(_, n)| n).sum())
    }

    /// `dump services -o json` of the agent on test-node.
    pub fn dump_services(&self) -> Result<serde_json::Value> {
        let agent = self.agents.first().context("no agent started")?;
        dump_json("services", &agent.bpffs_root)
    }

    pub fn agent_logs(&self) -> String {
        self.agents.iter().map(|a| format!("--- agent in {}:\n{}", a.node, a.logs())).collect()
    }
}

/// A source that is the node itself: its addresses and loopback.
pub fn is_node_local(ip: IpAddr) -> bool {
    ip.is_loopback()
        || match ip {
            IpAddr::V4(v4) => NODE_IPS.contains(&v4),
            IpAddr::V6(v6) => NODE_IPS6.contains(&v6),
        }
}

/// The unspecified address of `ip`'s family, on `port`.
fn any_addr(ip: IpAddr, port: u16) -> std::net::SocketAddr {
    let any = if ip.is_ipv4() { IpAddr::V4(Ipv4Addr::UNSPECIFIED) } else { IpAddr::V6(Ipv6Addr::UNSPECIFIED) };
    std::net::SocketAddr::new(any, port)
}

/// Writes one file per object and removes files of objects that are gone, so
/// the agent sees the change as a watch would deliver it.
fn write_manifests(dir: &Path, objects: &[serde_yaml::Value]) -> Result<()> {
    let mut wanted = BTreeSet::new();
    for obj in objects {
        let kind = obj["kind"].as_str().unwrap_or("Object");
        let meta = &obj["metadata"];
        let name = format!(
            "{}-{}-{}.yaml",
            kind,
            meta["namespace"].as_str().unwrap_or("default"),
            meta["name"].as_str().context("object without metadata.name")?
        );
        std::fs::write(dir.join(&name), serde_yaml::to_string(obj)?)?;
        wanted.insert(name);
    }
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        if !wanted.contains(&*entry.file_name().to_string_lossy()) {
            std::fs::remove_file(entry.path())?;
        }
    }
    Ok(())
}

/// The `--flags` that `ebpf-proxy run --help` lists.
fn known_run_flags() -> Result<BTreeSet<String>> {
    let out = std::process::Command::new(agent_bin()).args(["run", "--help"]).output().context("ebpf-proxy run --help")?;
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(text
        .split(|c: char| c.is_whitespace() || c == ',' || c == '=' || c == '[' || c == ']' || c == '<')
        .filter(|w| w.starts_with("--") && w.len() > 2)
        .map(str::to_string)
        .collect())
}
