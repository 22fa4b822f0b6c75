//! A node whose uplink and some of whose pods sit behind L3 devices (tun
//! devices here, link type `none` like WireGuard's: packets start at the IP
//! header), in the production topology (pods under the socket hooks, which
//! leave pods' sockets to TC). The agent attaches its L3 copy of the
//! programs there, and:
//! - an external client on the L3 uplink reaches a NodePort, masqueraded,
//!   over TCP and UDP, and a process of the node outside the agent's cgroup
//!   reaches a ClusterIP whose route is the L3 uplink (translated at the
//!   uplink's egress and redirected to the backend's veth);
//! - a pod behind an L3 device reaches ClusterIPs, IPv4 and IPv6, with
//!   backends on a veth and behind another L3 device (a pod on another
//!   node, over the tunnel);
//! - a Service without endpoints REJECTs back out of the L3 device: TCP
//!   reset and ICMP port unreachable, IPv4 and IPv6;
//! - an interface of a link type the programs cannot read is left alone;
//! - a restarted agent adopts the L3 copy's programs in place, and
//!   `cleanup` removes them with the rest.

#![feature(custom_test_frameworks)]
#![test_runner(proxy_tests::harness::run)]

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context, Result};
use proxy_tests::{
    addrs::{VIP, VIP6},
    agent::{Agent, agent_bin, tc_attached, tc_attached_egress},
    bpffs::Bpffs,
    cgroup::Cgroup,
    echo::{EchoServer, expect_refused, tcp_request, tcp_request_from, udp_request, udp_request_connected},
    patience,
    manifests::{TCP_PORT, TCP_TARGET, UDP_PORT, UDP_TARGET, echo_node_port_service, one_port_service},
    netns::Netns,
    topology::{Node, Pod},
    tun_link::{self, TunLink},
};

/// Until /healthz answers: the agent puts two copies of its programs
/// through the verifier here (the L3 copy when it meets the first L3
/// device), twice the others' start, which an emulated VM running two such
/// worlds at once stretches past their 10 s (times its patience).
const STARTUP: Duration = Duration::from_secs(30);
const REFUSED_WITHIN: Duration = Duration::from_secs(3);
/// The node's address on the L3 uplink, and the external client's.
const NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 82, 1);
const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 82, 2);
/// A pod on a veth, the backend of `VIP` (and `VIP6`, the cluster's usual
/// ClusterIPs): this world's pods are not `addrs`'s.
const BACKEND: Ipv4Addr = Ipv4Addr::new(10, 244, 0, 2);
const BACKEND6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x244, 0, 0, 0, 0, 0, 2);
/// A pod behind an L3 device of this node: the client.
const L3_POD: Ipv4Addr = Ipv4Addr::new(10, 244, 0, 9);
const L3_POD6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x244, 0, 0, 0, 0, 0, 9);
/// A pod on another node, reached over an L3 tunnel: the backend of `FAR_VIP`.
const FAR: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 2);
const FAR_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 20);
/// Services without endpoints.
const EMPTY_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 30);
const EMPTY_VIP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x30);
const TCP_NODE_PORT: u16 = 30080;
const UDP_NODE_PORT: u16 = 30053;
/// ARPHRD_INFINIBAND: a link type whose frames are not Ethernet.
const ARPHRD_INFINIBAND: i32 = 32;

/// A ClusterIP Service without endpoints: REJECT.
fn empty_service(name: &str, vip: IpAddr) -> String {
    let family = if vip.is_ipv4() { "IPv4" } else { "IPv6" };
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: demo}}\nspec:\n  clusterIP: \"{vip}\"\n  \
         ipFamilies: [{family}]\n  ports:\n  - {{name: tcp, port: 80, protocol: TCP}}\n  - {{name: udp, port: 53, protocol: UDP}}\n"
    )
}

/// The node, its pods and tunnels, the agent serving them.
struct World {
    node: Node,
    ext: Netns,
    l3_pod: Netns,
    uplink: String,
    pod_link: String,
    /// None only while it restarts.
    agent: Option<Agent>,
    root: PathBuf,
    manifests: tempfile::TempDir,
    _links: Vec<TunLink>,
    _pods: Vec<Pod<IpAddr>>,
    _far: Netns,
    _servers: Vec<EchoServer>,
    _bpffs: Bpffs,
}

