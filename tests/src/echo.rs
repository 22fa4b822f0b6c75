//! A tiny TCP and UDP echo server that answers with its own name and the
//! client address it saw, and the matching clients. Everything has timeouts:
//! a lost packet fails a request, it never hangs a test.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpListener, TcpStream, UdpSocket},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::Duration,
};

use anyhow::{Context, Result};

use crate::netns::Netns;

const IO_TIMEOUT: Duration = Duration::from_secs(2);
const POLL: Duration = Duration::from_millis(50);

/// Serves until dropped.
pub struct EchoServer {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl EchoServer {
    /// TCP and UDP on `port`, on every IPv4 address of the namespace.
    pub fn start(ns: &Netns, name: &str, port: u16) -> Result<EchoServer> {
        Self::start_on(ns, name, ([0, 0, 0, 0], port).into())
    }

    /// TCP and UDP on `bind` (`[::]:port`: IPv6 and IPv4 alike).
    pub fn start_on(ns: &Netns, name: &str, bind: SocketAddr) -> Result<EchoServer> {
        let stop = Arc::new(AtomicBool::new(false));

        let tcp = ns.run(move || TcpListener::bind(bind))?.with_context(|| format!("tcp bind {bind} in {}", ns.name))?;
        let udp = ns.run(move || UdpSocket::bind(bind))?.with_context(|| format!("udp bind {bind} in {}", ns.name))?;
        tcp.set_nonblocking(true)?;
        udp.set_read_timeout(Some(POLL))?;

        let (n1, s1) = (name.to_string(), stop.clone());
        let tcp_thread = std::thread::spawn(move || serve_tcp(tcp, &n1, &s1));
        let (n2, s2) = (name.to_string(), stop.clone());
        let udp_thread = std::thread::spawn(move || serve_udp(udp, &n2, &s2));
        Ok(EchoServer { stop, threads: vec![tcp_thread, udp_thread] })
    }
}

impl EchoServer {
    /// A kernel SCTP server on `port` (one-to-one sockets): each association
    /// gets the same answer as a TCP connection. Needs the sctp module.
    pub fn start_sctp(ns: &Netns, name: &str, port: u16) -> Result<EchoServer> {
        let bind: SocketAddr = ([0, 0, 0, 0], port).into();
        let listener = ns
            .run(move || -> std::io::Result<TcpListener> {
                let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, Some(socket2::Protocol::from(libc::IPPROTO_SCTP)))?;
                s.set_reuse_address(true)?;
                s.bind(&bind.into())?;
                s.listen(16)?;
                // accept/read/write on a one-to-one SCTP socket are the
                // stream calls std's TCP types make: reuse them.
                Ok(s.into())
            })?
            .with_context(|| format!("sctp bind {bind} in {} (is the sctp module there?)", ns.name))?;
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let (n, s) = (name.to_string(), stop.clone());
        let thread = std::thread::spawn(move || serve_tcp(listener, &n, &s));
        Ok(EchoServer { stop, threads: vec![thread] })
    }
}

impl Drop for EchoServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn serve_tcp(listener: TcpListener, name: &str, stop: &AtomicBool) {
    while !stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((mut conn, peer)) => {
                let _ = conn.set_nonblocking(false);
                let _ = conn.set_read_timeout(Some(IO_TIMEOUT));
                let mut buf = [0u8; 512];
                if let Ok(n) = conn.read(&mut buf) {
                    if n > 0 {
                        let _ = conn.write_all(format!("{name} {peer}\n").as_bytes());
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(POLL),
            Err(_) => std::thread::sleep(POLL),
        }
    }
}

fn serve_udp(socket: UdpSocket, name: &str, stop: &AtomicBool) {
    let mut buf = [0u8; 1500];
    while !stop.load(Ordering::Relaxed) {
        if let Ok((_, peer)) = socket.recv_from(&mut buf) {
            let _ = socket.send_to(format!("{name} {peer}\n").as_bytes(), peer);
        }
    }
}

/// What a client saw: the server's name and the address the answer came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub backend: String,
    /// The client address as the backend saw it.
    pub seen_client: String,
    /// Where the answer came from, as the client's socket reports it.
    pub from: SocketAddr,
}

