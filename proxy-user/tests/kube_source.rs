//! The Kubernetes source against a fake API server: a kube-rs `Client` over
//! a `tower_test::mock` service, answered by a small in-memory apiserver that
//! keeps resource versions, honours label and field selectors, and streams
//! watch events over time. Covers the initial list, added / modified /
//! deleted events, bookmarks (a watch that ends resumes from the bookmark),
//! and a 410 Gone sent as a real apiserver sends it — an ERROR event inside a
//! 200 watch stream — after which the relist drops objects deleted meanwhile.
//! ServiceCIDRs are watched where the server has them, and a server without
//! them (or one that forbids them) is asked once. An outage is retried
//! within a second, on tokio's paused clock. Every request is checked
//! against `rbac::API_ACCESS`.

use std::{
    collections::BTreeMap,
    convert::Infallible,
    sync::{Arc, Mutex},
    time::Duration,
};

use bytes::Bytes;
use futures::channel::mpsc;
use http::{Request, Response, StatusCode};
use http_body_util::StreamBody;
use http_body::Frame;
use proxy_user::{
    model::{self, ModelConfig},
    rbac::API_ACCESS,
    source::{
        Snapshot, Source,
        kube::{KubeSource, PROXY_LABEL_SELECTOR},
        retry::{RETRY_MAX, RETRY_MIN},
    },
};
use serde_json::{Value, json};
use tokio::sync::watch;

type Chunk = Result<Frame<Bytes>, Infallible>;
type Body = StreamBody<mpsc::UnboundedReceiver<Chunk>>;

const NODE: &str = "node-a";
const TIMEOUT: Duration = Duration::from_secs(20);

/// One request the source made, as RBAC sees it, when, and the answer's status.
#[derive(Debug, Clone)]
struct Recorded {
    group: String,
    resource: String,
    verb: String,
    query: BTreeMap<String, String>,
    at: tokio::time::Instant,
    code: u16,
}

struct OpenWatch {
    resource: String,
    label_selector: Option<String>,
    field_selector: Option<String>,
    tx: mpsc::UnboundedSender<Chunk>,
}

#[derive(Default)]
struct ApiState {
    resource_version: u64,
    /// resource -> "namespace/name" -> object
    objects: BTreeMap<String, BTreeMap<String, Value>>,
    watches: Vec<OpenWatch>,
    requests: Vec<Recorded>,
    /// Resources this server answers with an error status instead (404: an
    /// older Kubernetes without them; 403: RBAC without them).
    refused: BTreeMap<String, u16>,
}

#[derive(Clone, Default)]
struct FakeApi(Arc<Mutex<ApiState>>);

/// `!key` and `key=value` terms, comma-separated: the forms the agent uses.
fn matches_selector(selector: Option<&str>, fields: &BTreeMap<String, String>) -> bool {
    selector.into_iter().flat_map(|s| s.split(',')).filter(|t| !t.is_empty()).all(|term| {
        match (term.strip_prefix('!'), term.split_once('=')) {
            (Some(key), _) => !fields.contains_key(key),
            (None, Some((k, v))) => fields.get(k).map(String::as_str) == Some(v),
            (None, None) => fields.contains_key(term),
        }
    })
}

fn labels_of(obj: &Value) -> BTreeMap<String, String> {
    obj["metadata"]["labels"]
        .as_object()
        .map(|m| m.iter().map(|(k, v)| (k.clone(), v.as_str().unwrap_or("").to_string())).collect())
        .unwrap_or_default()
}

fn fields_of(obj: &Value) -> BTreeMap<String, String> {
    let mut f = BTreeMap::new();
    f.insert("metadata.name".into(), obj["metadata"]["name"].as_str().unwrap_or("").to_string());
    f.insert("metadata.namespace".into(), obj["metadata"]["namespace"].as_str().unwrap_or("").to_string());
    f
}

fn key_of(obj: &Value) -> String {
    format!("{}/{}", obj["metadata"]["namespace"].as_str().unwrap_or(""), obj["metadata"]["name"].as_str().unwrap_or(""))
}

