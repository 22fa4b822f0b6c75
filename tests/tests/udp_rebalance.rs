//! kube-proxy's longest-standing bug, tested: a UDP client keeps one flow
//! (one socket, so one 5-tuple) to a ClusterIP while the backend that flow
//! uses goes away (removed from the EndpointSlice and its server stopped).
//! Every datagram sent after the agent applied the change must be answered
//! by the live backend: no stale conntrack entry black-holes the flow.

#![feature(custom_test_frameworks)]
#![test_runner(proxy_tests::harness::run)]

use std::{
    net::{Ipv4Addr, SocketAddr, UdpSocket},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use proxy_tests::{
    agent::{Agent, dumped_backends, wait_until},
    bpffs::Bpffs,
    echo::EchoServer,
    manifests::{UDP_PORT, UDP_TARGET, echo_service},
    topology::Node,
};

const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 53);
const TIMEOUT: Duration = Duration::from_secs(10);
/// Datagrams that must be answered after the change was applied.
const AFTER: usize = 50;

/// One datagram: when it was sent, and which backend answered (None: lost).
struct Sent {
    seq: u32,
    at: Instant,
    answered_by: Option<String>,
}

#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn udp_flow_moves_to_a_live_backend_when_its_backend_is_removed() -> Result<()> {
    let backend_ip = |n: u8| Ipv4Addr::new(10, 244, 1, 10 + n);
    let mut node = Node::new("udprb")?;
    let client = node.add_pod("client", Ipv4Addr::new(10, 244, 1, 2))?;
    let b1 = node.add_pod("backend-1", backend_ip(1))?;
    let b2 = node.add_pod("backend-2", backend_ip(2))?;
    let mut servers = vec![
        Some(EchoServer::start(&b1.ns, "backend-1", UDP_TARGET)?),
        Some(EchoServer::start(&b2.ns, "backend-2", UDP_TARGET)?),
    ];

    let bpffs = Bpffs::new("udprb")?;
    let root = bpffs.path().join("agent");
    let manifests = tempfile::tempdir()?;
    let svc_file = manifests.path().join("svc.yaml");
    std::fs::write(&svc_file, echo_service("demo", "dns", CLUSTER_IP, &[backend_ip(1), backend_ip(2)]))?;
    let mut agent = Agent::start(&node.ns, manifests.path(), &root, &[])?;
    agent.wait_healthy(&node.ns, TIMEOUT)?;

    // The client: one connected socket, one datagram at a time, each waiting
    // for its answer (so an answer belongs to the datagram just sent).
    let vip = SocketAddr::from((CLUSTER_IP, UDP_PORT));
    let stop = Arc::new(AtomicBool::new(false));
    let log: Arc<Mutex<Vec<Sent>>> = Arc::default();
    let (stop2, log2) = (stop.clone(), log.clone());
    let sender = client.ns.spawn(move || -> Result<()> {
        let socket = UdpSocket::bind(("0.0.0.0", 0))?;
        socket.connect(vip)?;
        socket.set_read_timeout(Some(Duration::from_millis(300)))?;
        let mut buf = [0u8; 512];
        let mut seq = 0u32;
        while !stop2.load(Ordering::Relaxed) {
            let at = Instant::now();
            socket.send(format!("seq {seq}\n").as_bytes())?;
            // ECONNREFUSED or silence both count as lost.
            let answered_by = match socket.recv(&mut buf) {
                Ok(n) => String::from_utf8_lossy(&buf[..n]).split_whitespace().next().map(str::to_string),
                Err(_) => None,
            };
            log2.lock().unwrap().push(Sent { seq, at, answered_by });
            seq += 1;
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    })?;

    let answered = |log: &[Sent]| log.iter().filter(|s| s.answered_by.is_some()).count();
    wait_until("the flow to be answered", TIMEOUT, || Ok(answered(&log.lock().unwrap()) >= 10))
        .with_context(|| agent.logs())?;
    let pinned = log.lock().unwrap().iter().find_map(|s| s.answered_by.clone()).unwrap();
    let (gone, live, live_ip) = match pinned.as_str() {
        "backend-1" => (0, "backend-2", backend_ip(2)),
        _ => (1, "backend-1", backend_ip(1)),
    };

    // The flow's backend goes away: out of the slice, and its server stops.
    let changed = Instant::now();
    std::fs::write(&svc_file, echo_service("demo", "dns", CLUSTER_IP, &[live_ip]))?;
    servers[gone] = None;
    let want = vec![format!("{live_ip}:{UDP_TARGET}")];
    wait_until("the agent to apply the removal", TIMEOUT, || {
        Ok(dumped_backends(&root, &format!("{CLUSTER_IP}:{UDP_PORT}/UDP"))? == want)
    })
    .with_context(|| agent.logs())?;
    let applied = Instant::now();
    let after = |log: &[Sent]| log.iter().filter(|s| s.at > applied).count();
    // Bounded: the sender loses at most 300 ms a datagram.
    let _ = wait_until("datagrams after the change", Duration::from_secs(30), || Ok(after(&log.lock().unwrap()) >= AFTER));
    stop.store(true, Ordering::Relaxed);
    sender.join().map_err(|_| anyhow::anyhow!("sender panicked"))??;

    let log = log.lock().unwrap();
    // Between the change and `applied` the flow may already have moved.
    let before: Vec<&Sent> = log.iter().filter(|s| s.at < changed).collect();
    let after: Vec<&Sent> = log.iter().filter(|s| s.at > applied).collect();
    assert!(after.len() >= AFTER, "only {} datagrams sent after the change", after.len());
    assert!(
        before.iter().filter_map(|s| s.answered_by.as_deref()).all(|b| b == pinned),
        "one flow, one backend: before the change answers came from several backends"
    );
    let wrong: Vec<String> = after
        .iter()
        .filter(|s| s.answered_by.as_deref() != Some(live))
        .map(|s| format!("seq {}: {}", s.seq, s.answered_by.as_deref().unwrap_or("no answer")))
        .collect();
    assert!(
        wrong.is_empty(),
        "{} of {} datagrams after the change were not answered by {live} (the flow was pinned to {pinned}): {}\n{}",
        wrong.len(),
        after.len(),
        wrong.iter().take(10).cloned().collect::<Vec<_>>().join(", "),
        agent.logs()
    );
    Ok(())
}
