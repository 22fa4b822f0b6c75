//! A client for tests that must run as its own process (for example inside
//! a node's cgroup): `netprobe tcp|udp|sctp ADDR:PORT [SOURCE_IP]` sends one
//! line to an echo server and prints `peer=<address the socket reports>
//! reply=<answer>`, or `error=<io error kind>`. `sctp` is a one-to-one
//! (SOCK_STREAM) kernel SCTP association: INIT to SHUTDOWN, data both ways.

use std::{
    io::{Read, Write},
    net::{IpAddr, SocketAddr, TcpStream, UdpSocket},
    time::Duration,
};

use socket2::{Domain, Protocol, Socket, Type};

const TIMEOUT: Duration = Duration::from_secs(2);

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (Some(proto), Some(Ok(to))) = (args.get(1), args.get(2).map(|a| a.parse::<SocketAddr>())) else {
        eprintln!("usage: netprobe tcp|udp|sctp ADDR:PORT [SOURCE_IP]");
        std::process::exit(2);
    };
    let from: Option<IpAddr> = args.get(3).and_then(|a| a.parse().ok());
    let result = match proto.as_str() {
        "tcp" => stream(to, from, None),
        "sctp" => stream(to, from, Some(Protocol::from(libc::IPPROTO_SCTP))),
        "udp" => udp(to, from),
        _ => {
            eprintln!("netprobe: protocol must be tcp, udp or sctp");
            std::process::exit(2);
        }
    };
    match result {
        Ok((peer, reply)) => println!("peer={peer} reply={}", reply.trim()),
        Err(e) => println!("error={:?}", e.kind()),
    }
}

/// TCP, or with `protocol` SCTP: a one-to-one SCTP socket takes the same
/// connect/read/write/close calls (close sends SHUTDOWN).
fn stream(to: SocketAddr, from: Option<IpAddr>, protocol: Option<Protocol>) -> std::io::Result<(SocketAddr, String)> {
    let socket = Socket::new(Domain::for_address(to), Type::STREAM, protocol)?;
    if let Some(ip) = from {
        // Free bind: a source the node does not hold (traffic SNATted to an LB IP).
        if ip.is_ipv4() {
            socket.set_freebind_v4(true)?;
        }
        socket.bind(&SocketAddr::new(ip, 0).into())?;
    }
    socket.connect_timeout(&to.into(), TIMEOUT)?;
    let mut s: TcpStream = socket.into();
    s.set_read_timeout(Some(TIMEOUT))?;
    s.write_all(b"hello\n")?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    Ok((s.peer_addr()?, text))
}

/// Unconnected, so the answer's source comes through recvmsg.
fn udp(to: SocketAddr, from: Option<IpAddr>) -> std::io::Result<(SocketAddr, String)> {
    let any = if to.is_ipv4() { IpAddr::from([0, 0, 0, 0]) } else { IpAddr::from([0u16; 8]) };
    let s = UdpSocket::bind(SocketAddr::new(from.unwrap_or(any), 0))?;
    s.set_read_timeout(Some(TIMEOUT))?;
    s.send_to(b"hello\n", to)?;
    let mut buf = [0u8; 1500];
    let (n, from) = s.recv_from(&mut buf)?;
    Ok((from, String::from_utf8_lossy(&buf[..n]).into_owned()))
}