impl World {
    fn new(label: &str) -> Result<World> {
        let mut node = Node::new(label)?;
        let mut servers = Vec::new();
        let backend = node.add_pod("b1", IpAddr::from(BACKEND))?;
        let backend6 = node.add_pod("b16", IpAddr::from(BACKEND6))?;
        for (pod, name) in [(&backend, "b1"), (&backend6, "b1v6")] {
            servers.push(EchoServer::start_on(&pod.ns, name, SocketAddr::new(unspecified(pod.ip), TCP_TARGET))?);
            servers.push(EchoServer::start_on(&pod.ns, name, SocketAddr::new(unspecified(pod.ip), UDP_TARGET))?);
        }

        // The uplink: the external client at the far end of a tunnel.
        let ext = Netns::new(&format!("{}-ext", node.prefix))?;
        let uplink = format!("{}u0", node.prefix);
        let mut links = vec![TunLink::new(&node.ns, &uplink, &ext, "wg0")?];
        node.ns.ip(&["addr", "add", &format!("{NODE_IP}/32"), "dev", &uplink])?;
        node.ns.ip(&["route", "add", &format!("{EXTERNAL_IP}/32"), "dev", &uplink])?;
        // The node's default route, as through a tunnel to its gateway: a
        // node process's packets to a ClusterIP leave through the uplink.
        node.ns.ip(&["route", "add", "default", "dev", &uplink])?;
        ext.ip(&["addr", "add", &format!("{EXTERNAL_IP}/32"), "dev", "wg0"])?;
        ext.ip(&["route", "add", &format!("{NODE_IP}/32"), "dev", "wg0"])?;

        // A pod whose interface is an L3 device.
        let l3_pod = Netns::new(&format!("{}-l3pod", node.prefix))?;
        let pod_link = format!("{}t0", node.prefix);
        links.push(TunLink::new(&node.ns, &pod_link, &l3_pod, "eth0")?);
        l3_pod.ip(&["addr", "add", &format!("{L3_POD}/32"), "dev", "eth0"])?;
        l3_pod.ip(&["addr", "add", &format!("{L3_POD6}/128"), "dev", "eth0", "nodad"])?;
        l3_pod.ip(&["route", "add", "default", "dev", "eth0"])?;
        l3_pod.ip(&["-6", "route", "add", "default", "dev", "eth0"])?;
        node.ns.ip(&["route", "add", &format!("{L3_POD}/32"), "dev", &pod_link])?;
        node.ns.ip(&["-6", "route", "add", &format!("{L3_POD6}/128"), "dev", &pod_link])?;

        // A pod of another node, over a tunnel.
        let far = Netns::new(&format!("{}-far", node.prefix))?;
        let far_link = format!("{}r0", node.prefix);
        links.push(TunLink::new(&node.ns, &far_link, &far, "wg0")?);
        far.ip(&["addr", "add", &format!("{FAR}/32"), "dev", "wg0"])?;
        far.ip(&["route", "add", "default", "dev", "wg0"])?;
        node.ns.ip(&["route", "add", &format!("{FAR}/32"), "dev", &far_link])?;
        servers.push(EchoServer::start(&far, "far", TCP_TARGET)?);

        // An interface the programs cannot read.
        let odd = tun_link::create(&node.ns, &format!("{}ib0", node.prefix))?;
        tun_link::set_link_type(&odd, ARPHRD_INFINIBAND)?;
        node.ns.ip(&["link", "set", &format!("{}ib0", node.prefix), "up"])?;
        std::mem::forget(odd); // kept for the life of the namespace

        let manifests = tempfile::tempdir()?;
        let services = [
            echo_node_port_service(VIP, &[BACKEND], TCP_NODE_PORT, UDP_NODE_PORT),
            one_port_service("echo6", VIP6.into(), TCP_PORT, TCP_TARGET, "TCP", BACKEND6.into(), None),
            one_port_service("far", FAR_VIP.into(), TCP_PORT, TCP_TARGET, "TCP", FAR.into(), None),
            empty_service("empty", EMPTY_VIP.into()),
            empty_service("empty6", EMPTY_VIP6.into()),
        ];
        std::fs::write(manifests.path().join("svc.yaml"), services.join("---\n"))?;
        let bpffs = Bpffs::new(label)?;
        let root = bpffs.path().join("agent");
        let mut agent = Agent::start(&node.ns, manifests.path(), &root, &[])?;
        agent.wait_healthy(&node.ns, STARTUP)?;
        Ok(World {
            node,
            ext,
            l3_pod,
            uplink,
            pod_link,
            agent: Some(agent),
            root,
            manifests,
            _links: links,
            _pods: vec![backend, backend6],
            _far: far,
            _servers: servers,
            _bpffs: bpffs,
        })
    }
}

