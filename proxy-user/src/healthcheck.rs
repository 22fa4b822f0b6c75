//! healthCheckNodePort servers, as kube-proxy runs them: for every Service
//! with externalTrafficPolicy=Local and a healthCheckNodePort (LoadBalancer
//! Services get one), an HTTP server on that port tells the load balancer
//! whether this node has a ready endpoint of the Service: 200 when it has
//! (and the proxy is healthy), 503 when not, with kube-proxy's JSON body.
//! As kube-proxy, the servers listen on the node addresses
//! `--node-port-addresses` selects, or on every address when it is empty.
//! They serve with the limits of http_server, from one budget of
//! connections for all of them: a Service more does not raise the agent's
//! exposure, and an attack on them leaves /healthz its own budget.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    sync::{Arc, RwLock},
};

use axum::{
    Router,
    extract::State,
    http::{HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};
use tokio::task::JoinHandle;
use tracing::{info, warn};

use crate::{
    health::Health,
    http_server::{self, ConnectionLimit},
    model::{HealthCheck, ModelConfig},
};

/// What the server on one healthCheckNodePort answers for: the model
/// decides which checks this node answers and counts their local endpoints
/// (`DesiredState::health_checks`).
pub type Check = HealthCheck;

/// Where the servers listen: the node addresses `--node-port-addresses`
/// selects, or (flag empty) the unspecified IPv6 address, one dual-stack
/// socket for every address of both families.
pub fn listen_addresses(config: &ModelConfig) -> Vec<IpAddr> {
    if config.node_port_addresses.is_empty() {
        return vec![Ipv6Addr::UNSPECIFIED.into()];
    }
    config.node_port_ips().collect()
}

struct Server {
    check: Arc<RwLock<Check>>,
    /// One per listen address.
    tasks: Vec<JoinHandle<()>>,
}

impl Server {
    async fn stop(self) {
        for task in self.tasks {
            task.abort();
            let _ = task.await;
        }
    }
}

/// The running servers, one per port, started and stopped as Services change.
pub struct HealthCheckServers {
    health: Health,
    /// The addresses the running servers listen on.
    addresses: Vec<IpAddr>,
    servers: BTreeMap<u16, Server>,
    /// Shared by every server.
    connections: ConnectionLimit,
}

impl HealthCheckServers {
    pub fn new(health: Health) -> Self {
        HealthCheckServers { health, addresses: Vec::new(), servers: BTreeMap::new(), connections: ConnectionLimit::default() }
    }

    pub fn ports(&self) -> Vec<u16> {
        self.servers.keys().copied().collect()
    }

    /// Makes the servers match `wanted`, listening on `addresses` (see
    /// `listen_addresses`; when they change, every server moves). A port
    /// that cannot be bound on all of them is reported and tried again at
    /// the next sync; the others still serve.
    pub async fn sync(&mut self, wanted: &BTreeMap<u16, Check>, addresses: Vec<IpAddr>) {
        if addresses != self.addresses {
            if !self.servers.is_empty() {
                info!(?addresses, "healthCheckNodePort servers move to the new node addresses");
            }
            for (_, server) in std::mem::take(&mut self.servers) {
                server.stop().await;
            }
            self.addresses = addresses;
        }
        let gone: Vec<u16> = self.servers.keys().filter(|p| !wanted.contains_key(p)).copied().collect();
        for port in gone {
            self.servers.remove(&port).expect("listed above").stop().await;
            info!(port, "healthCheckNodePort server stopped");
        }
        for (port, check) in wanted {
            if let Some(server) = self.servers.get(port) {
                *server.check.write().unwrap() = check.clone();
                continue;
            }
            let service = format!("{}/{}", check.namespace, check.name);
            if self.addresses.is_empty() {
                warn!(%service, port, "no node address in --node-port-addresses: the healthCheckNodePort is not served");
                continue;
            }
            let shared = Arc::new(RwLock::new(check.clone()));
            let app = Router::new().fallback(answer).with_state((shared.clone(), self.health.clone()));
            let mut server = Server { check: shared, tasks: Vec::new() };
            for ip in &self.addresses {
                let addr = SocketAddr::new(*ip, *port);
                let listener = match listen(addr) {
                    Ok(l) => l,
                    Err(e) => {
                        warn!(%service, %addr, "cannot serve the healthCheckNodePort, will retry: {e}");
                        break;
                    }
                };
                server.tasks.push(tokio::spawn(http_server::serve(listener, app.clone(), self.connections.clone())));
            }
            if server.tasks.len() < self.addresses.len() {
                server.stop().await;
                continue;
            }
            info!(%service, port, addresses = ?self.addresses, "healthCheckNodePort server started");
            self.servers.insert(*port, server);
        }
    }
}

/// A listening socket on `addr`; on the unspecified IPv6 address a
/// dual-stack one (whatever net.ipv6.bindv6only says), or the unspecified
/// IPv4 address on a node without IPv6.
fn listen(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    use socket2::{Domain, Socket, Type};
    let dual_stack = addr.ip() == IpAddr::from(Ipv6Addr::UNSPECIFIED);
    let open = |addr: SocketAddr| -> std::io::Result<Socket> {
        let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
        if addr.is_ipv6() {
            socket.set_only_v6(!dual_stack)?;
        }
        socket.set_reuse_address(true)?;
        socket.set_nonblocking(true)?;
        socket.bind(&addr.into())?;
        socket.listen(1024)?;
        Ok(socket)
    };
    let socket = match open(addr) {
        Err(e) if dual_stack && e.raw_os_error() == Some(nix::libc::EAFNOSUPPORT) => {
            open(SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), addr.port()))?
        }
        other => other?,
    };
    tokio::net::TcpListener::from_std(socket.into())
}