fn parse_reply(text: &str, from: SocketAddr) -> Result<Reply> {
    let mut words = text.split_whitespace();
    let backend = words.next().context("empty reply")?.to_string();
    let seen_client = words.next().context("reply without client address")?.to_string();
    Ok(Reply { backend, seen_client, from })
}

/// Connects from `ns` to `to`, sends one line and reads the answer.
pub fn tcp_request(ns: &Netns, to: SocketAddr) -> Result<Reply> {
    ns.run(move || -> Result<Reply> {
        let mut s = TcpStream::connect_timeout(&to, IO_TIMEOUT).with_context(|| format!("tcp connect {to}"))?;
        s.set_read_timeout(Some(IO_TIMEOUT))?;
        s.write_all(b"hello\n")?;
        let mut text = String::new();
        s.read_to_string(&mut text).with_context(|| format!("tcp read from {to}"))?;
        parse_reply(&text, s.peer_addr()?)
    })?
}

/// Like `tcp_request`, from a chosen source address and with a timeout, so
/// a DROP (timeout) and a REJECT (refused) can be told apart.
pub fn tcp_request_from(ns: &Netns, from: Option<std::net::IpAddr>, to: SocketAddr, timeout: Duration) -> std::io::Result<Reply> {
    ns.run(move || -> std::io::Result<Reply> {
        let socket = socket2::Socket::new(socket2::Domain::for_address(to), socket2::Type::STREAM, None)?;
        if let Some(ip) = from {
            socket.bind(&SocketAddr::new(ip, 0).into())?;
        }
        socket.connect_timeout(&to.into(), timeout)?;
        let mut s: TcpStream = socket.into();
        s.set_read_timeout(Some(timeout))?;
        s.write_all(b"hello\n")?;
        let mut text = String::new();
        s.read_to_string(&mut text)?;
        parse_reply(&text, s.peer_addr()?).map_err(std::io::Error::other)
    })
    .map_err(std::io::Error::other)?
}

/// One datagram on a connected UDP socket: a REJECT (ICMP port
/// unreachable) shows as ECONNREFUSED on the receive.
pub fn udp_request_connected(ns: &Netns, to: SocketAddr, timeout: Duration) -> std::io::Result<Reply> {
    ns.run(move || -> std::io::Result<Reply> {
        let s = UdpSocket::bind(unspecified(to))?;
        s.connect(to)?;
        s.set_read_timeout(Some(timeout))?;
        s.send(b"hello\n")?;
        let mut buf = [0u8; 1500];
        let n = s.recv(&mut buf)?;
        parse_reply(&String::from_utf8_lossy(&buf[..n]), to).map_err(std::io::Error::other)
    })
    .map_err(std::io::Error::other)?
}

/// Sends one datagram from a fresh socket in `ns` and waits for the answer.
pub fn udp_request(ns: &Netns, to: SocketAddr) -> Result<Reply> {
    ns.run(move || -> Result<Reply> {
        let s = UdpSocket::bind(("0.0.0.0", 0))?;
        s.set_read_timeout(Some(IO_TIMEOUT))?;
        s.send_to(b"hello\n", to)?;
        let mut buf = [0u8; 1500];
        let (n, from) = s.recv_from(&mut buf).with_context(|| format!("udp answer from {to}"))?;
        parse_reply(&String::from_utf8_lossy(&buf[..n]), from)
    })?
}

/// Any address of `to`'s family, any port: where a client socket binds.
fn unspecified(to: SocketAddr) -> SocketAddr {
    let any: std::net::IpAddr = if to.is_ipv4() { [0u8; 4].into() } else { [0u16; 8].into() };
    SocketAddr::new(any, 0)
}

/// Ok if `result` is a refused connection (a REJECT: TCP reset or ICMP
/// port unreachable), else what happened instead.
pub fn expect_refused(result: std::io::Result<Reply>, what: &str) -> Result<()> {
    match result {
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => Ok(()),
        Err(e) => anyhow::bail!("{what}: {e} ({:?}), want connection refused", e.kind()),
        Ok(r) => anyhow::bail!("{what}: answered by {}, want connection refused", r.backend),
    }
}
