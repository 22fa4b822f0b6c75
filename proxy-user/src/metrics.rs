//! Prometheus metrics on `--metrics-bind-address`: sync figures under
//! kube-proxy's names, what is programmed, skipped objects, and — read from
//! the pinned maps at each scrape — map fill against capacity and the
//! datapath's per-CPU packet counters.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::Arc,
};

use anyhow::Result;
use axum::{Router, extract::State, http::header, response::IntoResponse, routing::get};
use chrono::Utc;
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric},
    metrics::{
        MetricType,
        counter::{ConstCounter, Counter},
        family::Family,
        gauge::{ConstGauge, Gauge},
        histogram::{Histogram, exponential_buckets},
    },
    registry::Registry,
};
use proxy_common::Counter as DpCounter;

use crate::{
    http_server::{self, ConnectionLimit},
    maps::Fill,
    model::ObjectError,
};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SkippedLabels {
    kind: String,
    reason: String,
}

#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    sync_duration: Histogram,
    programming_latency: Histogram,
    last_sync: Gauge<f64, std::sync::atomic::AtomicU64>,
    sync_failures: Counter,
    services: Gauge,
    frontends: Gauge,
    endpoints: Gauge,
    skipped_now: Family<SkippedLabels, Gauge>,
    skipped_total: Family<SkippedLabels, Counter>,
}

/// kube-proxy's buckets for network programming latency (0.25 s .. 5 min).
fn programming_buckets() -> Vec<f64> {
    let mut b = vec![0.25, 0.5];
    b.extend((1..=59).map(f64::from));
    b.extend((0..12).map(|i| 60.0 + 5.0 * f64::from(i)));
    b.extend((0..7).map(|i| 120.0 + 30.0 * f64::from(i)));
    b
}

impl Metrics {
    /// `bpffs_root`: where the maps scrapes read are pinned.
    pub fn new(bpffs_root: &Path) -> Metrics {
        let mut registry = Registry::default();
        let sync_duration = Histogram::new(exponential_buckets(0.001, 2.0, 15));
        registry.register(
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds: model, diff and map writes",
            sync_duration.clone(),
        );
        let programming_latency = Histogram::new(programming_buckets());
        registry.register(
            "kubeproxy_network_programming_duration_seconds",
            "In-cluster network programming latency in seconds: from an EndpointSlice's last-change-trigger-time to its change being in the maps",
            programming_latency.clone(),
        );
        let last_sync = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        registry.register(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "The last time a sync succeeded, in seconds since the epoch",
            last_sync.clone(),
        );
        let sync_failures = Counter::default();
        registry.register("ebpf_proxy_sync_failures", "Syncs that failed and were retried", sync_failures.clone());
        let services = Gauge::default();
        registry.register("ebpf_proxy_services_programmed", "Service ports (backend sets) in the maps", services.clone());
        let frontends = Gauge::default();
        registry.register("ebpf_proxy_frontends_programmed", "Frontends (address, port, protocol) in the maps", frontends.clone());
        let endpoints = Gauge::default();
        registry.register("ebpf_proxy_endpoints_programmed", "Distinct backends in the maps", endpoints.clone());
        let skipped_now = Family::default();
        registry.register(
            "ebpf_proxy_invalid_objects",
            "Problems in the current objects, each skipped, by object kind and reason",
            skipped_now.clone(),
        );
        let skipped_total = Family::default();
        registry.register(
            "ebpf_proxy_skipped_objects",
            "Problems found in objects and skipped, counted when each first appears",
            skipped_total.clone(),
        );
        registry.register_collector(Box::new(Dataplane { root: bpffs_root.to_path_buf() }));
        Metrics {
            registry: Arc::new(registry),
            sync_duration,
            programming_latency,
            last_sync,
            sync_failures,
            services,
            frontends,
            endpoints,
            skipped_now,
            skipped_total,
        }
    }

    pub fn sync_succeeded(&self, seconds: f64, services: usize, frontends: usize, endpoints: usize) {
        self.sync_duration.observe(seconds);
        self.last_sync.set(Utc::now().timestamp_millis() as f64 / 1000.0);
        self.services.set(services as i64);
        self.frontends.set(frontends as i64);
        self.endpoints.set(endpoints as i64);
    }

    pub fn sync_failed(&self) {
        self.sync_failures.inc();
    }

    pub fn programmed_after(&self, seconds: f64) {
        self.programming_latency.observe(seconds);
    }

    /// The current skipped problems, and those of them not seen in the previous sync.
    pub fn skipped(&self, current: &[ObjectError], new: &[&ObjectError]) {
        self.skipped_now.clear();
        for e in current {
            self.skipped_now.get_or_create(&labels(e)).inc();
        }
        for e in new {
            self.skipped_total.get_or_create(&labels(e)).inc();
        }
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }
}