fn list_kind(resource: &str) -> (&'static str, &'static str) {
    match resource {
        "services" => ("v1", "ServiceList"),
        "endpointslices" => ("discovery.k8s.io/v1", "EndpointSliceList"),
        "nodes" => ("v1", "NodeList"),
        "servicecidrs" => ("networking.k8s.io/v1", "ServiceCIDRList"),
        other => panic!("unexpected resource {other}"),
    }
}

fn body_once(bytes: Vec<u8>) -> Body {
    let (tx, rx) = mpsc::unbounded();
    tx.unbounded_send(Ok(Frame::data(Bytes::from(bytes)))).unwrap();
    StreamBody::new(rx)
}

fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": message, "reason": reason, "code": code})
}

impl FakeApi {
    /// Serves requests from the mocked client until it is dropped.
    fn serve(&self, mut handle: tower_test::mock::Handle<Request<kube::client::Body>, Response<Body>>) {
        let api = self.clone();
        tokio::spawn(async move {
            while let Some((req, send)) = handle.next_request().await {
                let response = api.answer(&req);
                api.0.lock().unwrap().requests.last_mut().expect("recorded").code = response.status().as_u16();
                send.send_response(response);
            }
        });
    }

    fn answer(&self, req: &Request<kube::client::Body>) -> Response<Body> {
        let path = req.uri().path().to_string();
        let query: BTreeMap<String, String> =
            url_pairs(req.uri().query().unwrap_or("")).into_iter().collect();
        let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
        let (group, rest) = match segments.as_slice() {
            ["api", "v1", rest @ ..] => ("", rest),
            ["apis", group, "v1", rest @ ..] => (*group, rest),
            _ => panic!("unexpected path {path}"),
        };
        let (resource, name) = match rest {
            [resource] => (resource.to_string(), None),
            [resource, name] => (resource.to_string(), Some(name.to_string())),
            _ => panic!("unexpected path {path}"),
        };
        let watching = query.get("watch").is_some_and(|w| w == "true" || w == "1");
        let verb = match (&name, watching) {
            (Some(_), _) => "get",
            (None, true) => "watch",
            (None, false) => "list",
        };
        assert_eq!(req.method(), http::Method::GET, "{path}");
        let mut st = self.0.lock().unwrap();
        st.requests.push(Recorded {
            group: group.into(),
            resource: resource.clone(),
            verb: verb.into(),
            query: query.clone(),
            at: tokio::time::Instant::now(),
            code: 0,
        });
        match st.refused.get(&resource) {
            // What an apiserver without the resource answers: plain text, no Status.
            Some(404) => {
                return Response::builder().status(StatusCode::NOT_FOUND).body(body_once(b"404 page not found\n".to_vec())).unwrap();
            }
            Some(&code) => {
                let reason = if code == 403 { "Forbidden" } else { "ServiceUnavailable" };
                let body = status(code, reason, &format!("cannot {verb} resource \"{resource}\" in API group \"{group}\""));
                return Response::builder().status(code).body(body_once(serde_json::to_vec(&body).unwrap())).unwrap();
            }
            None => {}
        }
        let label_selector = query.get("labelSelector").cloned();
        let field_selector = query.get("fieldSelector").cloned();
        let selected = |obj: &&Value| {
            matches_selector(label_selector.as_deref(), &labels_of(obj))
                && matches_selector(field_selector.as_deref(), &fields_of(obj))
        };
        match verb {
            "get" => {
                let found = st.objects.get(&resource).and_then(|m| m.get(&format!("/{}", name.as_ref().unwrap())));
                match found {
                    Some(obj) => Response::new(body_once(serde_json::to_vec(obj).unwrap())),
                    None => Response::builder()
                        .status(StatusCode::NOT_FOUND)
                        .body(body_once(serde_json::to_vec(&status(404, "NotFound", "not found")).unwrap()))
                        .unwrap(),
                }
            }
            "list" => {
                let (api_version, kind) = list_kind(&resource);
                let items: Vec<&Value> = st.objects.get(&resource).into_iter().flat_map(|m| m.values()).filter(selected).collect();
                let list = json!({"apiVersion": api_version, "kind": kind,
                                  "metadata": {"resourceVersion": st.resource_version.to_string()}, "items": items});
                Response::new(body_once(serde_json::to_vec(&list).unwrap()))
            }
            _ => {
                let (tx, rx) = mpsc::unbounded();
                st.watches.push(OpenWatch { resource, label_selector, field_selector, tx });
                Response::new(StreamBody::new(rx))
            }
        }
    }

