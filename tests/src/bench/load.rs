//! A load generator and its server, for request/response rates and UDP
//! packet rates through a proxy. The server answers every TCP request and
//! every UDP datagram with a short reply (and closes a TCP connection after
//! answering a request that asks it to, as an HTTP server does for
//! `Connection: close`), and counts (without answering) datagrams marked as
//! stream traffic. The clients run on threads inside the
//! client namespace; each measures only the operations it completes inside
//! the window after a warm-up.

use std::{
    io::{Read, Write},
    net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use nix::sys::socket::{setsockopt, sockopt};

use crate::netns::Netns;

const REQUEST: &[u8] = b"q";
/// A request after which the server closes the connection (it closes
/// first: the TIME_WAIT is the server's).
const CLOSE_REQUEST: &[u8] = b"c";
const REPLY: &[u8] = b"ok\n";
/// First byte of a datagram the server only counts.
const STREAM_MARK: u8 = b's';
const STREAM_PAYLOAD: usize = 64;
const IO_TIMEOUT: Duration = Duration::from_millis(500);

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Mode {
    /// TCP connect, one request and reply, close (netperf's TCP_CRR): the
    /// client resets the connection, so no side keeps a TIME_WAIT.
    TcpConnect,
    /// The same, but the server closes after its reply (HTTP's
    /// `Connection: close`) and the client then closes too: the server
    /// keeps each connection's tuple in TIME_WAIT, and a proxy that hands a
    /// new connection such a tuple stalls its connect.
    TcpConnectServerClose,
    /// Requests and replies on kept TCP connections (TCP_RR).
    TcpKept,
    /// UDP request and reply (UDP_RR).
    UdpRr,
    /// UDP datagrams one way as fast as the senders go; the rate received counts.
    UdpStream,
}

impl Mode {
    pub const ALL: [Mode; 5] =
        [Mode::TcpConnect, Mode::TcpConnectServerClose, Mode::TcpKept, Mode::UdpRr, Mode::UdpStream];

    pub fn label(self) -> &'static str {
        match self {
            Mode::TcpConnect => "TCP connect+request/s",
            Mode::TcpConnectServerClose => "TCP connect+request/s, server closes",
            Mode::TcpKept => "TCP kept-connection requests/s",
            Mode::UdpRr => "UDP request/reply/s",
            Mode::UdpStream => "UDP packets/s received",
        }
    }

    pub fn short(self) -> &'static str {
        match self {
            Mode::TcpConnect => "tcp-crr",
            Mode::TcpConnectServerClose => "tcp-crr-server-close",
            Mode::TcpKept => "tcp-rr",
            Mode::UdpRr => "udp-rr",
            Mode::UdpStream => "udp-stream",
        }
    }

    pub fn is_tcp(self) -> bool {
        matches!(self, Mode::TcpConnect | Mode::TcpConnectServerClose | Mode::TcpKept)
    }
}

/// Serves TCP and UDP on every address of a namespace until dropped.
pub struct Server {
    stop: Arc<AtomicBool>,
    received: Arc<AtomicU64>,
    threads: Vec<JoinHandle<()>>,
    tcp_wake: SocketAddr,
    tcp_threads: usize,
    /// The server's namespace, entered to wake the accept threads.
    netns: std::fs::File,
}

