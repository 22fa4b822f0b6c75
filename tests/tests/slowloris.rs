//! The agent's HTTP servers under a slowloris attack: hundreds of
//! connections to /healthz that send nothing, half a request line, or a
//! request head a byte at a time. A normal GET /healthz is still answered
//! 200, and the server closes every one of the attacking connections once
//! its header timeout runs out. Outcomes only (answered, closed), under
//! generous deadlines: how fast belongs in benchmarks.

#![feature(custom_test_frameworks)]
#![test_runner(proxy_tests::harness::run)]

use std::{
    io::{ErrorKind, Read, Write},
    net::{Ipv4Addr, SocketAddr, TcpStream},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use proxy_tests::{agent::Agent, bpffs::Bpffs, manifests::echo_service, patience, topology::Node};
use proxy_user::http_server::{HEADER_READ_TIMEOUT, MAX_CONNECTIONS};

const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const TIMEOUT: Duration = Duration::from_secs(20);
/// More than the server takes at once, so some wait in the listen backlog.
const ATTACKERS: usize = MAX_CONNECTIONS * 2 + MAX_CONNECTIONS / 2;
/// Each attacking connection is accepted within a few header timeouts (the
/// backlog drains a server-full at a time) and closed one timeout later.
fn deadline() -> Duration {
    patience(HEADER_READ_TIMEOUT * 12)
}

#[derive(Clone, Copy, Debug)]
enum Attack {
    Silent,
    PartialLine,
    Drip,
}

const HEAD: &[u8] = b"GET /healthz HTTP/1.1\r\nHost: node\r\nUser-Agent: slowloris\r\nX-Padding: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";

/// GET /healthz on a fresh connection: the status, once the whole answer is
/// in, or an error at `by`.
fn get_healthz(addr: SocketAddr, by: Instant) -> std::io::Result<u16> {
    let left = by.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    let mut s = TcpStream::connect_timeout(&addr, left)?;
    s.set_read_timeout(Some(left))?;
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: node\r\nConnection: close\r\n\r\n")?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).ok_or_else(|| std::io::Error::other(format!("answer: {text:?}")))
}

/// Whether the server closed `s` (EOF or reset) by `by`.
fn closed_by(s: &TcpStream, by: Instant) -> bool {
    let mut buf = [0u8; 512];
    loop {
        let left = by.saturating_duration_since(Instant::now());
        if left.is_zero() || s.set_read_timeout(Some(left)).is_err() {
            return false;
        }
        match (&*s).read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue, // an answer to half a request would be a bug, but not a leak
            Err(e) if matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::BrokenPipe) => return true,
            Err(_) => return false,
        }
    }
}

#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn healthz_answers_through_a_slowloris_attack_and_the_attackers_are_closed() -> Result<()> {
    let mut node = Node::new("slow")?;
    let backend = node.add_pod("backend-1", Ipv4Addr::new(10, 244, 0, 11))?;
    let bpffs = Bpffs::new("slow")?;
    let root = bpffs.path().join("agent");
    let manifests = tempfile::tempdir()?;
    std::fs::write(manifests.path().join("echo.yaml"), echo_service("demo", "echo", CLUSTER_IP, &[backend.ip]))?;
    let mut agent = Agent::start(&node.ns, manifests.path(), &root, &[])?;
    agent.wait_healthy(&node.ns, TIMEOUT)?;
    let addr = agent.healthz;

    // The attack, opened from inside the node (the sockets stay there).
    let attackers: Vec<(Attack, TcpStream)> = node.ns.run(move || -> std::io::Result<Vec<(Attack, TcpStream)>> {
        (0..ATTACKERS)
            .map(|i| {
                let kind = [Attack::Silent, Attack::PartialLine, Attack::Drip][i % 3];
                let mut s = TcpStream::connect(addr)?;
                if let Attack::PartialLine = kind {
                    s.write_all(b"GET /heal")?;
                }
                Ok((kind, s))
            })
            .collect()
    })??;
    let attackers = Arc::new(attackers);
    let started = Instant::now();
    let by = started + deadline();

    // Drip: one more byte of the head to each every half second, until the
    // server shuts it (a write fails), the head runs out, or the test ends.
    let stop = Arc::new(AtomicBool::new(false));
    let dripper = {
        let (attackers, stop) = (attackers.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut live: Vec<&TcpStream> =
                attackers.iter().filter(|(k, _)| matches!(k, Attack::Drip)).map(|(_, s)| s).collect();
            for byte in HEAD.chunks(1) {
                if stop.load(Ordering::Relaxed) || live.is_empty() || Instant::now() > by {
                    break;
                }
                live.retain(|s| {
                    let mut w = *s;
                    w.write_all(byte).is_ok()
                });
                std::thread::sleep(Duration::from_millis(500));
            }
        })
    };

    // A normal client gets its answer while the attack goes on.
    let status = node.ns.run(move || get_healthz(addr, by))?;
    let status = status.with_context(|| format!("GET /healthz during the attack\n{}", agent.logs()))?;
    assert_eq!(status, 200, "GET /healthz during the attack");

    // Every attacking connection is closed by the server.
    let open: Vec<(usize, Attack)> =
        attackers.iter().enumerate().filter(|(_, (_, s))| !closed_by(s, by)).map(|(i, (k, _))| (i, *k)).collect();
    stop.store(true, Ordering::Relaxed);
    dripper.join().expect("dripper panicked");
    assert!(
        open.is_empty(),
        "{} of {ATTACKERS} slowloris connections still open after {:?}: {:?}",
        open.len(),
        deadline(),
        &open[..open.len().min(10)]
    );

    // And the server is as it was.
    agent.wait_healthy(&node.ns, TIMEOUT)?;
    Ok(())
}