    /// Answers every request on `resource` with `code` from now on.
    fn refuse(&self, resource: &str, code: u16) {
        self.0.lock().unwrap().refused.insert(resource.into(), code);
    }

    /// Answers requests on `resource` again.
    fn admit(&self, resource: &str) {
        self.0.lock().unwrap().refused.remove(resource);
    }

    fn requests(&self) -> Vec<Recorded> {
        self.0.lock().unwrap().requests.clone()
    }

    fn watches_open(&self, resource: &str) -> usize {
        let mut st = self.0.lock().unwrap();
        st.watches.retain(|w| !w.tx.is_closed());
        st.watches.iter().filter(|w| w.resource == resource).count()
    }

    /// Waits until the source watches `resource` (so no event is sent into the void).
    async fn wait_watching(&self, resource: &str) {
        let deadline = tokio::time::Instant::now() + TIMEOUT;
        while self.watches_open(resource) == 0 {
            assert!(tokio::time::Instant::now() < deadline, "no watch on {resource}; requests: {:?}", self.requests());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn visible(w: &OpenWatch, obj: &Value) -> bool {
        matches_selector(w.label_selector.as_deref(), &labels_of(obj))
            && matches_selector(w.field_selector.as_deref(), &fields_of(obj))
    }

    fn send_line(w: &OpenWatch, event: &Value) {
        let _ = w.tx.unbounded_send(Ok(Frame::data(Bytes::from(format!("{event}\n")))));
    }

    /// An event for every open watch of `resource` (one without an object goes to all).
    fn send(st: &mut ApiState, resource: &str, event: &Value, obj: Option<&Value>) {
        for w in st.watches.iter().filter(|w| w.resource == resource) {
            if obj.is_none_or(|o| Self::visible(w, o)) {
                Self::send_line(w, event);
            }
        }
    }

    /// Creates or replaces an object, as `kubectl apply` would. Like the
    /// apiserver, a watch whose selector the change makes the object enter
    /// or leave sees ADDED or DELETED.
    fn apply(&self, resource: &str, mut obj: Value) {
        let mut st = self.0.lock().unwrap();
        st.resource_version += 1;
        obj["metadata"]["resourceVersion"] = json!(st.resource_version.to_string());
        let key = key_of(&obj);
        let old = st.objects.entry(resource.into()).or_default().insert(key, obj.clone());
        for w in st.watches.iter().filter(|w| w.resource == resource) {
            let before = old.as_ref().is_some_and(|o| Self::visible(w, o));
            let kind = match (before, Self::visible(w, &obj)) {
                (false, true) => "ADDED",
                (true, true) => "MODIFIED",
                (true, false) => "DELETED",
                (false, false) => continue,
            };
            Self::send_line(w, &json!({"type": kind, "object": obj}));
        }
    }

    fn delete(&self, resource: &str, key: &str) {
        let mut st = self.0.lock().unwrap();
        st.resource_version += 1;
        let mut obj = st.objects.get_mut(resource).and_then(|m| m.remove(key)).expect("deleting an object that exists");
        obj["metadata"]["resourceVersion"] = json!(st.resource_version.to_string());
        Self::send(&mut st, resource, &json!({"type": "DELETED", "object": obj}), Some(&obj));
    }

    /// Deleted while no watch could tell: only a relist can notice.
    fn delete_unseen(&self, resource: &str, key: &str) {
        let mut st = self.0.lock().unwrap();
        st.resource_version += 1;
        st.objects.get_mut(resource).and_then(|m| m.remove(key)).expect("deleting an object that exists");
    }

    /// A BOOKMARK at the current resource version; returns it.
    fn bookmark(&self, resource: &str) -> String {
        let mut st = self.0.lock().unwrap();
        st.resource_version += 1;
        let rv = st.resource_version.to_string();
        let (api_version, list) = list_kind(resource);
        let kind = list.trim_end_matches("List");
        let event = json!({"type": "BOOKMARK", "object": {"apiVersion": api_version, "kind": kind,
                           "metadata": {"resourceVersion": rv, "annotations": {}}}});
        Self::send(&mut st, resource, &event, None);
        rv
    }

    /// Ends the open watches of `resource`, as the apiserver does at its timeout.
    fn end_watches(&self, resource: &str) {
        self.0.lock().unwrap().watches.retain(|w| w.resource != resource);
    }

    /// The history behind the watches of `resource` is compacted: a real
    /// apiserver answers with an ERROR event carrying a 410 Status inside the
    /// 200 stream, then closes it.
    fn expire(&self, resource: &str) {
        let mut st = self.0.lock().unwrap();
        let event = json!({"type": "ERROR", "object": status(410, "Expired", "too old resource version: 1 (99)")});
        Self::send(&mut st, resource, &event, None);
        st.watches.retain(|w| w.resource != resource);
    }
}

fn url_pairs(q: &str) -> Vec<(String, String)> {
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode(k), decode(v))
        })
        .collect()
}