impl Server {
    /// TCP on `tcp_port` of every address, `tcp_threads` accepting; UDP on
    /// `udp_port` of each of `udp_addrs`, one socket and thread each, so a
    /// reply leaves from the address the request was sent to (a socket bound
    /// to 0.0.0.0 would answer from the interface's first address).
    pub fn start(ns: &Netns, tcp_port: u16, tcp_threads: usize, udp_addrs: &[Ipv4Addr], udp_port: u16) -> Result<Server> {
        let stop = Arc::new(AtomicBool::new(false));
        let received = Arc::new(AtomicU64::new(0));
        let tcp_bind = SocketAddr::from(([0, 0, 0, 0], tcp_port));
        let tcp = ns.run(move || TcpListener::bind(tcp_bind))?.with_context(|| format!("tcp bind {tcp_bind}"))?;
        let mut handles = Vec::new();
        for _ in 0..tcp_threads {
            let (l, s) = (tcp.try_clone()?, stop.clone());
            handles.push(std::thread::spawn(move || serve_tcp(l, &s)));
        }
        for &ip in udp_addrs {
            let bind = SocketAddr::from((ip, udp_port));
            let udp = ns.run(move || UdpSocket::bind(bind))?.with_context(|| format!("udp bind {bind}"))?;
            udp.set_read_timeout(Some(Duration::from_millis(100)))?;
            let (s, r) = (stop.clone(), received.clone());
            handles.push(std::thread::spawn(move || serve_udp(udp, &s, &r)));
        }
        let tcp_wake = SocketAddr::from((Ipv4Addr::LOCALHOST, tcp_port));
        let netns = std::fs::File::open(format!("/run/netns/{}", ns.name))?;
        Ok(Server { stop, received, threads: handles, tcp_wake, tcp_threads, netns })
    }

