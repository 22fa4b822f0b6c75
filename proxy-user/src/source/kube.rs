//! The Kubernetes API source: kube-rs watchers on Services, EndpointSlices
//! and this node's Node, with kube-proxy's selectors, and on ServiceCIDRs
//! where the API server serves them (asked once at start). Each watcher
//! feeds a kube-rs reflector store; a snapshot of them all is published once
//! every store has had its first complete list, and again after each
//! change. A watch that expires (410 Gone) makes the watcher relist, and the
//! store swaps in the relisted objects when the list is complete, so objects
//! deleted meanwhile go away and nothing half-listed is ever served. Errors
//! are retried within a second (`retry`). An unchanged object keeps its
//! `Arc` from one snapshot to the next: the model tells changes by it.

use std::{collections::BTreeMap, path::Path, pin::Pin, sync::Arc};

use anyhow::{Context, Result};
use futures::{Stream, StreamExt};
use k8s_openapi::{
    api::{
        core::v1::{Node, NodeSpec, Service},
        networking::v1::ServiceCIDR,
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::{
    Api, Client, Config, Resource, ResourceExt,
    api::ListParams,
    config::{KubeConfigOptions, Kubeconfig},
    runtime::{
        WatchStreamExt,
        reflector::{self, Store},
        watcher,
    },
};
use tracing::{debug, info, warn};

use crate::endpoint_slice::EndpointSlice;

use super::{
    Snapshot, SnapshotSender, Source,
    retry::{self, Retry},
};

/// kube-proxy's selector for Services and EndpointSlices
/// (cmd/kube-proxy/app/server.go): nothing another proxy owns
/// (`service.kubernetes.io/service-proxy-name`), and no slices of headless
/// Services (`service.kubernetes.io/headless`).
pub const PROXY_LABEL_SELECTOR: &str = "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless";

/// The labels `PROXY_LABEL_SELECTOR` excludes, whatever their value.
const NOT_OURS_LABELS: [&str; 2] = ["service.kubernetes.io/service-proxy-name", "service.kubernetes.io/headless"];

/// Whether `PROXY_LABEL_SELECTOR` admits an object with these labels. The
/// API server applies the selector for this source; sources without a
/// server to ask (manifests) apply it here, so both serve the same objects.
pub fn is_ours(labels: Option<&BTreeMap<String, String>>) -> bool {
    labels.is_none_or(|labels| NOT_OURS_LABELS.iter().all(|label| !labels.contains_key(*label)))
}

/// A client from `--kubeconfig FILE`, or from the in-cluster service account
/// when no file is given.
pub async fn client(kubeconfig: Option<&Path>) -> Result<Client> {
    let config = match kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path).with_context(|| format!("--kubeconfig {}", path.display()))?;
            Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                .await
                .with_context(|| format!("--kubeconfig {}", path.display()))?
        }
        None => Config::incluster().context(
            "no --manifests or --kubeconfig given, and the in-cluster configuration is unusable \
             (KUBERNETES_SERVICE_HOST/PORT and the service account token are needed)",
        )?,
    };
    Client::try_from(config).context("create the Kubernetes client")
}

pub struct KubeSource {
    client: Client,
    node_name: String,
}

impl KubeSource {
    pub fn new(client: Client, node_name: String) -> Self {
        KubeSource { client, node_name }
    }
}

fn key<K: Resource>(obj: &K) -> String {
    format!("{}/{}", obj.meta().namespace.as_deref().unwrap_or(""), obj.meta().name.as_deref().unwrap_or(""))
}

/// Managed fields are large and never read; dropping them keeps memory to what the model uses.
fn trim<K: Resource>(obj: &mut K) {
    obj.meta_mut().managed_fields = None;
}

fn trim_service(svc: &mut Service) {
    trim(svc);
    crate::service::shrink(svc);
}

/// Only the Node's name and labels (the zone, for topology) and whether it is
/// going away (deletion, the autoscaler's taint, for /healthz) matter; the
/// rest changes with every status heartbeat and must not cause a sync.
fn node_identity(node: &mut Node) {
    *node = identity(std::mem::take(node));
}

