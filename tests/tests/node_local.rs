//! Services for processes on the node itself, translated at the socket by
//! the cgroup hooks: a node process reaches a ClusterIP and a NodePort over
//! TCP and UDP, sees the service address as its peer (getpeername, recvmsg),
//! gets ECONNREFUSED from a Service without endpoints, and a process outside
//! the agent's cgroup is left alone. The hooks outlive a SIGTERM and go with
//! `cleanup`. The same for an IPv6 Service, through the IPv6 hooks.

use std::{
    collections::BTreeSet,
    net::{Ipv4Addr, Ipv6Addr, SocketAddr},
    time::Duration,
};

use anyhow::{Context, Result};
use proxy_tests::{
    agent::Agent,
    bpffs::Bpffs,
    cgroup::Cgroup,
    echo::EchoServer,
    is_root,
    netns::Netns,
    topology::Node,
};

const NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 0, 2);
const TIMEOUT: Duration = Duration::from_secs(10);

const MANIFESTS: &str = r#"apiVersion: v1
kind: Service
metadata: {name: web, namespace: demo}
spec:
  type: NodePort
  clusterIP: 10.96.0.10
  ports:
  - {name: tcp, port: 80, targetPort: 8080, nodePort: 30080}
  - {name: udp, port: 53, targetPort: 5353, protocol: UDP}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: demo, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: tcp, port: 8080}, {name: udp, port: 5353, protocol: UDP}]
endpoints:
- {addresses: [10.244.0.11]}
- {addresses: [10.244.0.12]}
---
apiVersion: v1
kind: Service
metadata: {name: empty, namespace: demo}
spec:
  clusterIP: 10.96.0.12
  ports: [{name: tcp, port: 80}]
"#;

/// What a REJECTed connect() says: ECONNREFUSED where the socket hooks can
/// set the errno (bpf_set_retval, Linux 5.18), EPERM before that.
fn refused() -> Result<&'static str> {
    Ok(if proxy_user::kernel::probe()?.sock_set_retval { "error=ConnectionRefused" } else { "error=PermissionDenied" })
}

/// `netprobe` as a node process: in the node's namespace and cgroup.
fn probe(cg: Option<&Cgroup>, node: &Netns, proto: &str, to: &str) -> Result<String> {
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_netprobe"));
    let mut cmd = match cg {
        Some(cg) => cg.command(node, bin),
        None => {
            let mut c = node.command(bin.to_str().unwrap());
            c.arg0("netprobe");
            c
        }
    };
    let out = cmd.args([proto, to]).output().context("run netprobe")?;
    anyhow::ensure!(out.status.success(), "netprobe {proto} {to}: {}", String::from_utf8_lossy(&out.stderr));
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

use std::os::unix::process::CommandExt as _;

#[test]
fn node_processes_reach_services_through_the_socket_hooks() -> Result<()> {
    assert!(is_root(), "needs root (network namespaces, cgroups and BPF)");
    let mut node = Node::new("nodelocal")?;
    let b1 = node.add_pod("b1", Ipv4Addr::new(10, 244, 0, 11))?;
    let b2 = node.add_pod("b2", Ipv4Addr::new(10, 244, 0, 12))?;
    let _lan = node.add_external("lan", NODE_IP, &[Ipv4Addr::new(203, 0, 113, 2)], &[])?;
    let mut servers = Vec::new();
    for p in [&b1, &b2] {
        servers.push(EchoServer::start(&p.ns, &p.name, 8080)?);
        servers.push(EchoServer::start(&p.ns, &p.name, 5353)?);
    }
    let cg = Cgroup::new("nodelocal")?;
    let bpffs = Bpffs::new("nodelocal")?;
    let root = bpffs.path().join("agent");
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("svc.yaml"), MANIFESTS)?;
    let cg_flag = cg.path().to_str().unwrap().to_string();
    let mut agent = Agent::start(&node.ns, dir.path(), &root, &["--cgroup-root", &cg_flag])?;
    agent.wait_healthy(&node.ns, TIMEOUT)?;

    for (proto, to, port) in [("tcp", "10.96.0.10:80", 8080), ("udp", "10.96.0.10:53", 5353), ("tcp", "192.168.0.2:30080", 8080)] {
        let answered = backends_answering(&cg, &node.ns, &agent, proto, to)?;
        assert_eq!(answered, BTreeSet::from(["b1".to_string(), "b2".to_string()]), "{proto} {to} (backend port {port})");
    }
    assert_eq!(probe(Some(&cg), &node.ns, "tcp", "10.96.0.12:80")?, refused()?, "no endpoints: REJECT");
    // A process outside the agent's cgroup is not translated (the ClusterIP
    // is not routable from the node: no answer).
    let outside = probe(None, &node.ns, "tcp", "10.96.0.10:80")?;
    assert!(outside.starts_with("error="), "outside the cgroup: {outside}");
    // SIGTERM leaves the hooks serving; cleanup removes them.
    let status = agent.stop()?;
    assert!(status.success(), "agent exit status {status}");
    assert!(probe(Some(&cg), &node.ns, "tcp", "10.96.0.10:80")?.starts_with("peer=10.96.0.10:80 "), "hooks kept after SIGTERM");
    let out = node.ns.command(proxy_tests::agent::agent_bin().to_str().unwrap()).args(["cleanup", "--bpffs-root"]).arg(&root).output()?;
    assert!(out.status.success(), "cleanup: {}", String::from_utf8_lossy(&out.stderr));
    let after = probe(Some(&cg), &node.ns, "tcp", "10.96.0.10:80")?;
    assert!(after.starts_with("error="), "still translated after cleanup: {after}");
    Ok(())
}

