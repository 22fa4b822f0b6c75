//! One request of a case, from a socket bound to the case's source address,
//! and what came of it. Connected sockets throughout: a UDP answer from any
//! address but the one dialled is filtered by the kernel (so it shows as no
//! answer), and an ICMP port unreachable surfaces as ECONNREFUSED.

use std::{
    io::{ErrorKind, Read, Write},
    net::{IpAddr, SocketAddr},
    path::Path,
    time::Duration,
};

use socket2::{Domain, Protocol as SockProto, SockAddr, Socket, Type};

use super::data::Protocol;
use crate::{
    cgroup::Cgroup,
    netns::Netns,
    sctp::{self, Capture, chunk},
};

/// What a client sends: echo servers answer anything, and an HTTP server
/// (the agent's healthCheckNodePort) answers this at once.
const REQUEST: &[u8] = b"GET /healthz HTTP/1.0\r\nHost: conformance\r\n\r\n";

/// How long a request waits for a connection or an answer. A dropped packet
/// is recognised by this much silence.
pub const WAIT: Duration = Duration::from_secs(1);

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// An echo server answered: its name ("IP:port" of an endpoint, or
    /// "host:port" for the node itself) and the client address it saw.
    Answer { server: String, seen_client: String },
    /// Something that is no echo server answered (an HTTP server: the
    /// agent's healthCheckNodePort): its first line.
    Other(String),
    /// ECONNREFUSED: a TCP RST or an ICMP port unreachable.
    Refused,
    /// Nothing within [`WAIT`].
    Silence,
    /// Anything else (unreachable, connected but no reply, ...).
    Error(String),
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outcome::Answer { server, seen_client } => write!(f, "{server} (saw client {seen_client})"),
            Outcome::Other(line) => write!(f, "answered {line:?}"),
            Outcome::Refused => f.write_str("refused"),
            Outcome::Silence => f.write_str("no answer"),
            Outcome::Error(e) => write!(f, "error: {e}"),
        }
    }
}

/// Sends one request from `ns`, from `source` (any port), to `dest`.
pub fn request(ns: &Netns, proto: Protocol, source: IpAddr, dest: SocketAddr) -> Outcome {
    let run = ns.run(move || match proto {
        Protocol::TCP => tcp(source, dest),
        Protocol::UDP => udp(source, dest),
        Protocol::SCTP => Outcome::Error("SCTP is probed with crafted packets: sctp_request".into()),
    });
    run.unwrap_or_else(|e| Outcome::Error(e.to_string()))
}

/// One request from a process on the node: `netprobe` run in the node's
/// namespace and cgroup, so the agent's socket hooks see it. The socket
/// must show `dest` as its peer, as it would with kube-proxy's DNAT.
/// A loopback source is not bound: a process dialling 127.0.0.1 gets that
/// source from the route, which, after the hook's translation, is the route
/// to the backend (iptables instead rewrites 127.0.0.1 with route_localnet).
pub fn request_from_node(netprobe: &Path, cgroup: &Cgroup, ns: &Netns, proto: Protocol, source: IpAddr, dest: SocketAddr) -> Outcome {
    let mut args = vec![proto.to_string(), dest.to_string()];
    if !source.is_loopback() {
        args.push(source.to_string());
    }
    let out = match cgroup.command(ns, netprobe).args(args).output() {
        Ok(out) => out,
        Err(e) => return Outcome::Error(format!("run netprobe: {e}")),
    };
    let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if let Some(kind) = text.strip_prefix("error=") {
        return match kind {
            "ConnectionRefused" => Outcome::Refused,
            "TimedOut" | "WouldBlock" => Outcome::Silence,
            _ => Outcome::Error(format!("netprobe: {kind}")),
        };
    }
    let Some((peer, reply)) = text.strip_prefix("peer=").and_then(|t| t.split_once(" reply=")) else {
        return Outcome::Error(format!("netprobe said {text:?} {}", String::from_utf8_lossy(&out.stderr).trim()));
    };
    if peer != dest.to_string() {
        return Outcome::Error(format!("the socket's peer is {peer}, not the address dialled {dest}"));
    }
    parse(reply)
}

fn socket(kind: Type, proto: SockProto, source: IpAddr) -> std::io::Result<Socket> {
    let s = Socket::new(Domain::for_address(SocketAddr::new(source, 0)), kind, Some(proto))?;
    s.bind(&SockAddr::from(SocketAddr::new(source, 0)))?;
    Ok(s)
}

