//! How the agent serves HTTP: /healthz and /livez, /metrics and the
//! healthCheckNodePorts all go through `serve`, with limits, because they
//! listen where load balancers (and whoever else reaches the node) connect.
//! A client that opens connections and never finishes a request
//! (slowloris) must not keep them, nor use up the agent's file descriptors,
//! which it needs to attach to new interfaces.
//!
//! - A request head must arrive whole within `header_read_timeout` of the
//!   connection opening, or of the last response on a kept-alive one
//!   (hyper's header timer runs whenever it waits for a request): one limit
//!   for slow heads and idle connections. Past it the connection is closed.
//! - At most so many connections at once per [`ConnectionLimit`]; past it
//!   new ones wait in the listen backlog (as Go's netutil.LimitListener
//!   makes them wait) until a connection closes. tower's ConcurrencyLimit
//!   would count requests, and a slowloris connection never makes one.
//! - A head over `max_header_bytes` is answered 431, a body declared over
//!   `max_body_bytes` 413. No endpoint reads a body; one sent anyway is not
//!   read, and hyper closes the connection after the answer.
//!
//! axum::serve has none of these settings, so connections are served by
//! hyper's HTTP/1 builder directly; the routes stay axum Routers.

use std::{io::ErrorKind, sync::Arc, time::Duration};

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::{
    rt::{TokioIo, TokioTimer},
    service::TowerToHyperService,
};
use tokio::{net::TcpListener, sync::Semaphore, task::JoinSet};
use tower_http::limit::RequestBodyLimit;

/// Long enough for any client that sends its request at once (a probe, a
/// load balancer, Prometheus) over a slow link.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Per group of servers (see `ConnectionLimit`): far above what probes and
/// scrapes open at once, far below the agent's file descriptor limit.
pub const MAX_CONNECTIONS: usize = 128;
/// The requests these endpoints get are a few hundred bytes.
pub const MAX_HEADER_BYTES: usize = 16 * 1024;
pub const MAX_BODY_BYTES: usize = 16 * 1024;

/// After an accept error other than the peer's (out of file descriptors),
/// wait this long rather than spin.
const ACCEPT_RETRY: Duration = Duration::from_secs(1);

#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub header_read_timeout: Duration,
    pub max_header_bytes: usize,
    pub max_body_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { header_read_timeout: HEADER_READ_TIMEOUT, max_header_bytes: MAX_HEADER_BYTES, max_body_bytes: MAX_BODY_BYTES }
    }
}

/// A budget of open connections, shared by the servers given clones of it.
#[derive(Debug, Clone)]
pub struct ConnectionLimit(Arc<Semaphore>);

impl ConnectionLimit {
    pub fn new(max: usize) -> Self {
        ConnectionLimit(Arc::new(Semaphore::new(max)))
    }
}

impl Default for ConnectionLimit {
    fn default() -> Self {
        ConnectionLimit::new(MAX_CONNECTIONS)
    }
}

/// Serves `app` on `listener` with the default limits, until the task is
/// dropped or aborted (its connections with it).
pub async fn serve(listener: TcpListener, app: Router, connections: ConnectionLimit) {
    serve_with(listener, app, connections, Limits::default()).await
}

