//! Long-lived traffic for restart and upgrade tests: a raw TCP and UDP echo
//! server, and a client that keeps one TCP connection busy with numbered
//! round trips and sends a steady stream of numbered UDP datagrams. Any
//! reset, stall or mismatch on the TCP stream, and every datagram that never
//! came back, is reported.

use std::{
    collections::BTreeSet,
    io::{Read, Write},
    net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};

use crate::netns::Netns;

/// A stalled flow fails instead of hanging the test.
const STALL: Duration = Duration::from_secs(5);
const POLL: Duration = Duration::from_millis(50);
/// Pace of the flows: steady, without hogging the CPUs the agent needs.
const PACE: Duration = Duration::from_millis(2);

/// Echoes every byte on TCP `tcp_port` and every datagram on UDP `udp_port`, until dropped.
pub struct RawEcho {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl RawEcho {
    pub fn start(ns: &Netns, tcp_port: u16, udp_port: u16) -> Result<RawEcho> {
        Self::start_on(ns, tcp_port, udp_port, &[Ipv4Addr::UNSPECIFIED])
    }

    /// As `start`, with a UDP socket bound to each of `udp_addrs`: a pod
    /// with several addresses answers each datagram from the address it was
    /// sent to (one bound to 0.0.0.0 would answer from its primary one).
    pub fn start_on(ns: &Netns, tcp_port: u16, udp_port: u16, udp_addrs: &[Ipv4Addr]) -> Result<RawEcho> {
        let stop = Arc::new(AtomicBool::new(false));
        let tcp = ns.run(move || TcpListener::bind(("0.0.0.0", tcp_port)))??;
        tcp.set_nonblocking(true)?;
        let s = stop.clone();
        let tcp_thread = std::thread::spawn(move || {
            let mut conns = Vec::new();
            while !s.load(Ordering::Relaxed) {
                match tcp.accept() {
                    Ok((conn, _)) => {
                        let s = s.clone();
                        conns.push(std::thread::spawn(move || echo_stream(conn, &s)));
                    }
                    Err(_) => std::thread::sleep(POLL),
                }
            }
            conns.into_iter().for_each(|c| drop(c.join()));
        });
        let mut threads = vec![tcp_thread];
        for &addr in udp_addrs {
            let udp = ns.run(move || UdpSocket::bind((addr, udp_port)))??;
            udp.set_read_timeout(Some(POLL))?;
            let s = stop.clone();
            threads.push(std::thread::spawn(move || {
                let mut buf = [0u8; 64];
                while !s.load(Ordering::Relaxed) {
                    if let Ok((n, peer)) = udp.recv_from(&mut buf) {
                        let _ = udp.send_to(&buf[..n], peer);
                    }
                }
            }));
        }
        Ok(RawEcho { stop, threads })
    }
}

fn echo_stream(mut conn: TcpStream, stop: &AtomicBool) {
    let _ = conn.set_read_timeout(Some(POLL));
    let mut buf = [0u8; 4096];
    while !stop.load(Ordering::Relaxed) {
        match conn.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => {
                if conn.write_all(&buf[..n]).is_err() {
                    return;
                }
            }
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(_) => return,
        }
    }
}

impl Drop for RawEcho {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.threads.drain(..).for_each(|t| drop(t.join()));
    }
}

#[derive(Default)]
struct Shared {
    stop_sending: AtomicBool,
    stop_receiving: AtomicBool,
    tcp_round_trips: AtomicU64,
    udp_sent: AtomicU64,
    udp_received: Mutex<BTreeSet<u64>>,
    errors: Mutex<Vec<String>>,
}

/// One TCP stream and one UDP flow, running until `finish`.
pub struct SteadyFlows {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    pub tcp_round_trips: u64,
    pub udp_sent: u64,
    pub udp_received: u64,
}

#[derive(Debug)]
pub struct Report {
    pub tcp_round_trips: u64,
    pub udp_sent: u64,
    /// Sequence numbers sent and never echoed back.
    pub udp_lost: Vec<u64>,
    /// Resets, stalls, wrong bytes, replies from the wrong address.
    pub errors: Vec<String>,
}