fn identity(node: Node) -> Node {
    let taints = node.spec.and_then(|s| s.taints).map(|t| {
        t.into_iter().filter(|t| t.key == crate::model::node::TO_BE_DELETED_TAINT).collect::<Vec<_>>()
    });
    Node {
        metadata: ObjectMeta {
            name: node.metadata.name,
            labels: node.metadata.labels,
            deletion_timestamp: node.metadata.deletion_timestamp,
            ..Default::default()
        },
        spec: Some(NodeSpec { taints: taints.filter(|t| !t.is_empty()), ..Default::default() }),
        ..Default::default()
    }
}

/// A watcher stream on every `K` that retries after `retry`'s backoff,
/// started over whenever one of its own calls succeeds; its errors
/// (expired watches, API outages) are reported and the stream goes on.
fn watch<K>(client: Client, config: watcher::Config) -> impl Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send
where
    K: Resource<DynamicType = ()> + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + 'static,
{
    let (client, answers) = retry::answering(client);
    watcher(Api::<K>::all(client), config).backoff(Retry::new(answers))
}

type EventStream<K> = Pin<Box<dyn Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send>>;

/// Whether to watch ServiceCIDRs (`networking.k8s.io/v1`, Kubernetes 1.33+),
/// by a one-object list: 404 means the server has no such resource (older
/// Kubernetes), 403 that our ClusterRole predates it. Either way the agent
/// goes on with `--service-cidr`, as before. Any other failure (the API
/// unreachable) is retried: nothing can be served before the API answers,
/// and guessing would either never list or watch a resource forever.
async fn serves_service_cidrs(client: &Client) -> bool {
    let api = Api::<ServiceCIDR>::all(client.clone());
    let mut backoff = retry::backoff();
    loop {
        match api.list(&ListParams::default().limit(1)).await {
            Ok(_) => {
                info!("the API serves networking.k8s.io/v1 ServiceCIDRs: where any exist, their CIDRs replace --service-cidr");
                return true;
            }
            Err(kube::Error::Api(status)) if status.code == 404 => {
                info!("the API has no networking.k8s.io/v1 ServiceCIDRs (Kubernetes before 1.33): using --service-cidr");
                return false;
            }
            Err(kube::Error::Api(status)) if status.code == 403 => {
                warn!(
                    "not allowed to list networking.k8s.io servicecidrs (apply deploy/rbac.yaml of this version): \
                     using --service-cidr: {}",
                    status.message
                );
                return false;
            }
            Err(e) => {
                let wait = backoff.next().unwrap_or(retry::RETRY_MAX);
                warn!("cannot ask the API whether it serves ServiceCIDRs, retrying in {wait:?}: {e}");
                tokio::time::sleep(wait).await;
            }
        }
    }
}

impl Source for KubeSource {
    async fn run(self, updates: SnapshotSender) -> Result<()> {
        let selector = watcher::Config::default().labels(PROXY_LABEL_SELECTOR);
        let node_selector = watcher::Config::default().fields(&format!("metadata.name={}", self.node_name));
        match Api::<Node>::all(self.client.clone()).get_opt(&self.node_name).await {
            Ok(Some(_)) => {}
            Ok(None) => warn!(
                node = %self.node_name,
                "no Node of this name in the API (check --node-name); serving without its zone until it appears"
            ),
            Err(e) => warn!(node = %self.node_name, "cannot read this node's Node object, will keep watching: {e}"),
        }
        let served = tokio::select! {
            served = serves_service_cidrs(&self.client) => served,
            _ = updates.closed() => return Ok(()),
        };
        let (cidr_store, cidr_writer) = reflector::store::<ServiceCIDR>();
        let mut cidrs: EventStream<ServiceCIDR> = if served {
            Box::pin(watch(self.client.clone(), watcher::Config::default()).modify(trim).reflect(cidr_writer))
        } else {
            Box::pin(futures::stream::pending())
        };
        let (service_store, service_writer) = reflector::store::<Service>();
        let (slice_store, slice_writer) = reflector::store::<EndpointSlice>();
        let (node_store, node_writer) = reflector::store::<Node>();
        let mut services = Box::pin(watch::<Service>(self.client.clone(), selector.clone()).modify(trim_service).reflect(service_writer));
        // A slice keeps only what the model reads as it is decoded (endpoint_slice.rs): nothing to trim.
        let mut slices = Box::pin(watch::<EndpointSlice>(self.client.clone(), selector).reflect(slice_writer));
        let mut nodes = Box::pin(watch::<Node>(self.client.clone(), node_selector).modify(node_identity).reflect(node_writer));

        // Whether each store has had a complete list (an unserved resource's
        // empty store is complete from the start).
        let mut listed = Listed { cidrs: !served, ..Listed::default() };
        let mut node_seen: Option<Arc<Node>> = None;
        let mut published = false;
        loop {
            let changed = tokio::select! {
                ev = services.next() => handle("services", ev, &mut listed.services)?,
                ev = slices.next() => handle("endpointslices", ev, &mut listed.slices)?,
                ev = cidrs.next() => handle("servicecidrs", ev, &mut listed.cidrs)?,
                ev = nodes.next() => {
                    handle("nodes", ev, &mut listed.node)?;
                    // Only the Node's identity is stored: a status heartbeat changes nothing.
                    let node = node_store.state().into_iter().next();
                    let changed = listed.node && (node.as_deref() != node_seen.as_deref() || !published);
                    node_seen = node;
                    changed
                }
                _ = updates.closed() => return Ok(()),
            };
            if !(changed && listed.all()) {
                continue;
            }
            let snap = Snapshot {
                services: sorted(&service_store),
                slices: sorted(&slice_store),
                node: node_seen.as_deref().cloned(),
                service_cidrs: sorted(&cidr_store),
            };
            if !published {
                info!(
                    services = snap.services.len(),
                    endpointslices = snap.slices.len(),
                    node_found = snap.node.is_some(),
                    servicecidrs = snap.service_cidrs.len(),
                    "initial list from the Kubernetes API complete"
                );
                published = true;
            }
            updates.send_replace(Some(Arc::new(snap)));
        }
    }
}