impl Drop for HealthCheckServers {
    fn drop(&mut self) {
        for task in self.servers.values().flat_map(|s| &s.tasks) {
            task.abort();
        }
    }
}

/// kube-proxy's answer, on any path.
async fn answer(State((check, health)): State<(Arc<RwLock<Check>>, Health)>) -> Response {
    let check = check.read().unwrap().clone();
    let proxy_healthy = health.is_healthy();
    let code = if check.local_endpoints > 0 && proxy_healthy { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    let body = serde_json::json!({
        "service": {"namespace": check.namespace, "name": check.name},
        "localEndpoints": check.local_endpoints,
        "serviceProxyHealthy": proxy_healthy,
    });
    let mut resp = (code, body.to_string()).into_response();
    let headers = resp.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert("X-Content-Type-Options", HeaderValue::from_static("nosniff"));
    headers.insert("X-Load-Balancing-Endpoint-Weight", HeaderValue::from(check.local_endpoints));
    resp
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;
    use crate::source::Snapshot;

    fn services(port: u16) -> String {
        format!(
            r#"
apiVersion: v1
kind: Service
metadata: {{name: lb, namespace: shop}}
spec: {{type: LoadBalancer, clusterIP: 10.96.0.10, externalTrafficPolicy: Local, healthCheckNodePort: {port},
        ports: [{{name: http, port: 80, nodePort: 30080}}, {{name: https, port: 443, nodePort: 30443}}]}}
---
apiVersion: v1
kind: Service
metadata: {{name: cluster, namespace: shop}}
spec: {{type: LoadBalancer, clusterIP: 10.96.0.11, externalTrafficPolicy: Cluster, healthCheckNodePort: 31999, ports: [{{port: 80}}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: lb-1, namespace: shop, labels: {{kubernetes.io/service-name: lb}}}}
addressType: IPv4
ports: [{{name: http, port: 8080}}, {{name: https, port: 8443}}]
endpoints:
- {{addresses: [10.244.0.1], nodeName: node-a}}
- {{addresses: [10.244.0.2], nodeName: node-a, conditions: {{ready: false, serving: true, terminating: true}}}}
- {{addresses: [10.244.0.3], nodeName: node-b}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: lb-2, namespace: shop, labels: {{kubernetes.io/service-name: lb}}}}
addressType: IPv4
ports: [{{name: http, port: 8080}}]
endpoints:
- {{addresses: [10.244.0.4], nodeName: node-a}}
- {{addresses: [10.244.0.1], nodeName: node-a}}
"#
        )
    }

    /// The checks the model asks of the node.
    fn wanted(snap: &Snapshot, config: &ModelConfig) -> BTreeMap<u16, Check> {
        crate::model::build(snap, config).0.health_checks
    }

    fn cfg(node: &str) -> ModelConfig {
        ModelConfig { node_name: node.into(), ..Default::default() }
    }

    #[test]
    fn one_check_per_local_policy_service_counting_local_ready_addresses() {
        let snap = Snapshot::from_yaml(&services(32000));
        let want = wanted(&snap, &cfg("node-a"));
        let check = Check { namespace: "shop".into(), name: "lb".into(), local_endpoints: 2 };
        assert_eq!(want, BTreeMap::from([(32000, check)]), "eTP=Cluster gets no check; terminating and remote endpoints do not count");
        assert_eq!(wanted(&snap, &cfg("node-b"))[&32000].local_endpoints, 1);
        assert_eq!(wanted(&snap, &cfg("node-c"))[&32000].local_endpoints, 0);
    }

    #[test]
    fn endpoints_the_model_refuses_do_not_count() {
        let yaml = services(32000).replace("[10.244.0.4]", "[127.0.0.1]").replace("[10.244.0.3]", "[10.96.0.3]");
        let snap = Snapshot::from_yaml(&yaml);
        assert_eq!(wanted(&snap, &cfg("node-a"))[&32000].local_endpoints, 1, "loopback is no endpoint");
        let config = ModelConfig { service_cidrs: vec!["10.96.0.0/16".parse().unwrap()], ..cfg("node-b") };
        assert_eq!(wanted(&snap, &config)[&32000].local_endpoints, 0, "nor is an address in a service CIDR");
        assert_eq!(wanted(&snap, &cfg("node-b"))[&32000].local_endpoints, 1, "outside every service CIDR it is one");
    }

    /// GET over a real socket to 127.0.0.1: (status, headers and body).
    async fn get(port: u16) -> (u16, String) {
        get_at([127, 0, 0, 1].into(), port).await
    }

    async fn get_at(ip: IpAddr, port: u16) -> (u16, String) {
        let mut s = tokio::net::TcpStream::connect((ip, port)).await.unwrap();
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: lb\r\nConnection: close\r\n\r\n").await.unwrap();
        let mut text = String::new();
        s.read_to_string(&mut text).await.unwrap();
        let status = text.split_whitespace().nth(1).unwrap().parse().unwrap();
        (status, text)
    }

    async fn sync_on_loopback(servers: &mut HealthCheckServers, snap: &Snapshot, node: &str) {
        servers.sync(&wanted(snap, &cfg(node)), vec![[127, 0, 0, 1].into()]).await;
    }

    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
    }

    #[tokio::test]
    async fn servers_answer_like_kube_proxy_and_follow_the_services() {
        let port = free_port();
        // A zero health timeout: any change not yet programmed makes the proxy unhealthy.
        let health = Health::with_timeout(std::time::Duration::ZERO);
        health.sync_succeeded();
        let mut servers = HealthCheckServers::new(health.clone());
        let snap = Snapshot::from_yaml(&services(port));

        sync_on_loopback(&mut servers, &snap, "node-a").await;
        assert_eq!(servers.ports(), [port]);
        let (status, text) = get(port).await;
        assert_eq!(status, 200, "{text}");
        assert!(text.contains("x-load-balancing-endpoint-weight: 2"), "{text}");
        assert!(text.to_ascii_lowercase().contains("content-type: application/json"), "{text}");
        let body: serde_json::Value = serde_json::from_str(text.split("\r\n\r\n").nth(1).unwrap()).unwrap();
        assert_eq!(
            body,
            serde_json::json!({"service": {"namespace": "shop", "name": "lb"}, "localEndpoints": 2, "serviceProxyHealthy": true})
        );

        // No local endpoint on this node: 503, same server.
        sync_on_loopback(&mut servers, &snap, "node-c").await;
        let (status, text) = get(port).await;
        assert_eq!(status, 503, "{text}");
        assert!(text.contains(r#""localEndpoints":0"#), "{text}");

        // Local endpoints but the proxy unhealthy (a change it has not programmed): 503 as well.
        sync_on_loopback(&mut servers, &snap, "node-a").await;
        health.queued_update();
        let (status, text) = get(port).await;
        assert_eq!(status, 503, "{text}");
        assert!(text.contains(r#""serviceProxyHealthy":false"#), "{text}");

        // The Service goes: its port closes.
        servers.sync(&BTreeMap::new(), vec![[127, 0, 0, 1].into()]).await;
        assert!(servers.ports().is_empty());
        assert!(tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_err(), "port {port} still open");
    }

    /// As kube-proxy: on the addresses --node-port-addresses selects, moved
    /// when the node's addresses change; on every address (IPv4 and IPv6)
    /// without the flag.
    #[tokio::test]
    async fn servers_listen_where_node_port_addresses_say() {
        let port = free_port();
        let health = Health::default();
        health.sync_succeeded();
        let snap = Snapshot::from_yaml(&services(port));
        let want = wanted(&snap, &cfg("node-a"));
        let mut servers = HealthCheckServers::new(health);
        let (a, b): (IpAddr, IpAddr) = ([127, 0, 0, 1].into(), [127, 0, 0, 2].into());
        let refused = |ip: IpAddr| async move { tokio::net::TcpStream::connect((ip, port)).await.is_err() };

        let mut config = ModelConfig {
            node_port_addresses: vec!["127.0.0.2/32".parse().unwrap()],
            node_addresses: vec![a, b],
            ..cfg("node-a")
        };
        assert_eq!(listen_addresses(&config), [b]);
        servers.sync(&want, listen_addresses(&config)).await;
        assert_eq!(get_at(b, port).await.0, 200);
        assert!(refused(a).await, "listening on {a}, outside --node-port-addresses");

        config.node_port_addresses = vec!["127.0.0.1/32".parse().unwrap()];
        servers.sync(&want, listen_addresses(&config)).await;
        assert_eq!(get_at(a, port).await.0, 200);
        assert!(refused(b).await, "still listening on {b} after the addresses changed");

        config.node_port_addresses.clear();
        servers.sync(&want, listen_addresses(&config)).await;
        assert_eq!(get_at(b, port).await.0, 200, "every IPv4 address");
        assert_eq!(get_at(Ipv6Addr::LOCALHOST.into(), port).await.0, 200, "and IPv6");
    }
}