fn labels(e: &ObjectError) -> SkippedLabels {
    let (kind, reason) = classify(e);
    SkippedLabels { kind: kind.into(), reason: reason.into() }
}

/// A bounded label for a skipped problem: the object's kind and why.
pub fn classify(e: &ObjectError) -> (&'static str, &'static str) {
    (e.kind.label(), e.why.label())
}

/// Scrape-time figures from the pinned maps (opened at each scrape, so a
/// scrape never holds them and sees them again after a cleanup and restart).
#[derive(Debug)]
struct Dataplane {
    root: PathBuf,
}

/// What the metrics show of a pinned map.
pub struct MapFill {
    pub map: &'static str,
    pub entries: u64,
    pub capacity: u64,
    /// Hash, LRU and LPM maps fill; arrays have every slot from the start.
    pub fills: bool,
}

/// Entries and capacity of every pinned map under `root`.
pub fn map_fill(root: &Path) -> Result<Vec<MapFill>> {
    crate::maps::PINNED
        .iter()
        .map(|m| {
            let info = aya::maps::MapInfo::from_pin(root.join(m.name))?;
            let capacity = u64::from(info.max_entries());
            let (entries, fills) = match m.fill {
                Fill::Counted(count) => (count(root, m.name)?, true),
                Fill::Slots => (capacity, false),
            };
            Ok(MapFill { map: m.name, entries, capacity, fills })
        })
        .collect()
}