fn decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                out.push(u8::from_str_radix(&s[i + 1..i + 3], 16).unwrap());
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).unwrap()
}

fn service(name: &str, ip: &str, labels: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Service",
           "metadata": {"name": name, "namespace": "shop", "labels": labels},
           "spec": {"clusterIP": ip, "clusterIPs": [ip], "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}]}})
}

fn slice(name: &str, service: &str, ips: &[&str]) -> Value {
    let endpoints: Vec<Value> = ips.iter().map(|ip| json!({"addresses": [ip], "conditions": {"ready": true}})).collect();
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
           "metadata": {"name": name, "namespace": "shop", "labels": {"kubernetes.io/service-name": service}},
           "addressType": "IPv4", "endpoints": endpoints,
           "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]})
}

fn node(name: &str, zone: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Node",
           "metadata": {"name": name, "labels": {"topology.kubernetes.io/zone": zone}},
           "status": {"conditions": [{"type": "Ready", "status": "True"}]}})
}

fn service_cidr(name: &str, cidrs: &[&str]) -> Value {
    json!({"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
           "metadata": {"name": name}, "spec": {"cidrs": cidrs}})
}

/// The source on a client of `api`, publishing into the returned receiver.
fn start_source(api: &FakeApi) -> (tokio::task::JoinHandle<anyhow::Result<()>>, watch::Receiver<Option<Arc<Snapshot>>>) {
    let (mock, handle) = tower_test::mock::pair::<Request<kube::client::Body>, Response<Body>>();
    api.serve(handle);
    let client = kube::Client::new(mock, "default");
    let (tx, rx) = watch::channel(None);
    (tokio::spawn(KubeSource::new(client, NODE.into()).run(tx)), rx)
}

/// Every request is one `rbac::API_ACCESS` allows.
fn assert_allowed(requests: &[Recorded]) {
    for r in requests {
        let allowed = API_ACCESS
            .iter()
            .any(|a| a.group == r.group && a.resource == r.resource && a.verbs.contains(&r.verb.as_str()));
        assert!(allowed, "{} {}/{} is not in rbac::API_ACCESS", r.verb, r.group, r.resource);
    }
}

/// The names of the snapshot's ServiceCIDRs.
fn cidr_names(s: &Snapshot) -> Vec<String> {
    s.service_cidrs.iter().map(|c| c.metadata.name.clone().unwrap_or_default()).collect()
}

/// The service CIDRs the model makes of a snapshot, with `--service-cidr 172.30.0.0/16`.
fn effective_cidrs(s: &Snapshot) -> Vec<String> {
    let config = ModelConfig { node_name: NODE.into(), service_cidrs: vec!["172.30.0.0/16".parse().unwrap()], ..Default::default() };
    model::build(s, &config).0.service_cidrs.iter().map(ToString::to_string).collect()
}

/// Waits until the published snapshot satisfies `check`; returns it.
async fn wait_for(rx: &mut watch::Receiver<Option<Arc<Snapshot>>>, what: &str, check: impl Fn(&Snapshot) -> bool) -> Arc<Snapshot> {
    let found = match tokio::time::timeout(TIMEOUT, rx.wait_for(|s| s.as_ref().is_some_and(|s| check(s)))).await {
        Ok(Ok(s)) => s.clone(),
        _ => None,
    };
    found.unwrap_or_else(|| panic!("timed out waiting for {what}; last snapshot: {:#?}", summary(rx.borrow().as_deref())))
}

