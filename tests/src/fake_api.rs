//! A minimal Kubernetes API server over plain HTTP, for running the real
//! agent binary with `--kubeconfig`: it serves lists of the objects it holds
//! (Services, EndpointSlices, Nodes, ServiceCIDRs, honouring a `metadata.name` field
//! selector and `!label` / `label=value` label selectors) and streams watch events the test pushes. Each connection is
//! answered once and closed; a watch stays open until the server is dropped.

use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    path::Path,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
    thread::JoinHandle,
    time::Duration,
};

use anyhow::Result;
use serde_json::{Value, json};

use crate::netns::Netns;

struct Watch {
    resource: String,
    label_selector: String,
    tx: mpsc::Sender<String>,
}

#[derive(Default)]
struct State {
    resource_version: u64,
    /// resource -> (namespace, name) -> object; keyed, so loading a large
    /// cluster object by object stays fast.
    objects: BTreeMap<String, BTreeMap<(String, String), Value>>,
    watches: Vec<Watch>,
    /// "VERB resource" of each request, in order.
    requests: Vec<String>,
}

pub struct FakeApi {
    pub addr: SocketAddr,
    state: Arc<Mutex<State>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// The resource a path names: `services`, `endpointslices`, `nodes`,
/// `servicecidrs` (and a name, for a get).
fn resource_of(path: &str) -> Option<(String, Option<String>)> {
    let p = ["/api/v1/", "/apis/discovery.k8s.io/v1/", "/apis/networking.k8s.io/v1/"]
        .iter()
        .find_map(|prefix| path.strip_prefix(prefix))
        .unwrap_or(path);
    let mut parts = p.split('/');
    let resource = parts.next()?.to_string();
    Some((resource, parts.next().map(str::to_string)))
}

fn list_kind(resource: &str) -> &'static str {
    match resource {
        "services" => "ServiceList",
        "endpointslices" => "EndpointSliceList",
        "servicecidrs" => "ServiceCIDRList",
        _ => "NodeList",
    }
}