impl Collector for Dataplane {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        if !self.root.exists() {
            return Ok(()); // nothing pinned yet, or cleaned up: no figures rather than invented ones
        }
        let fill = match map_fill(&self.root) {
            Ok(f) => f,
            Err(e) => {
                tracing::warn!("metrics: cannot read the pinned maps: {e:#}");
                return Ok(());
            }
        };
        let mut enc = encoder.encode_descriptor("ebpf_proxy_map_entries", "Entries in each pinned BPF map", None, MetricType::Gauge)?;
        for m in &fill {
            ConstGauge::new(m.entries as i64).encode(enc.encode_family(&[("map", m.map)])?)?;
        }
        let mut enc = encoder.encode_descriptor("ebpf_proxy_map_capacity", "Maximum entries of each pinned BPF map", None, MetricType::Gauge)?;
        for m in &fill {
            ConstGauge::new(m.capacity as i64).encode(enc.encode_family(&[("map", m.map)])?)?;
        }
        // Arrays have every slot from the start: only maps that fill have a pressure.
        let mut enc = encoder.encode_descriptor(
            "ebpf_proxy_map_pressure",
            "Entries over capacity (0 to 1) of each pinned BPF map that fills (hash, LRU and LPM maps)",
            None,
            MetricType::Gauge,
        )?;
        for m in fill.iter().filter(|m| m.fills && m.capacity > 0) {
            ConstGauge::new(m.entries as f64 / m.capacity as f64).encode(enc.encode_family(&[("map", m.map)])?)?;
        }
        let counters = match crate::maps::pinned_counters(&self.root) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("metrics: cannot read the packet counters: {e:#}");
                return Ok(());
            }
        };
        encode_conntrack(&mut encoder, &fill, &counters)?;
        encode_fragments(&mut encoder, &counters)?;
        encode_xdp(&mut encoder, &counters, &self.root)?;
        let mut enc = encoder.encode_descriptor(
            "ebpf_proxy_packets",
            "Packets seen by the datapath (summed over CPUs), by verdict and its reason",
            None,
            MetricType::Counter,
        )?;
        // Conntrack's and the fragments' own counters are not verdicts: shown above.
        for (counter, value) in DpCounter::ALL.iter().zip(&counters) {
            let Some(verdict) = counter.verdict() else { continue };
            let labels = [("verdict", verdict.name()), ("reason", counter.name())];
            ConstCounter::new(*value).encode(enc.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

/// IP fragments the datapath followed: first fragments whose ports it
/// remembered, later ones that took them. (Those it could not follow are
/// packets `passed` for reason `fragment`.)
fn encode_fragments(encoder: &mut DescriptorEncoder, counters: &[u64]) -> std::fmt::Result {
    let mut enc = encoder.encode_descriptor(
        "ebpf_proxy_fragments",
        "IP fragments followed: first fragments whose ports were remembered, later ones that took them",
        None,
        MetricType::Counter,
    )?;
    for (kind, counter) in [("first", DpCounter::FragmentFirst), ("later", DpCounter::FragmentFollowed)] {
        ConstCounter::new(counters[counter as usize]).encode(enc.encode_family(&[("fragment", kind)])?)?;
    }
    Ok(())
}

/// Packets XDP decided on `--xdp-devices` (the rest went on to TC): how much
/// of the external traffic the fast path takes; and of those, the frames
/// XDP sent out itself, by the interface they left by.
fn encode_xdp(encoder: &mut DescriptorEncoder, counters: &[u64], root: &Path) -> std::fmt::Result {
    let enc = encoder.encode_descriptor(
        "ebpf_proxy_xdp_finished",
        "Packets xdp_ingress translated or dropped itself (also counted in ebpf_proxy_packets by verdict)",
        None,
        MetricType::Counter,
    )?;
    ConstCounter::new(counters[DpCounter::XdpFinished as usize]).encode(enc)?;
    let sent = match crate::xdp::sent(root) {
        Ok(sent) => sent,
        Err(e) => {
            tracing::debug!("metrics: no XDP send-out counts: {e:#}");
            return Ok(());
        }
    };
    let mut enc = encoder.encode_descriptor(
        "ebpf_proxy_xdp_sent",
        "Frames XDP translated and sent out itself (XDP_TX or redirect), by the interface they left by; the rest went up the stack",
        None,
        MetricType::Counter,
    )?;
    for (ifindex, frames) in sent {
        let interface = nix::net::if_::if_indextoname(ifindex)
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|_| format!("ifindex {ifindex}"));
        ConstCounter::new(frames).encode(enc.encode_family(&[("interface", interface.as_str())])?)?;
    }
    Ok(())
}

/// Confirmed and unconfirmed entries, and the confirmed entries the LRU
/// evicted: every entry that reached CONNTRACK (`ct_promoted`) is still
/// there, was removed by the datapath (`ct_released`), or was evicted.
fn encode_conntrack(
    encoder: &mut DescriptorEncoder,
    fill: &[MapFill],
    counters: &[u64],
) -> std::fmt::Result {
    let entries = |map: &str| fill.iter().find(|m| m.map == map).map(|m| m.entries);
    let (Some(confirmed), Some(unconfirmed)) =
        (entries(proxy_common::MAP_CONNTRACK), entries(proxy_common::MAP_CT_UNCONFIRMED))
    else {
        return Ok(());
    };
    let mut enc = encoder.encode_descriptor(
        "ebpf_proxy_conntrack_entries",
        "Conntrack entries (two or three per flow): confirmed (the flow saw a reply) or unconfirmed",
        None,
        MetricType::Gauge,
    )?;
    ConstGauge::new(confirmed as i64).encode(enc.encode_family(&[("state", "confirmed")])?)?;
    ConstGauge::new(unconfirmed as i64).encode(enc.encode_family(&[("state", "unconfirmed")])?)?;
    let promoted = counters[DpCounter::CtPromoted as usize];
    let released = counters[DpCounter::CtReleased as usize];
    let enc = encoder.encode_descriptor(
        "ebpf_proxy_conntrack_confirmed_evictions",
        "Confirmed conntrack entries the full table evicted (entries that reached it, less those there now or removed)",
        None,
        MetricType::Counter,
    )?;
    ConstCounter::new(promoted.saturating_sub(released).saturating_sub(confirmed)).encode(enc)?;
    Ok(())
}

async fn scrape(State(m): State<Metrics>) -> impl IntoResponse {
    let body = tokio::task::spawn_blocking(move || m.encode()).await.unwrap_or_default();
    ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], body)
}

/// Binds now (so a taken port fails the start), serves in the background
/// with the limits of http_server.
pub async fn serve(addr: SocketAddr, metrics: Metrics) -> Result<tokio::task::JoinHandle<()>> {
    let app = Router::new().route("/metrics", get(scrape)).with_state(metrics);
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("--metrics-bind-address {addr}: {e}"))?;
    Ok(tokio::spawn(http_server::serve(listener, app, ConnectionLimit::default())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        model::{self, ModelConfig},
        source::Snapshot,
    };

    const BAD: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: badip, namespace: a}