/// Service and slice names, and the node's zone, for assertions and messages.
fn summary(s: Option<&Snapshot>) -> Option<(Vec<String>, Vec<String>, Option<String>)> {
    let s = s?;
    let names = |m: &[&k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta]| {
        m.iter().map(|m| m.name.clone().unwrap_or_default()).collect::<Vec<_>>()
    };
    let services: Vec<_> = s.services.iter().map(|x| &x.metadata).collect();
    let slices: Vec<_> = s.slices.iter().map(|x| &x.metadata).collect();
    let zone = s.node.as_ref().and_then(|n| n.metadata.labels.as_ref()?.get("topology.kubernetes.io/zone").cloned());
    Some((names(&services), names(&slices), zone))
}

fn services(s: &Snapshot) -> Vec<String> {
    summary(Some(s)).unwrap().0
}

fn slices(s: &Snapshot) -> Vec<String> {
    summary(Some(s)).unwrap().1
}

fn slice_ips(s: &Snapshot, name: &str) -> Vec<String> {
    s.slices
        .iter()
        .filter(|x| x.metadata.name.as_deref() == Some(name))
        .flat_map(|x| x.endpoints.iter().filter_map(|e| e.address.as_deref().map(String::from)))
        .collect()
}

#[tokio::test]
async fn list_watch_bookmark_and_410_relist_against_a_fake_apiserver() {
    let api = FakeApi::default();
    api.apply("services", service("web", "10.96.0.10", json!({})));
    api.apply("services", service("db", "10.96.0.11", json!({})));
    // Another proxy's Service, and a headless Service's slice: kube-proxy's selectors leave them out.
    api.apply("services", service("other", "10.96.0.12", json!({"service.kubernetes.io/service-proxy-name": "cilium"})));
    api.apply("endpointslices", slice("web-1", "web", &["10.244.0.11", "10.244.0.12"]));
    api.apply("endpointslices", slice("db-1", "db", &["10.244.0.21"]));
    let mut headless = slice("hl-1", "hl", &["10.244.0.31"]);
    headless["metadata"]["labels"]["service.kubernetes.io/headless"] = json!("");
    api.apply("endpointslices", headless);
    api.apply("nodes", node(NODE, "zone-a"));
    api.apply("nodes", node("node-b", "zone-b"));

    let (source, mut rx) = start_source(&api);

    // Initial list: only what kube-proxy would see, and only our Node.
    let snap = wait_for(&mut rx, "the initial list", |_| true).await;
    assert_eq!(services(&snap), ["db", "web"]);
    assert_eq!(slices(&snap), ["db-1", "web-1"]);
    assert_eq!(summary(Some(&snap)).unwrap().2.as_deref(), Some("zone-a"));
    // The same model as the manifests source runs on it.
    let (state, errors) = model::build(&snap, &ModelConfig { node_name: NODE.into(), ..Default::default() });
    assert!(errors.is_empty(), "{errors:?}");
    let served: std::collections::BTreeSet<String> = state.frontends.values().map(|f| f.set.service.to_string()).collect();
    assert_eq!(served.into_iter().collect::<Vec<_>>(), ["shop/db:http", "shop/web:http"]);
    let backends: std::collections::BTreeSet<String> = state.backend_sets.values().flatten().map(|b| b.addr.to_string()).collect();
    assert_eq!(backends.into_iter().collect::<Vec<_>>(), ["10.244.0.11", "10.244.0.12", "10.244.0.21"]);

    // Added, modified, deleted.
    for r in ["services", "endpointslices", "nodes"] {
        api.wait_watching(r).await;
    }
    api.apply("services", service("cache", "10.96.0.13", json!({})));
    api.apply("endpointslices", slice("cache-1", "cache", &["10.244.0.41"]));
    wait_for(&mut rx, "cache added", |s| services(s).contains(&"cache".into()) && slices(s).contains(&"cache-1".into())).await;
    api.apply("endpointslices", slice("web-1", "web", &["10.244.0.11", "10.244.0.13"]));
    wait_for(&mut rx, "web-1 modified", |s| slice_ips(s, "web-1") == ["10.244.0.11", "10.244.0.13"]).await;
    api.delete("services", "shop/db");
    wait_for(&mut rx, "db deleted", |s| !services(s).contains(&"db".into())).await;
    api.apply("nodes", node(NODE, "zone-b"));
    wait_for(&mut rx, "the node's new zone", |s| summary(Some(s)).unwrap().2.as_deref() == Some("zone-b")).await;
    // A label change that makes a Service another proxy's: the watch no longer shows it.
    api.apply("services", service("cache", "10.96.0.13", json!({"service.kubernetes.io/service-proxy-name": "cilium"})));

    // A bookmark, then the watch ends (apiserver timeout): the watcher resumes
    // from the bookmark's version, without a relist.
    let lists_before = api.requests().iter().filter(|r| r.resource == "endpointslices" && r.verb == "list").count();
    let rv = api.bookmark("endpointslices");
    api.end_watches("endpointslices"); // the bookmark queued before the end is still delivered
    api.wait_watching("endpointslices").await;
    let last_watch = api.requests().into_iter().filter(|r| r.resource == "endpointslices" && r.verb == "watch").last().unwrap();
    assert_eq!(last_watch.query.get("resourceVersion"), Some(&rv), "resumed from the bookmark: {last_watch:?}");
    assert_eq!(last_watch.query.get("allowWatchBookmarks").map(String::as_str), Some("true"));
    let lists_after = api.requests().iter().filter(|r| r.resource == "endpointslices" && r.verb == "list").count();
    assert_eq!(lists_after, lists_before, "no relist after a watch that simply ended");
    api.apply("endpointslices", slice("db-2", "db", &["10.244.0.22"]));
    wait_for(&mut rx, "an event on the resumed watch", |s| slices(s).contains(&"db-2".into())).await;

    // 410 Gone: web-1 is deleted while the watch history is lost; the relist
    // that follows removes it, and keeps the rest.
    api.delete_unseen("endpointslices", "shop/web-1");
    api.expire("endpointslices");
    let snap = wait_for(&mut rx, "the relist after 410 Gone", |s| !slices(s).contains(&"web-1".into())).await;
    assert_eq!(slices(&snap), ["cache-1", "db-1", "db-2"]);
    assert_eq!(services(&snap), ["web"], "cache went with its label change, db with its deletion");
    let lists_after_gone = api.requests().iter().filter(|r| r.resource == "endpointslices" && r.verb == "list").count();
    assert_eq!(lists_after_gone, lists_after + 1, "exactly one relist");
    assert!(!source.is_finished(), "the source keeps running through a 410");

    // Every request used kube-proxy's selectors and is allowed by our RBAC.
    let requests = api.requests();
    assert_allowed(&requests);
    for r in &requests {
        match (r.resource.as_str(), r.verb.as_str()) {
            ("services" | "endpointslices", _) => {
                assert_eq!(r.query.get("labelSelector").map(String::as_str), Some(PROXY_LABEL_SELECTOR), "{r:?}")
            }
            ("nodes", "list" | "watch") => {
                assert_eq!(r.query.get("fieldSelector").map(String::as_str), Some("metadata.name=node-a"), "{r:?}")
            }
            _ => {}
        }
    }
    for (resource, verb) in [("services", "watch"), ("endpointslices", "list"), ("nodes", "watch"), ("nodes", "get")] {
        assert!(requests.iter().any(|r| r.resource == resource && r.verb == verb), "no {verb} on {resource}");
    }
    drop(rx);
    tokio::time::timeout(TIMEOUT, source).await.expect("the source stops when nobody listens").unwrap().unwrap();
}

