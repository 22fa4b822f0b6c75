//! A NodePort whose endpoint is a hostNetwork pod on the receiving node
//! (an ingress controller, node-exporter): an external client's packets are
//! translated to the node's own address and delivered locally, and the
//! server's replies, sent by a socket of the node, must leave from the
//! NodePort again (kube-proxy's conntrack does this); the same for a pod
//! reaching it through the ClusterIP.

#![feature(custom_test_frameworks)]
#![test_runner(proxy_tests::harness::run)]

use std::{
    net::{Ipv4Addr, SocketAddr},
    time::Duration,
};

use anyhow::{Context, Result};
use proxy_tests::{
    agent::Agent,
    bpffs::Bpffs,
    echo::{EchoServer, tcp_request, udp_request},
    manifests::{TCP_PORT, TCP_TARGET, UDP_PORT, UDP_TARGET, echo_node_port_service},
    topology::Node,
};

const TIMEOUT: Duration = Duration::from_secs(10);
const NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 81, 1);
const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 81, 2);
const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const TCP_NODE_PORT: u16 = 30080;
const UDP_NODE_PORT: u16 = 30053;

#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn an_external_client_reaches_a_host_network_endpoint_through_a_node_port() -> Result<()> {
    let mut node = Node::new("hostnet")?;
    let ext = node.add_external("ext", NODE_IP, &[EXTERNAL_IP], &[])?;
    let pod = node.add_pod("client", Ipv4Addr::new(10, 244, 0, 2))?;
    // The hostNetwork pod: a server in the node's own namespace.
    let _servers = [EchoServer::start(&node.ns, "hostnet", TCP_TARGET)?, EchoServer::start(&node.ns, "hostnet", UDP_TARGET)?];
    let bpffs = Bpffs::new("hostnet")?;
    let root = bpffs.path().join("agent");
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("svc.yaml"), echo_node_port_service(VIP, &[NODE_IP], TCP_NODE_PORT, UDP_NODE_PORT))?;
    let mut agent = Agent::start(&node.ns, dir.path(), &root, &[])?;
    agent.wait_healthy(&node.ns, TIMEOUT)?;

    let tcp = SocketAddr::from((NODE_IP, TCP_NODE_PORT));
    let r = tcp_request(&ext.ns, tcp).with_context(|| agent.logs())?;
    assert_eq!((r.backend.as_str(), r.from), ("hostnet", tcp));
    let udp = SocketAddr::from((NODE_IP, UDP_NODE_PORT));
    let r = udp_request(&ext.ns, udp).with_context(|| agent.logs())?;
    assert_eq!((r.backend.as_str(), r.from), ("hostnet", udp));
    // A pod reaching the same endpoint through the ClusterIP.
    let vip = SocketAddr::from((VIP, TCP_PORT));
    let r = tcp_request(&pod.ns, vip).with_context(|| agent.logs())?;
    assert_eq!((r.backend.as_str(), r.from), ("hostnet", vip));
    let r = udp_request(&pod.ns, SocketAddr::from((VIP, UDP_PORT))).with_context(|| agent.logs())?;
    assert_eq!((r.backend.as_str(), r.from), ("hostnet", SocketAddr::from((VIP, UDP_PORT))));
    Ok(())
}