const MANIFESTS_V6: &str = r#"apiVersion: v1
kind: Service
metadata: {name: web6, namespace: demo}
spec:
  clusterIP: fd00:96::10
  ipFamilies: [IPv6]
  ports:
  - {name: tcp, port: 80, targetPort: 8080}
  - {name: udp, port: 53, targetPort: 5353, protocol: UDP}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web6-1, namespace: demo, labels: {kubernetes.io/service-name: web6}}
addressType: IPv6
ports: [{name: tcp, port: 8080}, {name: udp, port: 5353, protocol: UDP}]
endpoints:
- {addresses: ["fd00:244::11"]}
- {addresses: ["fd00:244::12"]}
---
apiVersion: v1
kind: Service
metadata: {name: empty6, namespace: demo}
spec:
  clusterIP: fd00:96::12
  ipFamilies: [IPv6]
  ports: [{name: tcp, port: 80}]
"#;

/// The backends that answer 12 requests from a process in `cg` to `to`;
/// each socket must report the address dialled, not the backend's.
fn backends_answering(cg: &Cgroup, ns: &Netns, agent: &Agent, proto: &str, to: &str) -> Result<BTreeSet<String>> {
    let mut answered = BTreeSet::new();
    for _ in 0..12 {
        let line = probe(Some(cg), ns, proto, to).with_context(|| agent.logs())?;
        assert!(line.starts_with(&format!("peer={to} reply=")), "{proto} {to}: {line}\n{}", agent.logs());
        let backend = line.split("reply=").nth(1).and_then(|r| r.split_whitespace().next()).unwrap_or_default();
        answered.insert(backend.to_string());
    }
    Ok(answered)
}

/// connect6 and sendmsg6 pick a backend, getpeername6 and recvmsg6 show the
/// ClusterIP back, and a Service without endpoints is refused.
#[test]
fn node_processes_reach_ipv6_services_through_the_socket_hooks() -> Result<()> {
    assert!(is_root(), "needs root (network namespaces, cgroups and BPF)");
    let mut node = Node::new("nodelocal6")?;
    // The node's own IPv6 address: the source its processes reach pods from.
    node.ns.ip(&["addr", "add", "2001:db8::2/128", "dev", "lo", "nodad"])?;
    let b1 = node.add_pod("b1", "fd00:244::11".parse::<Ipv6Addr>()?)?;
    let b2 = node.add_pod("b2", "fd00:244::12".parse::<Ipv6Addr>()?)?;
    let mut servers = Vec::new();
    for p in [&b1, &b2] {
        for port in [8080, 5353] {
            servers.push(EchoServer::start_on(&p.ns, &p.name, SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), port))?);
        }
    }
    let cg = Cgroup::new("nodelocal6")?;
    let bpffs = Bpffs::new("nodelocal6")?;
    let root = bpffs.path().join("agent");
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("svc.yaml"), MANIFESTS_V6)?;
    let cg_flag = cg.path().to_str().unwrap().to_string();
    let mut agent = Agent::start(&node.ns, dir.path(), &root, &["--cgroup-root", &cg_flag])?;
    agent.wait_healthy(&node.ns, TIMEOUT)?;

    for (proto, to) in [("tcp", "[fd00:96::10]:80"), ("udp", "[fd00:96::10]:53")] {
        let answered = backends_answering(&cg, &node.ns, &agent, proto, to)?;
        assert_eq!(answered, BTreeSet::from(["b1".to_string(), "b2".to_string()]), "{proto} {to}");
    }
    assert_eq!(probe(Some(&cg), &node.ns, "tcp", "[fd00:96::12]:80")?, refused()?, "no endpoints: REJECT");
    let outside = probe(None, &node.ns, "tcp", "[fd00:96::10]:80")?;
    assert!(outside.starts_with("error="), "outside the cgroup: {outside}");
    Ok(())
}