#[tokio::test]
async fn service_cidrs_are_listed_and_watched_and_replace_the_flag() {
    let api = FakeApi::default();
    api.apply("services", service("web", "10.96.0.10", json!({})));
    api.apply("nodes", node(NODE, "zone-a"));
    api.apply("servicecidrs", service_cidr("kubernetes", &["10.96.0.0/16", "fd00:10:96::/112"]));
    let (source, mut rx) = start_source(&api);

    // The first snapshot already holds them: no sync ever runs on the flag
    // while the cluster's ServiceCIDRs are still being listed.
    let snap = wait_for(&mut rx, "the initial list", |_| true).await;
    assert_eq!(cidr_names(&snap), ["kubernetes"]);
    assert_eq!(services(&snap), ["web"]);
    assert_eq!(effective_cidrs(&snap), ["10.96.0.0/16", "fd00:10:96::/112"]);

    // Added, changed, deleted: each reaches the snapshot.
    api.wait_watching("servicecidrs").await;
    api.apply("servicecidrs", service_cidr("extra", &["10.97.0.0/16"]));
    let snap = wait_for(&mut rx, "extra added", |s| cidr_names(s) == ["extra", "kubernetes"]).await;
    assert_eq!(effective_cidrs(&snap), ["10.96.0.0/16", "10.97.0.0/16", "fd00:10:96::/112"]);
    api.apply("servicecidrs", service_cidr("extra", &["10.98.0.0/16"]));
    wait_for(&mut rx, "extra changed", |s| effective_cidrs(s).contains(&"10.98.0.0/16".into())).await;
    api.delete("servicecidrs", "/extra");
    api.delete("servicecidrs", "/kubernetes");
    // None left: the flag again.
    let snap = wait_for(&mut rx, "both deleted", |s| s.service_cidrs.is_empty()).await;
    assert_eq!(effective_cidrs(&snap), ["172.30.0.0/16"]);

    let requests = api.requests();
    assert_allowed(&requests);
    let on_cidrs: Vec<(&str, Option<&str>)> = requests
        .iter()
        .filter(|r| r.resource == "servicecidrs")
        .map(|r| (r.verb.as_str(), r.query.get("limit").map(String::as_str)))
        .take(2)
        .collect();
    // The one-object probe, then the watcher's own list.
    assert_eq!(on_cidrs[0], ("list", Some("1")), "{requests:?}");
    assert_eq!(on_cidrs[1].0, "list", "{requests:?}");
    assert!(requests.iter().any(|r| r.resource == "servicecidrs" && r.verb == "watch"));
    assert!(requests.iter().filter(|r| r.resource == "servicecidrs").all(|r| r.group == "networking.k8s.io" && r.query.get("labelSelector").is_none()));
    drop(rx);
    tokio::time::timeout(TIMEOUT, source).await.expect("the source stops when nobody listens").unwrap().unwrap();
}