impl World {
    fn agent(&self) -> &Agent {
        self.agent.as_ref().expect("an agent runs")
    }
}

fn unspecified(ip: IpAddr) -> IpAddr {
    if ip.is_ipv4() { Ipv4Addr::UNSPECIFIED.into() } else { Ipv6Addr::UNSPECIFIED.into() }
}

#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn an_external_client_on_an_l3_uplink_reaches_a_node_port() -> Result<()> {
    let world = World::new("l3up")?;
    let logs = || world.agent().logs();

    let tcp = SocketAddr::from((NODE_IP, TCP_NODE_PORT));
    let r = tcp_request(&world.ext, tcp).with_context(logs)?;
    assert_eq!((r.backend.as_str(), r.from), ("b1", tcp), "TCP to the NodePort");
    // Masqueraded: the backend saw the node, not the client.
    assert!(!r.seen_client.contains(&EXTERNAL_IP.to_string()), "not masqueraded: {r:?}");
    let udp = SocketAddr::from((NODE_IP, UDP_NODE_PORT));
    let r = udp_request(&world.ext, udp).with_context(logs)?;
    assert_eq!((r.backend.as_str(), r.from), ("b1", udp), "UDP to the NodePort");

    // A process of the node outside the hooks' cgroup: its packet to the
    // ClusterIP routes to the uplink and is translated at its egress.
    let outside = Cgroup::outside("l3up")?;
    let bin = Path::new(env!("CARGO_BIN_EXE_netprobe"));
    let to = format!("{VIP}:{TCP_PORT}");
    let out = outside.command(&world.node.ns, bin).args(["tcp", &to]).output().context("run netprobe")?;
    let line = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(line.starts_with(&format!("peer={to} reply=b1 ")), "node process to {to}: {line}\n{}", logs());

    let attached = tc_attached(&world.node.ns, &world.uplink)? && tc_attached_egress(&world.node.ns, &world.uplink)?;
    assert!(attached, "uplink {} not attached:\n{}", world.uplink, logs());
    assert!(logs().contains("TC programs loaded for L3 devices"), "{}", logs());
    Ok(())
}

#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn a_pod_behind_an_l3_device_reaches_cluster_ips() -> Result<()> {
    let world = World::new("l3pod")?;
    let logs = || world.agent().logs();
    assert!(tc_attached(&world.node.ns, &world.pod_link)?, "{} not attached:\n{}", world.pod_link, logs());

    let vip = SocketAddr::from((VIP, TCP_PORT));
    let r = tcp_request(&world.l3_pod, vip).with_context(logs)?;
    assert_eq!((r.backend.as_str(), r.from), ("b1", vip), "TCP to the ClusterIP");
    assert_eq!(r.seen_client.split(':').next(), Some(L3_POD.to_string().as_str()), "{r:?}");
    let udp = SocketAddr::from((VIP, UDP_PORT));
    let r = udp_request(&world.l3_pod, udp).with_context(logs)?;
    assert_eq!((r.backend.as_str(), r.from), ("b1", udp), "UDP to the ClusterIP");
    let vip6 = SocketAddr::from((VIP6, TCP_PORT));
    let r = tcp_request(&world.l3_pod, vip6).with_context(logs)?;
    assert_eq!((r.backend.as_str(), r.from), ("b1v6", vip6), "TCP to the IPv6 ClusterIP");

    // The backend on another node, over the tunnel: L3 ingress and egress
    // on both sides of the node.
    let far = SocketAddr::from((FAR_VIP, TCP_PORT));
    let r = tcp_request(&world.l3_pod, far).with_context(logs)?;
    assert_eq!((r.backend.as_str(), r.from), ("far", far), "TCP to a backend behind a tunnel");
    Ok(())
}

