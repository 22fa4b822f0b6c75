//! One agent per `--bpffs-root`: a second agent on the root of a running
//! one — even in another network namespace, where nothing else would stop
//! it — refuses at once with one line naming the root and the holder, and
//! the first keeps serving; `cleanup` refuses too. Once the first is
//! SIGKILLed (no chance to clean up), a new agent takes the root at once.

#![feature(custom_test_frameworks)]
#![test_runner(proxy_tests::harness::run)]

use std::{
    net::{Ipv4Addr, SocketAddr},
    process::Stdio,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use proxy_tests::{
    agent::{Agent, agent_bin},
    bpffs::Bpffs,
    echo::{EchoServer, tcp_request},
    manifests::{TCP_PORT, TCP_TARGET, echo_service},
    netns::Netns,
    topology::Node,
};

const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const TIMEOUT: Duration = Duration::from_secs(20);

#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn a_second_agent_on_the_same_root_refuses_and_a_killed_ones_successor_starts() -> Result<()> {
    let mut node = Node::new("lock")?;
    let client = node.add_pod("client", Ipv4Addr::new(10, 244, 0, 2))?;
    let backend = node.add_pod("backend-1", Ipv4Addr::new(10, 244, 0, 11))?;
    let _server = EchoServer::start(&backend.ns, &backend.name, TCP_TARGET)?;
    let vip = SocketAddr::from((CLUSTER_IP, TCP_PORT));
    let bpffs = Bpffs::new("lock")?;
    let root = bpffs.path().join("agent");
    let manifests = tempfile::tempdir()?;
    std::fs::write(manifests.path().join("echo.yaml"), echo_service("demo", "echo", CLUSTER_IP, &[backend.ip]))?;

    let mut first = Agent::start(&node.ns, manifests.path(), &root, &[])?;
    first.wait_healthy(&node.ns, TIMEOUT)?;
    tcp_request(&client.ns, vip).with_context(|| first.logs())?;

    // The second in a namespace of its own: its ports are free there, so
    // only the root can stop it.
    let elsewhere = Netns::new(&format!("{}-other", node.prefix))?;
    let cgroup_root = proxy_tests::cgroup::TestRoot::get()?;
    let mut second = elsewhere
        .command(agent_bin().to_str().context("agent path is not UTF-8")?)
        .arg("run")
        .arg("--manifests")
        .arg(manifests.path())
        .arg("--bpffs-root")
        .arg(&root)
        .arg("--node-name")
        .arg("node-a")
        .arg("--cgroup-root")
        .arg(&cgroup_root.path)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    let deadline = Instant::now() + proxy_tests::patience(TIMEOUT);
    let status = loop {
        if let Some(status) = second.try_wait()? {
            break status;
        }
        if Instant::now() > deadline {
            let _ = second.kill();
            let _ = second.wait();
            anyhow::bail!("a second agent started on {} while another ran there", root.display());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut second.stderr.take().context("agent stderr")?, &mut stderr)?;
    assert!(!status.success(), "exit status {status}; stderr:\n{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "one line:\n{stderr}");
    let expected = format!("--bpffs-root {} is in use by another agent, ebpf-proxy (pid {})", root.display(), first.pid());
    assert!(stderr.contains(&expected), "stderr lacks {expected:?}:\n{stderr}");
    assert!(stderr.contains("Stop that one first"), "says what to do:\n{stderr}");

    // The first never noticed.
    first.wait_healthy(&node.ns, TIMEOUT)?;
    tcp_request(&client.ns, vip).with_context(|| first.logs())?;

    // cleanup takes the same lock, so it refuses by it.
    let out = node.ns.command(agent_bin().to_str().unwrap()).args(["cleanup", "--bpffs-root"]).arg(&root).output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "cleanup ran under the agent: {err}");
    let expected = format!("ebpf-proxy (pid {}) runs on --bpffs-root {}: stop the agent first", first.pid(), root.display());
    assert!(err.contains(&expected), "cleanup stderr lacks {expected:?}:\n{err}");

    // SIGKILL releases the lock with the process: the next agent starts.
    let status = first.kill()?;
    assert!(!status.success(), "killed, not exited: {status}");
    let mut successor = Agent::start(&node.ns, manifests.path(), &root, &[])?;
    successor.wait_healthy(&node.ns, TIMEOUT)?;
    tcp_request(&client.ns, vip).with_context(|| successor.logs())?;
    Ok(())
}