pub async fn serve_with(listener: TcpListener, app: Router, connections: ConnectionLimit, limits: Limits) {
    let service = TowerToHyperService::new(RequestBodyLimit::new(app, limits.max_body_bytes));
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_header_size(limits.max_header_bytes);
    // Dropped with this future: aborting the server closes its connections.
    let mut open = JoinSet::new();
    loop {
        let permit = connections.0.clone().acquire_owned().await.expect("the semaphore is never closed");
        while open.try_join_next().is_some() {}
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) if matches!(e.kind(), ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset) => continue,
            Err(e) => {
                tracing::warn!(addr = ?listener.local_addr().ok(), "HTTP server cannot accept, retrying in {ACCEPT_RETRY:?}: {e}");
                tokio::time::sleep(ACCEPT_RETRY).await;
                continue;
            }
        };
        let conn = http.serve_connection(TokioIo::new(stream), service.clone());
        open.spawn(async move {
            // Errors are the client's (a timeout, a bad request): nothing to log.
            let _ = conn.await;
            drop(permit);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::get;
    use tokio::{
        io::{AsyncReadExt, AsyncWriteExt},
        net::TcpStream,
        time::timeout,
    };

    /// Far longer than anything here should take; only a failure waits it out.
    const DEADLINE: Duration = Duration::from_secs(10);

    async fn start(connections: usize, limits: Limits) -> std::net::SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = Router::new().route("/healthz", get(|| async { "ok" }));
        tokio::spawn(serve_with(listener, app, ConnectionLimit::new(connections), limits));
        addr
    }

    fn limits(header_read_timeout: Duration) -> Limits {
        Limits { header_read_timeout, ..Limits::default() }
    }

    /// Everything until the server closes (EOF or reset); None if it does
    /// not within `wait`.
    async fn until_closed(s: &mut TcpStream, wait: Duration) -> Option<String> {
        let mut text = Vec::new();
        let mut buf = [0u8; 4096];
        let read_all = async {
            loop {
                match s.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => text.extend_from_slice(&buf[..n]),
                }
            }
        };
        timeout(wait, read_all).await.ok()?;
        Some(String::from_utf8_lossy(&text).into_owned())
    }

    const GET: &[u8] = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n";

    #[tokio::test]
    async fn a_slow_head_and_an_idle_kept_alive_connection_are_closed() {
        let addr = start(8, limits(Duration::from_millis(200))).await;
        let mut silent = TcpStream::connect(addr).await.unwrap();
        let mut partial = TcpStream::connect(addr).await.unwrap();
        partial.write_all(b"GET /heal").await.unwrap();
        assert_eq!(until_closed(&mut silent, DEADLINE).await.as_deref(), Some(""), "a silent connection is closed, unanswered");
        assert_eq!(until_closed(&mut partial, DEADLINE).await.as_deref(), Some(""), "so is a partial request line");

        // Answered, kept alive, then closed once idle past the same timeout.
        let mut kept = TcpStream::connect(addr).await.unwrap();
        kept.write_all(GET).await.unwrap();
        let text = until_closed(&mut kept, DEADLINE).await.expect("an idle kept-alive connection stays open");
        assert!(text.starts_with("HTTP/1.1 200") && text.ends_with("ok"), "{text}");
    }

    #[tokio::test]
    async fn oversized_heads_and_bodies_are_refused() {
        let addr = start(8, Limits::default()).await;
        let mut big_head = TcpStream::connect(addr).await.unwrap();
        let filler = "a".repeat(MAX_HEADER_BYTES);
        big_head.write_all(format!("GET /healthz HTTP/1.1\r\nHost: x\r\nX-Filler: {filler}\r\n\r\n").as_bytes()).await.unwrap();
        let text = until_closed(&mut big_head, DEADLINE).await.unwrap();
        assert!(text.starts_with("HTTP/1.1 431"), "{text}");

        let mut big_body = TcpStream::connect(addr).await.unwrap();
        let len = MAX_BODY_BYTES + 1;
        big_body.write_all(format!("GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: {len}\r\n\r\n").as_bytes()).await.unwrap();
        let text = until_closed(&mut big_body, DEADLINE).await.unwrap();
        assert!(text.starts_with("HTTP/1.1 413"), "{text}");
    }

    /// One connection allowed: a second is not answered while the first is
    /// open, and is as soon as it closes.
    #[tokio::test]
    async fn connections_past_the_limit_wait_for_a_free_one() {
        let addr = start(1, limits(Duration::from_secs(600))).await;
        // The listen backlog is first in, first out: the server takes this one.
        let first = TcpStream::connect(addr).await.unwrap();
        let mut second = TcpStream::connect(addr).await.unwrap();
        second.write_all(GET).await.unwrap();
        let mut byte = [0u8; 1];
        assert!(timeout(Duration::from_millis(300), second.read(&mut byte)).await.is_err(), "answered past the limit");
        drop(first);
        let mut text = vec![0u8; 12];
        timeout(DEADLINE, second.read_exact(&mut text)).await.expect("not answered after a slot freed").unwrap();
        assert_eq!(&text, b"HTTP/1.1 200");
    }
}
