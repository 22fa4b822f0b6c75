//! `cargo xtask demo`: a node namespace with three echo pods and a client,
//! the agent on sample manifests, traffic to the ClusterIP, and the maps.
//! Everything is removed at the end, also on Ctrl-C.

use std::{
    net::{Ipv4Addr, SocketAddr},
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use anyhow::{Context, Result};

use crate::{
    agent::Agent,
    bpffs::Bpffs,
    echo::{EchoServer, tcp_request, udp_request},
    manifests::{TCP_PORT, TCP_TARGET, UDP_PORT, UDP_TARGET, echo_service},
    topology::Node,
};

const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const REQUESTS: usize = 6;

pub fn run(agent_bin: &Path) -> Result<()> {
    anyhow::ensure!(crate::is_root(), "the demo creates network namespaces and loads BPF programs: run it as root");
    // SAFETY of env: set before any thread of ours reads it.
    unsafe { std::env::set_var("EBPF_PROXY_BIN", agent_bin) };
    let interrupted = Arc::new(AtomicBool::new(false));
    let flag = interrupted.clone();
    ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst)).context("install Ctrl-C handler")?;
    let step = |what: &str| -> Result<()> {
        anyhow::ensure!(!interrupted.load(Ordering::SeqCst), "interrupted; cleaning up");
        println!("==> {what}");
        Ok(())
    };

    step("creating a node namespace with a client pod and three echo pods")?;
    let mut node = Node::new("demo")?;
    let client = node.add_pod("client", Ipv4Addr::new(10, 244, 0, 2))?;
    let mut pods = Vec::new();
    let mut servers = Vec::new();
    for i in 1..=3u8 {
        let pod = node.add_pod(&format!("echo-{i}"), Ipv4Addr::new(10, 244, 0, 10 + i))?;
        servers.push(EchoServer::start(&pod.ns, &pod.name, TCP_TARGET)?);
        servers.push(EchoServer::start(&pod.ns, &pod.name, UDP_TARGET)?);
        println!("    pod {:<8} {:<12} namespace {}", pod.name, pod.ip, pod.ns.name);
        pods.push(pod);
    }
    println!("    pod {:<8} {:<12} namespace {}", "client", client.ip, client.ns.name);

    step("starting the agent on the sample manifests")?;
    let bpffs = Bpffs::new("demo")?;
    let manifests = tempfile::tempdir()?;
    let yaml = echo_service("demo", "echo", CLUSTER_IP, &pods.iter().map(|p| p.ip).collect::<Vec<_>>());
    std::fs::write(manifests.path().join("echo.yaml"), &yaml)?;
    let root = bpffs.path().join("agent");
    let mut agent = Agent::start(&node.ns, manifests.path(), &root, &[])?;
    agent.wait_healthy(&node.ns, Duration::from_secs(15))?;
    println!("    agent healthy; manifests in {}, maps pinned under {}", manifests.path().display(), root.display());

    step(&format!("TCP requests from the client to {CLUSTER_IP}:{TCP_PORT}"))?;
    let vip = SocketAddr::from((CLUSTER_IP, TCP_PORT));
    for i in 1..=REQUESTS {
        let r = tcp_request(&client.ns, vip)?;
        println!("    request {i}: answered by {:<7} (reply from {}, backend saw client {})", r.backend, r.from, r.seen_client);
    }
    step(&format!("UDP requests from the client to {CLUSTER_IP}:{UDP_PORT}"))?;
    let vip = SocketAddr::from((CLUSTER_IP, UDP_PORT));
    for i in 1..=REQUESTS {
        let r = udp_request(&client.ns, vip)?;
        println!("    request {i}: answered by {:<7} (reply from {}, backend saw client {})", r.backend, r.from, r.seen_client);
    }

    for what in ["services", "backends", "conntrack"] {
        step(&format!("ebpf-proxy dump {what}"))?;
        let out = std::process::Command::new(agent_bin).args(["dump", what, "--bpffs-root"]).arg(&root).output()?;
        print!("{}", String::from_utf8_lossy(&out.stdout));
        eprint!("{}", String::from_utf8_lossy(&out.stderr));
    }

    step("cleaning up (agent, namespaces, bpffs)")?;
    drop(agent);
    drop(servers);
    Ok(())
}