#[tokio::test]
async fn a_server_without_service_cidrs_is_asked_once_and_the_flag_serves() {
    // 404: Kubernetes before 1.33. 403: a ClusterRole from before this version.
    for code in [404, 403] {
        let api = FakeApi::default();
        api.refuse("servicecidrs", code);
        api.apply("services", service("web", "10.96.0.10", json!({})));
        api.apply("endpointslices", slice("web-1", "web", &["10.244.0.11"]));
        api.apply("nodes", node(NODE, "zone-a"));
        let (source, mut rx) = start_source(&api);

        let snap = wait_for(&mut rx, "the initial list", |_| true).await;
        assert_eq!((services(&snap), slices(&snap)), (vec!["web".to_string()], vec!["web-1".to_string()]), "HTTP {code}");
        assert!(snap.service_cidrs.is_empty());
        assert_eq!(effective_cidrs(&snap), ["172.30.0.0/16"]);
        // Changes are followed as before.
        api.wait_watching("services").await;
        api.apply("services", service("db", "10.96.0.11", json!({})));
        wait_for(&mut rx, "db added", |s| services(s).contains(&"db".into())).await;

        let asked: Vec<String> = api.requests().iter().filter(|r| r.resource == "servicecidrs").map(|r| r.verb.clone()).collect();
        assert_eq!(asked, ["list"], "HTTP {code}: asked once, never watched");
        assert_allowed(&api.requests());
        drop(rx);
        tokio::time::timeout(TIMEOUT, source).await.expect("the source stops when nobody listens").unwrap().unwrap();
    }
}