impl FakeApi {
    /// Listens on 127.0.0.1 inside `ns`, where the agent will run.
    pub fn start(ns: &Netns) -> Result<FakeApi> {
        let listener = ns.run(|| TcpListener::bind("127.0.0.1:0"))??;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let state = Arc::new(Mutex::new(State::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (st, sp) = (state.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !sp.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((conn, _)) => {
                        let (st, sp) = (st.clone(), sp.clone());
                        std::thread::spawn(move || {
                            let _ = serve(conn, &st, &sp);
                        });
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        });
        Ok(FakeApi { addr, state, stop, thread: Some(thread) })
    }

    /// A kubeconfig that points at this server, written to `path`.
    pub fn write_kubeconfig(&self, path: &Path) -> Result<()> {
        let kc = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster: {{server: \"http://{}\"}}\n\
             users:\n- name: fake\n  user: {{}}\ncontexts:\n- name: fake\n  context: {{cluster: fake, user: fake}}\ncurrent-context: fake\n",
            self.addr
        );
        Ok(std::fs::write(path, kc)?)
    }

    /// Adds or replaces an object (by namespace/name); open watches see ADDED or MODIFIED.
    pub fn apply(&self, resource: &str, obj: Value) {
        self.apply_all(resource, [obj]);
    }

    /// `apply` for many objects under one lock (a large cluster's initial contents).
    pub fn apply_all(&self, resource: &str, objs: impl IntoIterator<Item = Value>) {
        let mut st = self.state.lock().unwrap();
        for mut obj in objs {
            st.resource_version += 1;
            obj["metadata"]["resourceVersion"] = json!(st.resource_version.to_string());
            let text = |v: &Value| v.as_str().unwrap_or("").to_string();
            let key = (text(&obj["metadata"]["namespace"]), text(&obj["metadata"]["name"]));
            let existed = st.objects.entry(resource.to_string()).or_default().insert(key, obj.clone()).is_some();
            if st.watches.is_empty() {
                continue;
            }
            let event = json!({"type": if existed { "MODIFIED" } else { "ADDED" }, "object": obj}).to_string();
            let labels = obj["metadata"]["labels"].clone();
            st.watches.retain(|w| {
                w.resource != resource || !labels_match(&w.label_selector, &labels) || w.tx.send(event.clone()).is_ok()
            });
        }
    }

    pub fn requests(&self) -> Vec<String> {
        self.state.lock().unwrap().requests.clone()
    }
}

impl Drop for FakeApi {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.state.lock().unwrap().watches.clear();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// `!key` and `key=value` terms, comma-separated.
fn labels_match(selector: &str, labels: &Value) -> bool {
    selector.split(',').filter(|t| !t.is_empty()).all(|term| match (term.strip_prefix('!'), term.split_once('=')) {
        (Some(key), _) => labels.get(key).is_none(),
        (None, Some((k, v))) => labels.get(k).and_then(Value::as_str) == Some(v),
        (None, None) => labels.get(term).is_some(),
    })
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = (b[i] == b'%' && i + 2 < b.len()).then(|| u8::from_str_radix(&s[i + 1..i + 3], 16).ok()).flatten();
        match hex {
            Some(byte) => {
                out.push(byte);
                i += 3;
            }
            None => {
                out.push(if b[i] == b'+' { b' ' } else { b[i] });
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn respond(conn: &mut TcpStream, status: &str, body: &str) -> std::io::Result<()> {
    write!(
        conn,
        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}

fn serve(mut conn: TcpStream, state: &Mutex<State>, stop: &AtomicBool) -> std::io::Result<()> {
    conn.set_nonblocking(false)?;
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut request_line = String::new();
    reader.read_line(&mut request_line)?;
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header)? == 0 || header == "\r\n" {
            break;
        }
    }
    let target = request_line.split_whitespace().nth(1).unwrap_or("/").to_string();
    let (path, query) = target.split_once('?').unwrap_or((&target, ""));
    let Some((resource, name)) = resource_of(path) else {
        return respond(&mut conn, "404 Not Found", "{}");
    };
    let watch = query.split('&').any(|p| p == "watch=true" || p == "watch=1");
    let param = |key: &str| query.split('&').find_map(|p| p.strip_prefix(key)).map(percent_decode);
    // Only the node's own name is ever selected by field.
    let field_name = param("fieldSelector=").map(|v| v.trim_start_matches("metadata.name=").to_string());
    let label_selector = param("labelSelector=").unwrap_or_default();
    let verb = match (&name, watch) {
        (Some(_), _) => "get",
        (None, true) => "watch",
        (None, false) => "list",
    };
    let mut st = state.lock().unwrap();
    st.requests.push(format!("{verb} {resource}"));
    let selected = |o: &&Value| {
        field_name.as_deref().is_none_or(|n| o["metadata"]["name"] == n) && labels_match(&label_selector, &o["metadata"]["labels"])
    };
    match verb {
        "get" => {
            let found = st.objects.get(&resource).into_iter().flat_map(|m| m.values()).find(|o| Some(o["metadata"]["name"].as_str().unwrap_or("")) == name.as_deref()).cloned();
            drop(st);
            match found {
                Some(o) => respond(&mut conn, "200 OK", &o.to_string()),
                None => respond(
                    &mut conn,
                    "404 Not Found",
                    &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404}).to_string(),
                ),
            }
        }
        "list" => {
            let items: Vec<&Value> = st.objects.get(&resource).into_iter().flat_map(|m| m.values()).filter(selected).collect();
            let body = json!({"apiVersion": "v1", "kind": list_kind(&resource),
                              "metadata": {"resourceVersion": st.resource_version.to_string()}, "items": items});
            drop(st);
            respond(&mut conn, "200 OK", &body.to_string())
        }
        _ => {
            let (tx, rx) = mpsc::channel();
            st.watches.push(Watch { resource, label_selector, tx });
            drop(st);
            // Close-delimited body: events as JSON lines until the server stops.
            write!(conn, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n")?;
            conn.flush()?;
            while !stop.load(Ordering::Relaxed) {
                match rx.recv_timeout(Duration::from_millis(100)) {
                    Ok(line) => {
                        conn.write_all(format!("{line}\n").as_bytes())?;
                        conn.flush()?;
                    }
                    Err(mpsc::RecvTimeoutError::Timeout) => {}
                    Err(mpsc::RecvTimeoutError::Disconnected) => break,
                }
            }
            Ok(())
        }
    }
}