#[derive(Default)]
struct Listed {
    services: bool,
    slices: bool,
    node: bool,
    cidrs: bool,
}

impl Listed {
    fn all(&self) -> bool {
        self.services && self.slices && self.node && self.cidrs
    }
}

/// A store's objects by namespace/name, so that a snapshot's order (and
/// what the model reports in it) does not depend on the store's hashing.
fn sorted<K: Resource + Clone>(store: &Store<K>) -> Vec<Arc<K>>
where
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    let mut objects = store.state();
    objects.sort_unstable_by(|a, b| {
        (a.meta().namespace.as_deref(), a.meta().name.as_deref()).cmp(&(b.meta().namespace.as_deref(), b.meta().name.as_deref()))
    });
    objects
}

/// One item of a reflected watcher stream (the store has applied it);
/// whether what is served changed. `listed` becomes true with the first
/// complete list; before it nothing is served, and a relist is served only
/// once complete (the store swaps it in then).
fn handle<K: Resource + ResourceExt>(
    what: &str,
    item: Option<Result<watcher::Event<K>, watcher::Error>>,
    listed: &mut bool,
) -> Result<bool> {
    match item {
        Some(Ok(ev)) => Ok(match &ev {
            watcher::Event::Apply(o) | watcher::Event::Delete(o) => {
                debug!(resource = what, object = %key(o), "watch event");
                *listed
            }
            watcher::Event::Init | watcher::Event::InitApply(_) => false,
            watcher::Event::InitDone => {
                *listed = true;
                true
            }
        }),
        Some(Err(e)) => {
            // The watcher relists or rewatches by itself, after `retry`'s
            // backoff; what is served stays as it is meanwhile.
            warn!(resource = what, "watch interrupted, resuming: {e}");
            Ok(false)
        }
        None => anyhow::bail!("the {what} watch ended"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn is_ours_applies_the_selector_the_api_source_sends() {
        let terms: Vec<String> = NOT_OURS_LABELS.iter().map(|l| format!("!{l}")).collect();
        assert_eq!(PROXY_LABEL_SELECTOR, terms.join(","));
        let labels = |pairs: &[(&str, &str)]| pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<BTreeMap<_, _>>();
        assert!(is_ours(None));
        assert!(is_ours(Some(&labels(&[("kubernetes.io/service-name", "web"), ("app", "web")]))));
        // Any value, the empty one included, makes an object another proxy's.
        assert!(!is_ours(Some(&labels(&[("service.kubernetes.io/service-proxy-name", "cilium")]))));
        assert!(!is_ours(Some(&labels(&[("service.kubernetes.io/service-proxy-name", "")]))));
        assert!(!is_ours(Some(&labels(&[("kubernetes.io/service-name", "hl"), ("service.kubernetes.io/headless", "")]))));
    }
}