fn classify(e: &std::io::Error) -> Outcome {
    match e.kind() {
        ErrorKind::ConnectionRefused => Outcome::Refused,
        ErrorKind::TimedOut | ErrorKind::WouldBlock => Outcome::Silence,
        _ => Outcome::Error(e.to_string()),
    }
}

fn tcp(source: IpAddr, dest: SocketAddr) -> Outcome {
    let s = match socket(Type::STREAM, SockProto::TCP, source) {
        Ok(s) => s,
        Err(e) => return Outcome::Error(format!("socket from {source}: {e}")),
    };
    if let Err(e) = s.connect_timeout(&SockAddr::from(dest), WAIT) {
        return classify(&e);
    }
    let mut stream: std::net::TcpStream = s.into();
    let _ = stream.set_read_timeout(Some(WAIT * 2));
    if let Err(e) = stream.write_all(REQUEST) {
        return Outcome::Error(format!("connected, then write failed: {e}"));
    }
    let mut text = String::new();
    match stream.read_to_string(&mut text) {
        Ok(_) => parse(&text),
        Err(e) => Outcome::Error(format!("connected, then no reply: {e}")),
    }
}

fn udp(source: IpAddr, dest: SocketAddr) -> Outcome {
    let s = match socket(Type::DGRAM, SockProto::UDP, source) {
        Ok(s) => s,
        Err(e) => return Outcome::Error(format!("socket from {source}: {e}")),
    };
    let socket: std::net::UdpSocket = s.into();
    if let Err(e) = socket.connect(dest) {
        return Outcome::Error(format!("connect {dest}: {e}"));
    }
    let _ = socket.set_read_timeout(Some(WAIT));
    if let Err(e) = socket.send(REQUEST) {
        return classify(&e);
    }
    let mut buf = [0u8; 1500];
    match socket.recv(&mut buf) {
        Ok(n) => parse(&String::from_utf8_lossy(&buf[..n])),
        Err(e) => classify(&e),
    }
}

fn parse(text: &str) -> Outcome {
    if text.starts_with("HTTP/") {
        return Outcome::Other(text.lines().next().unwrap_or_default().to_string());
    }
    let mut words = text.split_whitespace();
    match (words.next(), words.next()) {
        (Some(server), Some(seen)) => Outcome::Answer { server: server.to_string(), seen_client: seen.to_string() },
        _ => Outcome::Error(format!("unexpected reply {text:?}")),
    }
}

/// An SCTP INIT to `dest` from `client`, crafted (this kernel has no SCTP
/// module to answer it): the endpoint it reaches, captured on the eth0 of
/// each pod in `endpoints`, stands for the one that answers. The INIT must
/// arrive with a valid CRC32c; a REJECT or DROP shows as no arrival.
pub fn sctp_request(client: &Netns, dest: SocketAddr, endpoints: &[&Netns]) -> Outcome {
    let (IpAddr::V4(dst_ip), port) = (dest.ip(), dest.port()) else { return Outcome::Error("SCTP over IPv6".into()) };
    let captures: Result<Vec<Capture>, _> = endpoints.iter().map(|ns| Capture::open(ns, "eth0")).collect();
    let captures = match captures {
        Ok(c) => c,
        Err(e) => return Outcome::Error(format!("capture at the endpoints: {e:#}")),
    };
    let (sport, tag) = (40000 + rand::random::<u16>() % 20000, rand::random::<u32>() | 1);
    if let Err(e) = sctp::send_raw(client, dst_ip, sctp::packet(sport, port, 0, &[chunk::init(tag)])) {
        return Outcome::Error(format!("send INIT: {e:#}"));
    }
    let ours = |s: &sctp::Seen| s.chunks.first() == Some(&sctp::CHUNK_INIT) && s.sctp.get(16..20) == Some(&tag.to_be_bytes()[..]);
    let deadline = std::time::Instant::now() + WAIT;
    while std::time::Instant::now() < deadline {
        for capture in &captures {
            if let Ok(got) = capture.next(Duration::from_millis(10), ours) {
                if !got.seen.crc_ok() {
                    return Outcome::Error(format!("INIT reached {} with a bad CRC32c", got.seen.dst));
                }
                return Outcome::Answer { server: got.seen.dst.to_string(), seen_client: got.seen.src.to_string() };
            }
        }
    }
    Outcome::Silence
}