#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn rejects_go_back_out_of_an_l3_device() -> Result<()> {
    let world = World::new("l3rej")?;
    for vip in [IpAddr::from(EMPTY_VIP), IpAddr::from(EMPTY_VIP6)] {
        let tcp = SocketAddr::new(vip, 80);
        expect_refused(tcp_request_from(&world.l3_pod, None, tcp, patience(REFUSED_WITHIN)), &format!("TCP to {tcp}"))
            .with_context(|| world.agent().logs())?;
        let udp = SocketAddr::new(vip, 53);
        expect_refused(udp_request_connected(&world.l3_pod, udp, patience(REFUSED_WITHIN)), &format!("UDP to {udp}"))
            .with_context(|| world.agent().logs())?;
    }
    let metrics = world.agent().scrape(&world.node.ns)?;
    let rejected = metrics.get(r#"ebpf_proxy_packets_total{verdict="rejected",reason="rejected"}"#).copied().unwrap_or(0.0);
    assert!(rejected >= 4.0, "rejects counted: {rejected}, want 4");
    Ok(())
}

#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn an_interface_of_another_link_type_is_left_alone() -> Result<()> {
    let world = World::new("l3odd")?;
    let odd = format!("{}ib0", world.node.prefix);
    assert!(!tc_attached(&world.node.ns, &odd)? && !tc_attached_egress(&world.node.ns, &odd)?, "{odd} got programs");
    let logs = world.agent().logs();
    let line = logs.lines().find(|l| l.contains(&odd)).with_context(|| format!("no log line names {odd}:\n{logs}"))?;
    assert!(line.contains("not attached") && line.contains("Infiniband"), "{line}");
    // The others are served (the uplink's programs and the root's pins).
    assert!(tc_attached(&world.node.ns, &world.uplink)?, "uplink not attached:\n{logs}");
    Ok(())
}

#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn a_restart_adopts_the_l3_programs_and_cleanup_removes_them() -> Result<()> {
    let mut world = World::new("l3restart")?;
    let vip = SocketAddr::from((VIP, TCP_PORT));
    tcp_request(&world.l3_pod, vip).with_context(|| world.agent().logs())?;

    // SIGKILL: the programs stay attached; the new agent swaps its own in.
    world.agent.take().expect("an agent runs").kill()?;
    let mut agent = Agent::start(&world.node.ns, world.manifests.path(), &world.root, &[])?;
    agent.wait_healthy(&world.node.ns, STARTUP)?;
    world.agent = Some(agent);
    let logs = world.agent().logs();
    let adopted = |ifname: &str| logs.lines().any(|l| l.contains(ifname) && l.contains("adopted=true") && l.contains("link=\"l3\""));
    assert!(adopted(&world.pod_link) && adopted(&world.uplink), "the L3 devices' programs were not adopted:\n{logs}");
    let r = tcp_request(&world.l3_pod, vip).with_context(|| world.agent().logs())?;
    assert_eq!((r.backend.as_str(), r.from), ("b1", vip), "after the restart");
    let r = tcp_request(&world.ext, SocketAddr::from((NODE_IP, TCP_NODE_PORT))).with_context(|| world.agent().logs())?;
    assert_eq!(r.backend, "b1", "NodePort on the uplink after the restart");

    // Stopped, then cleaned up: nothing is left, the L3 copy's program
    // arrays (`<root>/l3`) included, and no program on the L3 devices.
    let World { agent, node, root, uplink, pod_link, .. } = world;
    agent.expect("an agent runs").stop()?;
    let out = node.ns.command(agent_bin().to_str().unwrap()).args(["cleanup", "--bpffs-root"]).arg(&root).output()?;
    anyhow::ensure!(out.status.success(), "cleanup: {}", String::from_utf8_lossy(&out.stderr));
    assert!(!root.exists(), "left under {}: {:?}", root.display(), std::fs::read_dir(&root)?.flatten().map(|e| e.path()).collect::<Vec<_>>());
    for ifname in [&uplink, &pod_link] {
        assert!(!tc_attached(&node.ns, ifname)? && !tc_attached_egress(&node.ns, ifname)?, "{ifname} still has programs");
    }
    Ok(())
}