    /// Stream datagrams received so far.
    pub fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Each TCP thread blocks in accept: one connection over the server
        // namespace's loopback wakes one thread.
        let wake = self.tcp_wake;
        let n = self.tcp_threads;
        let netns = self.netns.try_clone();
        let waker = std::thread::spawn(move || {
            let Ok(netns) = netns else { return };
            if nix::sched::setns(&netns, nix::sched::CloneFlags::CLONE_NEWNET).is_err() {
                return;
            }
            for _ in 0..n {
                let _ = TcpStream::connect_timeout(&wake, Duration::from_millis(200));
            }
        });
        let _ = waker.join();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn serve_tcp(listener: TcpListener, stop: &AtomicBool) {
    let mut buf = [0u8; 64];
    while !stop.load(Ordering::Relaxed) {
        let Ok((mut conn, _)) = listener.accept() else { continue };
        let _ = conn.set_nodelay(true);
        let _ = conn.set_read_timeout(Some(Duration::from_secs(2)));
        // Answer every request until the client closes, or close first
        // after answering one that asks it to.
        while let Ok(n) = conn.read(&mut buf) {
            if n == 0 || stop.load(Ordering::Relaxed) || conn.write_all(REPLY).is_err() || buf[..n].ends_with(CLOSE_REQUEST) {
                break;
            }
        }
    }
}

fn serve_udp(socket: UdpSocket, stop: &AtomicBool, received: &AtomicU64) {
    let mut buf = [0u8; 2048];
    while !stop.load(Ordering::Relaxed) {
        if let Ok((n, peer)) = socket.recv_from(&mut buf) {
            if n > 0 && buf[0] == STREAM_MARK {
                received.fetch_add(1, Ordering::Relaxed);
            } else {
                let _ = socket.send_to(REPLY, peer);
            }
        }
    }
}

/// What one load run did inside its window.
#[derive(Clone, Copy, Debug, Default)]
pub struct Outcome {
    pub ops: u64,
    pub errors: u64,
    pub seconds: f64,
}

impl Outcome {
    pub fn rate(&self) -> f64 {
        self.ops as f64 / self.seconds
    }
}

pub struct Load {
    pub mode: Mode,
    /// Each operation goes to the next of these (a Service address, or the
    /// endpoints themselves when there is no proxy).
    pub targets: Vec<SocketAddr>,
    pub threads: usize,
    pub warmup: Duration,
    pub window: Duration,
}

/// Runs `load` from `client`. For [`Mode::UdpStream`], `received` reads the
/// server's count, so the rate is what arrived, not what was sent.
pub fn run(client: &Netns, load: &Load, received: &dyn Fn() -> u64) -> Result<Outcome> {
    let start = Instant::now() + Duration::from_millis(20);
    let window_start = start + load.warmup;
    let window_end = window_start + load.window;
    let mut handles = Vec::new();
    for t in 0..load.threads {
        let targets = load.targets.clone();
        let mode = load.mode;
        handles.push(client.spawn(move || worker(mode, &targets, t, window_start, window_end))?);
    }
    let mut before = 0;
    if load.mode == Mode::UdpStream {
        sleep_until(window_start);
        before = received();
        sleep_until(window_end);
    }
    let mut total = Outcome { seconds: load.window.as_secs_f64(), ..Outcome::default() };
    for h in handles {
        let o = h.join().map_err(|_| anyhow::anyhow!("load thread panicked"))??;
        total.ops += o.ops;
        total.errors += o.errors;
    }
    if load.mode == Mode::UdpStream {
        let sent = total.ops;
        total.ops = received().saturating_sub(before);
        total.errors = sent.saturating_sub(total.ops);
    }
    Ok(total)
}

fn sleep_until(t: Instant) {
    let now = Instant::now();
    if t > now {
        std::thread::sleep(t - now);
    }
}

fn worker(mode: Mode, targets: &[SocketAddr], id: usize, from: Instant, to: Instant) -> Result<Outcome> {
    let mut o = Outcome::default();
    let mut next = id;
    let mut pick = || {
        next = (next + 1) % targets.len();
        targets[next]
    };
    let tally = |ok: bool, o: &mut Outcome| {
        let now = Instant::now();
        if now >= from && now < to {
            if ok { o.ops += 1 } else { o.errors += 1 }
        }
    };
    match mode {
        Mode::TcpConnect => {
            while Instant::now() < to {
                let ok = tcp_once(pick()).is_ok();
                tally(ok, &mut o);
            }
        }
        Mode::TcpConnectServerClose => {
            while Instant::now() < to {
                let ok = server_closed_once(None, pick(), IO_TIMEOUT).is_ok();
                tally(ok, &mut o);
            }
        }
        Mode::TcpKept => {
            // A connect that fails (a SYN lost to a peer's TIME_WAIT
            // collision, say) is a failed operation of this load, as in
            // the other modes, and the next turn dials again.
            let target = targets[id % targets.len()];
            let mut conn = None;
            while Instant::now() < to {
                let ok = match &mut conn {
                    Some(c) => request(c).is_ok(),
                    None => match tcp_connect(target) {
                        Ok(c) => {
                            conn = Some(c);
                            continue;
                        }
                        Err(_) => false,
                    },
                };
                tally(ok, &mut o);
                if !ok {
                    conn = None;
                }
            }
        }
        Mode::UdpRr => {
            let target = targets[id % targets.len()];
            let socket = UdpSocket::bind(("0.0.0.0", 0))?;
            socket.connect(target)?;
            socket.set_read_timeout(Some(IO_TIMEOUT))?;
            let mut buf = [0u8; 64];
            while Instant::now() < to {
                let ok = socket.send(REQUEST).is_ok() && socket.recv(&mut buf).is_ok();
                tally(ok, &mut o);
            }
        }
        Mode::UdpStream => {
            let target = targets[id % targets.len()];
            let socket = UdpSocket::bind(("0.0.0.0", 0))?;
            socket.connect(target)?;
            let mut payload = [0u8; STREAM_PAYLOAD];
            payload[0] = STREAM_MARK;
            while Instant::now() < to {
                // A full socket buffer (ENOBUFS) is the sender outrunning the
                // path: not an error of the path, the receiver's count tells.
                let ok = socket.send(&payload).is_ok();
                tally(ok, &mut o);
            }
        }
    }
    Ok(o)
}

fn tcp_connect(to: SocketAddr) -> Result<TcpStream> {
    let s = TcpStream::connect_timeout(&to, IO_TIMEOUT).with_context(|| format!("connect {to}"))?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(IO_TIMEOUT))?;
    Ok(s)
}