impl SteadyFlows {
    /// Connects from `client` to `tcp_to` and starts both flows.
    pub fn start(client: &Netns, tcp_to: SocketAddr, udp_to: SocketAddr) -> Result<SteadyFlows> {
        let tcp = client.run(move || TcpStream::connect_timeout(&tcp_to, STALL))?.with_context(|| format!("connect {tcp_to}"))?;
        let udp = client.run(move || -> std::io::Result<UdpSocket> {
            let s = UdpSocket::bind("0.0.0.0:0")?;
            // Connected: replies from anything but the address dialled are not accepted.
            s.connect(udp_to)?;
            Ok(s)
        })??;
        tcp.set_read_timeout(Some(STALL))?;
        udp.set_read_timeout(Some(POLL))?;
        let shared = Arc::new(Shared::default());
        let mut threads = Vec::new();

        let sh = shared.clone();
        threads.push(std::thread::spawn(move || {
            let mut tcp = tcp;
            let mut seq = 0u64;
            while !sh.stop_sending.load(Ordering::Relaxed) {
                let mut back = [0u8; 8];
                let res = tcp.write_all(&seq.to_be_bytes()).and_then(|()| tcp.read_exact(&mut back));
                match res {
                    Ok(()) if back == seq.to_be_bytes() => {}
                    Ok(()) => {
                        sh.errors.lock().unwrap().push(format!("tcp: round trip {seq} came back as {}", u64::from_be_bytes(back)));
                        return;
                    }
                    Err(e) => {
                        sh.errors.lock().unwrap().push(format!("tcp: {e} after {seq} round trips"));
                        return;
                    }
                }
                seq += 1;
                sh.tcp_round_trips.store(seq, Ordering::Relaxed);
                std::thread::sleep(PACE);
            }
        }));

        let sender = udp.try_clone()?;
        let sh = shared.clone();
        threads.push(std::thread::spawn(move || {
            let mut seq = 0u64;
            while !sh.stop_sending.load(Ordering::Relaxed) {
                if let Err(e) = sender.send(&seq.to_be_bytes()) {
                    sh.errors.lock().unwrap().push(format!("udp: send {seq}: {e}"));
                    return;
                }
                seq += 1;
                sh.udp_sent.store(seq, Ordering::Relaxed);
                std::thread::sleep(PACE);
            }
        }));

        let sh = shared.clone();
        threads.push(std::thread::spawn(move || {
            let mut buf = [0u8; 64];
            while !sh.stop_receiving.load(Ordering::Relaxed) {
                match udp.recv(&mut buf) {
                    Ok(8) => {
                        let seq = u64::from_be_bytes(buf[..8].try_into().unwrap());
                        sh.udp_received.lock().unwrap().insert(seq);
                    }
                    Ok(n) => sh.errors.lock().unwrap().push(format!("udp: a {n}-byte reply")),
                    Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
                    // ICMP unreachable while nothing translated: a lost datagram, counted below.
                    Err(e) => sh.errors.lock().unwrap().push(format!("udp: {e}")),
                }
            }
        }));
        Ok(SteadyFlows { shared, threads })
    }

    pub fn progress(&self) -> Progress {
        Progress {
            tcp_round_trips: self.shared.tcp_round_trips.load(Ordering::Relaxed),
            udp_sent: self.shared.udp_sent.load(Ordering::Relaxed),
            udp_received: self.shared.udp_received.lock().unwrap().len() as u64,
        }
    }

    pub fn errors(&self) -> Vec<String> {
        self.shared.errors.lock().unwrap().clone()
    }

    /// Waits until both flows made `n` more exchanges than `since`, or fails
    /// on the first error or when they stall.
    pub fn wait_progress(&self, since: Progress, n: u64) -> Result<Progress> {
        // Each flow must move on its own: UDP answers coming in do not hide
        // a stalled TCP stream, nor the reverse.
        let mut last = self.progress();
        let (mut tcp_moved, mut udp_moved) = (Instant::now(), Instant::now());
        loop {
            let errors = self.errors();
            anyhow::ensure!(errors.is_empty(), "flows broke: {errors:?}");
            let p = self.progress();
            let tcp_done = p.tcp_round_trips >= since.tcp_round_trips + n;
            let udp_done = p.udp_received >= since.udp_received + n;
            if tcp_done && udp_done {
                return Ok(p);
            }
            if p.tcp_round_trips != last.tcp_round_trips {
                tcp_moved = Instant::now();
            }
            if p.udp_received != last.udp_received {
                udp_moved = Instant::now();
            }
            last = p;
            anyhow::ensure!(tcp_done || tcp_moved.elapsed() < STALL, "TCP stream stalled at {p:?}");
            anyhow::ensure!(udp_done || udp_moved.elapsed() < STALL, "UDP flow stalled at {p:?}");
            std::thread::sleep(POLL);
        }
    }

    /// Stops sending, gives the last echoes time to arrive, and reports.
    pub fn finish(mut self) -> Report {
        self.shared.stop_sending.store(true, Ordering::Relaxed);
        let sent = self.shared.udp_sent.load(Ordering::Relaxed);
        let deadline = Instant::now() + STALL;
        while (self.shared.udp_received.lock().unwrap().len() as u64) < sent && Instant::now() < deadline {
            std::thread::sleep(POLL);
        }
        self.shared.stop_receiving.store(true, Ordering::Relaxed);
        self.threads.drain(..).for_each(|t| drop(t.join()));
        let received = self.shared.udp_received.lock().unwrap();
        Report {
            tcp_round_trips: self.shared.tcp_round_trips.load(Ordering::Relaxed),
            udp_sent: sent,
            udp_lost: (0..sent).filter(|s| !received.contains(s)).collect(),
            errors: self.errors(),
        }
    }
}

impl Drop for SteadyFlows {
    fn drop(&mut self) {
        self.shared.stop_sending.store(true, Ordering::Relaxed);
        self.shared.stop_receiving.store(true, Ordering::Relaxed);
        self.threads.drain(..).for_each(|t| drop(t.join()));
    }
}

/// One line through an echo on `conn` (a RawEcho's TCP side): written,
/// and read back whole within two seconds.
pub fn echo_round_trip(conn: &mut TcpStream, line: &str) -> Result<()> {
    conn.set_read_timeout(Some(Duration::from_secs(2)))?;
    conn.write_all(line.as_bytes())?;
    let mut got = vec![0; line.len()];
    conn.read_exact(&mut got)?;
    anyhow::ensure!(got == line.as_bytes(), "echo {:?}, want {line:?}", String::from_utf8_lossy(&got));
    Ok(())
}