spec: {clusterIP: 10.96.300.1, ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: a}
spec: {clusterIP: 10.96.0.7, ports: [{name: a, port: 70000}, {name: b, port: 81, protocol: ICMP}, {name: c, port: 82}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: a, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: c, port: 8080}]
endpoints: [{addresses: [10.244.0.300]}, {addresses: [10.244.0.3]}, {addresses: [127.0.0.1]}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-2, namespace: a, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: c, port: 8080}]
endpoints: [{addresses: [10.244.0.3]}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: orphan, namespace: a, labels: {kubernetes.io/service-name: gone}}
addressType: IPv4
endpoints: []
---
apiVersion: v1
kind: Service
metadata: {name: grab, namespace: a}
spec: {clusterIP: 10.96.0.8, externalIPs: [10.96.0.7], ports: [{name: c, port: 82}]}
status: {loadBalancer: {ingress: [{ip: 192.0.2.1, ipMode: Tunnel}]}}
---
apiVersion: networking.k8s.io/v1
kind: ServiceCIDR
metadata: {name: kubernetes}
spec: {cidrs: [10.96.0.0/16, 10.96.0.0]}
"#;

    #[test]
    fn every_problem_the_model_reports_is_counted_under_its_kind_and_reason() {
        let (_, errors) = model::build(&Snapshot::from_yaml(BAD), &ModelConfig { node_name: "n".into(), ..Default::default() });
        assert!(errors.len() >= 5, "{errors:?}");
        let m = Metrics::new(Path::new("/nonexistent"));
        let all: Vec<&ObjectError> = errors.iter().collect();
        m.skipped(&errors, &all);
        m.skipped(&errors, &[]);
        let text = m.encode();
        let line = |needle: &str| text.lines().find(|l| l.starts_with(needle)).map(str::to_string);
        for e in &errors {
            let (kind, reason) = classify(e);
            let series = format!(r#"ebpf_proxy_invalid_objects{{kind="{kind}",reason="{reason}"}}"#);
            assert!(line(&series).is_some(), "{e} not counted as {series}: {text}");
        }
        assert_eq!(
            line(r#"ebpf_proxy_skipped_objects_total{kind="Service",reason="port_out_of_range"}"#).as_deref(),
            Some(r#"ebpf_proxy_skipped_objects_total{kind="Service",reason="port_out_of_range"} 1"#),
            "{text}"
        );
        assert!(line(r#"ebpf_proxy_invalid_objects{kind="EndpointSlice",reason="invalid_ip"} 1"#).is_some(), "{text}");
        assert!(line(r#"ebpf_proxy_invalid_objects{kind="EndpointSlice",reason="invalid_endpoint"} 1"#).is_some(), "{text}");
        assert!(line(r#"ebpf_proxy_skipped_objects_total{kind="EndpointSlice",reason="invalid_endpoint"} 1"#).is_some(), "{text}");
        assert!(line(r#"ebpf_proxy_invalid_objects{kind="Service",reason="unknown_protocol"} 1"#).is_some(), "{text}");
        assert!(line(r#"ebpf_proxy_invalid_objects{kind="EndpointSlice",reason="missing_service"} 1"#).is_some(), "{text}");
        assert!(line(r#"ebpf_proxy_invalid_objects{kind="EndpointSlice",reason="duplicate"} 1"#).is_some(), "{text}");
        assert!(line(r#"ebpf_proxy_invalid_objects{kind="Service",reason="frontend_conflict"} 1"#).is_some(), "{text}");
        assert!(line(r#"ebpf_proxy_invalid_objects{kind="Service",reason="unknown_ip_mode"} 1"#).is_some(), "{text}");
        assert!(line(r#"ebpf_proxy_invalid_objects{kind="ServiceCIDR",reason="invalid_cidr"} 1"#).is_some(), "{text}");
        assert!(line(r#"ebpf_proxy_skipped_objects_total{kind="ServiceCIDR",reason="invalid_cidr"} 1"#).is_some(), "{text}");
        // Without pinned maps, the dataplane figures are absent, not invented.
        assert!(!text.contains("ebpf_proxy_map_entries"), "{text}");
    }

    #[test]
    fn verdicts_cover_every_counter() {
        use proxy_common::Verdict;
        let verdict = |c: DpCounter| c.verdict().map(Verdict::name);
        assert_eq!((verdict(DpCounter::NoBackend), DpCounter::NoBackend.name()), (Some("dropped"), "no_backend"));
        assert_eq!(verdict(DpCounter::DropNoLocal), Some("dropped"));
        assert_eq!(verdict(DpCounter::Rejected), Some("rejected"));
        assert_eq!(verdict(DpCounter::RejectLimited), Some("dropped"));
        assert_eq!(verdict(DpCounter::NodeRouteFailed), Some("dropped"));
        assert_eq!(verdict(DpCounter::NewFlow), Some("translated"));
        assert_eq!(verdict(DpCounter::Fragment), Some("passed"));
        assert_eq!(verdict(DpCounter::CtPromoted), None);
        let verdicts: std::collections::BTreeSet<_> = DpCounter::ALL.iter().filter_map(|c| verdict(*c)).collect();
        assert_eq!(verdicts.len(), 4, "{verdicts:?}");
    }
}