#[tokio::test]
async fn an_api_that_cannot_say_whether_it_serves_service_cidrs_is_asked_again() {
    let api = FakeApi::default();
    api.apply("nodes", node(NODE, "zone-a"));
    api.apply("servicecidrs", service_cidr("kubernetes", &["10.96.0.0/16"]));
    // 503: neither "served" nor "not served"; guessing either would be wrong.
    api.refuse("servicecidrs", 503);
    let (source, mut rx) = start_source(&api);
    let asked = || api.requests().iter().filter(|r| r.resource == "servicecidrs").count();
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    while asked() == 0 {
        assert!(tokio::time::Instant::now() < deadline, "never asked");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(rx.borrow().is_none(), "published before knowing the service CIDRs");
    api.admit("servicecidrs");
    let snap = wait_for(&mut rx, "the initial list", |_| true).await;
    assert_eq!(cidr_names(&snap), ["kubernetes"], "served once the API answered");
    assert!(asked() >= 2);
    drop(rx);
    tokio::time::timeout(TIMEOUT, source).await.expect("the source stops when nobody listens").unwrap().unwrap();
}

/// The times of the slice watches the API answered with `code`.
fn slice_watches(api: &FakeApi, code: u16) -> Vec<tokio::time::Instant> {
    api.requests().iter().filter(|r| r.resource == "endpointslices" && r.verb == "watch" && r.code == code).map(|r| r.at).collect()
}

/// Waits until the API has answered `n` slice watches with `code`; their times.
async fn slice_watches_answered(api: &FakeApi, code: u16, n: usize) -> Vec<tokio::time::Instant> {
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    while slice_watches(api, code).len() < n {
        assert!(tokio::time::Instant::now() < deadline, "{} slice watches answered {code}", slice_watches(api, code).len());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    slice_watches(api, code)
}

/// The waits between consecutive tries.
fn gaps(times: &[tokio::time::Instant]) -> Vec<Duration> {
    times.windows(2).map(|w| w[1] - w[0]).collect()
}

/// The paused clock's timer ticks in milliseconds: a wait shows up to one later.
const TICK: Duration = Duration::from_millis(2);

#[tokio::test(start_paused = true)]
async fn after_an_outage_the_watch_resumes_within_a_second_and_its_backoff_starts_over() {
    let api = FakeApi::default();
    api.refuse("servicecidrs", 404);
    api.apply("services", service("web", "10.96.0.10", json!({})));
    api.apply("endpointslices", slice("web-1", "web", &["10.244.0.11"]));
    api.apply("nodes", node(NODE, "zone-a"));
    let (source, mut rx) = start_source(&api);
    wait_for(&mut rx, "the initial list", |_| true).await;
    api.wait_watching("endpointslices").await;

    // The API goes away for slices: the open watch ends, every new one fails.
    api.refuse("endpointslices", 503);
    api.end_watches("endpointslices");
    let failed = slice_watches_answered(&api, 503, 12).await;
    // The least wait first, then growing to the cap, never past it however
    // long the outage (kube-rs's default would be at 30 s by now).
    let waits = gaps(&failed);
    assert!((RETRY_MIN..2 * RETRY_MIN + TICK).contains(&waits[0]), "{waits:?}");
    assert!(waits[1..].iter().all(|w| (RETRY_MAX..2 * RETRY_MAX + TICK).contains(w)), "{waits:?}");

    // The API answers again: the next try, at most a cap later, resumes the watch.
    let back = tokio::time::Instant::now();
    api.admit("endpointslices");
    let resumed = slice_watches_answered(&api, 200, 2).await[1];
    assert!(resumed - back < 2 * RETRY_MAX + TICK, "resumed {:?} after the API answered", resumed - back);

    // That watch started (no event yet, so kube-rs saw nothing to reset on)
    // and then failed: its next wait is the least again, not the cap.
    api.refuse("endpointslices", 503);
    api.end_watches("endpointslices");
    let failed = slice_watches_answered(&api, 503, failed.len() + 3).await;
    let waits = gaps(&failed[failed.len() - 3..]);
    assert!((RETRY_MIN..2 * RETRY_MIN + TICK).contains(&waits[0]), "{waits:?}");
    assert!((RETRY_MAX..2 * RETRY_MAX + TICK).contains(&waits[1]), "{waits:?}");

    // Back for good: changes flow again.
    api.admit("endpointslices");
    api.wait_watching("endpointslices").await;
    api.apply("endpointslices", slice("web-1", "web", &["10.244.0.12"]));
    wait_for(&mut rx, "a change after the outage", |s| slice_ips(s, "web-1") == ["10.244.0.12"]).await;
    assert!(!source.is_finished(), "the source keeps running through an outage");
    drop(rx);
    tokio::time::timeout(TIMEOUT, source).await.expect("the source stops when nobody listens").unwrap().unwrap();
}