/// One request and its reply on a kept connection.
pub fn request(conn: &mut TcpStream) -> Result<()> {
    conn.write_all(REQUEST)?;
    let mut buf = [0u8; REPLY.len()];
    conn.read_exact(&mut buf)?;
    anyhow::ensure!(buf == REPLY, "unexpected reply {buf:?}");
    Ok(())
}

/// One connection, one request, then a reset instead of a FIN exchange: no
/// TIME_WAIT, so a few seconds of connections never run out of client ports.
fn tcp_once(to: SocketAddr) -> Result<()> {
    let mut conn = tcp_connect(to)?;
    request(&mut conn)?;
    setsockopt(&conn, sockopt::Linger, &nix::libc::linger { l_onoff: 1, l_linger: 0 })?;
    Ok(())
}

/// How the connect of a server-closed transaction went.
#[derive(Clone, Copy, Debug)]
pub struct Connected {
    pub connect: Duration,
    /// The client's TCP retransmissions by the time connect returned: a SYN
    /// sent again (a SYN answered with a bare ACK by a TIME_WAIT, or lost).
    pub retransmits: u32,
}

/// One connection (from `from`, with a port the kernel picks at connect,
/// if given), one request after which the server closes first, then the
/// client's close: the server keeps the connection's tuple in TIME_WAIT.
pub fn server_closed_once(from: Option<IpAddr>, to: SocketAddr, connect_timeout: Duration) -> Result<Connected> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(to), Type::STREAM, Some(Protocol::TCP))?;
    if let Some(ip) = from {
        // The port comes at connect, as for an unbound socket.
        setsockopt(&socket, sockopt::IpBindAddressNoPort, &true)?;
        socket.bind(&SocketAddr::new(ip, 0).into())?;
    }
    let start = Instant::now();
    socket.connect_timeout(&to.into(), connect_timeout).with_context(|| format!("connect {to}"))?;
    let connected = Connected { connect: start.elapsed(), retransmits: tcp_info(&socket)?.tcpi_total_retrans };
    let mut conn: TcpStream = socket.into();
    conn.set_nodelay(true)?;
    conn.set_read_timeout(Some(IO_TIMEOUT))?;
    conn.write_all(CLOSE_REQUEST)?;
    let mut reply = Vec::new();
    // To the server's FIN.
    conn.read_to_end(&mut reply)?;
    anyhow::ensure!(reply == REPLY, "unexpected reply {reply:?}");
    Ok(connected)
}

fn tcp_info(socket: &socket2::Socket) -> Result<nix::libc::tcp_info> {
    use std::os::fd::AsRawFd;
    let mut info: nix::libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of_val(&info) as nix::libc::socklen_t;
    let fd = socket.as_raw_fd();
    let rc = unsafe {
        nix::libc::getsockopt(fd, nix::libc::IPPROTO_TCP, nix::libc::TCP_INFO, (&raw mut info).cast(), &mut len)
    };
    anyhow::ensure!(rc == 0, "TCP_INFO: {}", std::io::Error::last_os_error());
    Ok(info)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kept connection that cannot be made is counted as failed
    /// operations, and the load goes on to the end of its window instead
    /// of ending the whole run.
    #[test]
    fn kept_connection_counts_a_failed_connect_and_goes_on() -> Result<()> {
        // A port nothing listens on: the connect is refused.
        let closed = TcpListener::bind("127.0.0.1:0")?.local_addr()?;
        let (from, to) = (Instant::now(), Instant::now() + Duration::from_millis(100));
        let o = worker(Mode::TcpKept, &[closed], 0, from, to)?;
        assert_eq!(o.ops, 0);
        assert!(o.errors > 0, "{o:?}");
        assert!(Instant::now() >= to, "the worker stopped before its window ended");
        Ok(())
    }
}
