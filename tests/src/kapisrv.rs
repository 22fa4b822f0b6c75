//! kapisrv, a small real Kubernetes API server (upstream k8s.io/apiserver on
//! etcd; tests/kapisrv), started for one test: its own state directory and
//! ports, in a network namespace or the root one, killed and removed on drop
//! even when the test fails. Objects go in through kube-rs's client, from a
//! thread inside the same namespace (kapisrv listens on its 127.0.0.1).
//!
//! The binaries come from `$EBPF_PROXY_KAPISRV_BIN` (set by `cargo xtask
//! test`, which runs tests/kapisrv/build.sh), else from build.sh run here
//! (a no-op when `~/.cache/kapisrv` is up to date; minutes when cold).

use std::{
    net::TcpListener,
    path::{Path, PathBuf},
    process::Command,
    sync::{Arc, OnceLock, mpsc},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use futures::StreamExt as _;
use serde_json::Value;

use crate::{cgroup::TestRoot, netns::Netns};

/// tests/kapisrv: build.sh, up.sh, down.sh, restart-with-gap.sh.
pub fn scripts_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("kapisrv")
}

/// kapisrv's etcd key prefix (`etcdPrefix` in tests/kapisrv/main.go): a
/// Service is stored at `{ETCD_PREFIX}/services/NS/NAME`.
pub const ETCD_PREFIX: &str = "/registry-kapisrv";

/// The directory holding the `kapisrv` and `etcd` binaries.
pub fn bin_dir() -> Result<PathBuf> {
    static BIN: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BIN.get_or_init(|| find_or_build().map_err(|e| format!("{e:#}"))).clone().map_err(|e| anyhow::anyhow!(e))
}

fn find_or_build() -> Result<PathBuf> {
    if let Ok(e) = std::env::var("EBPF_PROXY_KAPISRV_ERROR") {
        bail!("kapisrv could not be built by `cargo xtask test`: {e}");
    }
    let dir = match std::env::var_os("EBPF_PROXY_KAPISRV_BIN") {
        Some(d) => PathBuf::from(d),
        None => {
            let build = scripts_dir().join("build.sh");
            let out = Command::new(&build).output().with_context(|| format!("running {}", build.display()))?;
            let stdout = String::from_utf8_lossy(&out.stdout);
            eprint!("{stdout}");
            if !out.status.success() {
                bail!("{} failed ({}): {}", build.display(), out.status, String::from_utf8_lossy(&out.stderr).trim());
            }
            let kapisrv = stdout
                .lines()
                .find_map(|l| l.strip_prefix("kapisrv="))
                .with_context(|| format!("no kapisrv= line in the output of {}", build.display()))?;
            Path::new(kapisrv).parent().context("kapisrv path has no directory")?.to_path_buf()
        }
    };
    for bin in ["kapisrv", "etcd"] {
        anyhow::ensure!(dir.join(bin).exists(), "no {bin} in {} (run tests/kapisrv/build.sh)", dir.display());
    }
    Ok(dir)
}

/// One request for the client thread.
type Job = Box<dyn FnOnce(&tokio::runtime::Runtime, &kube::Client) + Send>;

/// kube-rs's client on a thread of its own, inside kapisrv's namespace, so
/// its connections reach kapisrv's loopback.
struct ClientThread {
    jobs: Option<mpsc::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

impl ClientThread {
    fn start(ns: Option<&Netns>, kubeconfig: PathBuf) -> Result<ClientThread> {
        let (jobs, rx) = mpsc::channel::<Job>();
        let (ready_tx, ready_rx) = mpsc::channel::<Result<()>>();
        let body = move || {
            let setup = (|| -> Result<(tokio::runtime::Runtime, kube::Client)> {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
                let client = rt.block_on(async {
                    let kc = kube::config::Kubeconfig::read_from(&kubeconfig)?;
                    let config = kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?;
                    anyhow::Ok(kube::Client::try_from(config)?)
                })?;
                Ok((rt, client))
            })();
            let (rt, client) = match setup {
                Ok(x) => {
                    let _ = ready_tx.send(Ok(()));
                    x
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            while let Ok(job) = rx.recv() {
                job(&rt, &client);
            }
        };
        let thread = match ns {
            Some(ns) => ns.spawn(body)?,
            None => std::thread::spawn(body),
        };
        ready_rx.recv().context("the kapisrv client thread died")??;
        Ok(ClientThread { jobs: Some(jobs), thread: Some(thread) })
    }

    /// Runs `f` on the client thread and waits for its result.
    fn call<R: Send + 'static>(&self, f: impl FnOnce(&tokio::runtime::Runtime, &kube::Client) -> R + Send + 'static) -> Result<R> {
        let (tx, rx) = mpsc::channel();
        self.jobs
            .as_ref()
            .unwrap()
            .send(Box::new(move |rt, c| {
                let _ = tx.send(f(rt, c));
            }))
            .map_err(|_| anyhow::anyhow!("the kapisrv client thread is gone"))?;
        rx.recv().context("the kapisrv client thread died")
    }
}

impl Drop for ClientThread {
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The collection URL path of an object (`/api/v1/namespaces/NS/services`)
/// and its name, from its `apiVersion`, `kind` and `metadata`. Nodes are the
/// only cluster-scoped kind kapisrv serves.
fn locate(obj: &Value) -> Result<(String, String)> {
    let api_version = obj["apiVersion"].as_str().context("object without apiVersion")?;
    let kind = obj["kind"].as_str().context("object without kind")?;
    let name = obj["metadata"]["name"].as_str().context("object without metadata.name")?.to_string();
    let group = if api_version.contains('/') { format!("/apis/{api_version}") } else { format!("/api/{api_version}") };
    let plural = format!("{}s", kind.to_lowercase());
    let path = if kind == "Node" {
        format!("{group}/{plural}")
    } else {
        let ns = obj["metadata"]["namespace"].as_str().unwrap_or("default");
        format!("{group}/namespaces/{ns}/{plural}")
    };
    Ok((path, name))
}

fn request(method: &str, path: &str, body: Option<&Value>) -> http::Request<Vec<u8>> {
    http::Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json")
        .body(body.map(|b| b.to_string().into_bytes()).unwrap_or_default())
        .expect("a valid request")
}

fn api_code(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(status) => Some(status.code),
        _ => None,
    }
}

/// Creates `obj`, or replaces it if it exists (an unconditional update: the
/// `resourceVersion` is dropped). Returns the object as stored.
async fn apply_one(client: &kube::Client, mut obj: Value) -> Result<Value> {
    let (collection, name) = locate(&obj)?;
    if let Some(meta) = obj["metadata"].as_object_mut() {
        meta.remove("resourceVersion");
    }
    // A connection kept from before a restart may fail once; transport
    // errors are retried for a while, API answers are not.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let result = match client.request::<Value>(request("POST", &collection, Some(&obj))).await {
            Err(e) if api_code(&e) == Some(409) => {
                client.request::<Value>(request("PUT", &format!("{collection}/{name}"), Some(&obj))).await
            }
            other => other,
        };
        match result {
            Ok(stored) => return Ok(stored),
            Err(e) if api_code(&e).is_none() && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => return Err(anyhow::Error::new(e).context(format!("apply {collection}/{name}"))),
        }
    }
}

pub struct Kapisrv {
    dir: tempfile::TempDir,
    netns: Option<String>,
    /// kapisrv's HTTPS port on 127.0.0.1; etcd listens on the next two.
    pub port: u16,
    bin: PathBuf,
    client: Option<ClientThread>,
    /// Its processes sit under the tests' cgroup root like every other.
    _cgroup_root: Arc<TestRoot>,
}

impl Kapisrv {
    /// etcd and kapisrv on 127.0.0.1 inside `ns` (the root namespace if
    /// None), on free ports, with a new state directory; ready when this returns.
    pub fn start(ns: Option<&Netns>) -> Result<Kapisrv> {
        let bin = bin_dir()?;
        let cgroup_root = TestRoot::get()?;
        let dir = tempfile::Builder::new().prefix("kapisrv-").tempdir()?;
        let mut k = Kapisrv { dir, netns: ns.map(|n| n.name.clone()), port: 0, bin, client: None, _cgroup_root: cgroup_root };
        let mut last = None;
        for _ in 0..8 {
            k.port = free_ports(ns)?;
            match k.up() {
                Ok(()) => {
                    k.client = Some(ClientThread::start(ns, k.kubeconfig())?);
                    return Ok(k);
                }
                // Another test took a port between our check and up.sh's.
                Err(e) if format!("{e:#}").contains("already in use") => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap().context("no free ports for kapisrv after 8 tries"))
    }

    /// The state directory (etcd data, certs, logs, `kubeconfig`).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// A kubeconfig for `https://127.0.0.1:PORT`, CA included.
    pub fn kubeconfig(&self) -> PathBuf {
        self.dir().join("kubeconfig")
    }

    fn script(&self, name: &str) -> Command {
        let mut cmd = Command::new(scripts_dir().join(name));
        cmd.env("KAPISRV_BIN", &self.bin);
        cmd
    }

    fn run_script(&self, mut cmd: Command) -> Result<String> {
        let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        if !out.status.success() {
            bail!("{cmd:?} failed ({}): {}{}", out.status, stdout, String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(stdout)
    }

    /// up.sh: starts etcd and kapisrv (again) on the same directory and
    /// ports; etcd's data is kept, so every object is still there.
    pub fn up(&self) -> Result<()> {
        let mut cmd = self.script("up.sh");
        if let Some(ns) = &self.netns {
            cmd.args(["--netns", ns]);
        }
        cmd.args(["--port", &self.port.to_string()]).arg(self.dir());
        self.run_script(cmd).map(|_| ())
    }

    /// down.sh: SIGKILLs etcd and kapisrv (an API outage); `up` brings them back.
    pub fn down(&self) -> Result<()> {
        let mut cmd = self.script("down.sh");
        cmd.arg(self.dir());
        self.run_script(cmd).map(|_| ())
    }

    /// restart-with-gap.sh: restarts kapisrv so that every watch resumed
    /// from an earlier resourceVersion gets 410 Gone and relists. `during`
    /// (a shell command, see [`etcd_delete`]) runs while kapisrv is down.
    pub fn restart_with_gap(&self, during: Option<&str>) -> Result<String> {
        let mut cmd = self.script("restart-with-gap.sh");
        cmd.arg(self.dir());
        if let Some(d) = during {
            cmd.args(["--during", d]);
        }
        self.run_script(cmd)
    }

    /// Creates or replaces each object (a Service, an EndpointSlice, a Node
    /// as JSON); returns them as stored.
    pub fn apply(&self, obj: Value) -> Result<Value> {
        self.client()?.call(move |rt, c| rt.block_on(apply_one(c, obj)))?
    }

    /// `apply` for many objects, `parallel` requests at a time (a large
    /// cluster's contents).
    pub fn apply_all(&self, objs: Vec<Value>, parallel: usize) -> Result<()> {
        self.client()?.call(move |rt, c| {
            rt.block_on(async {
                let mut results = futures::stream::iter(objs.into_iter().map(|o| apply_one(c, o))).buffer_unordered(parallel.max(1));
                while let Some(r) = results.next().await {
                    r?;
                }
                anyhow::Ok(())
            })
        })?
    }

    /// Deletes the object `obj` names (apiVersion, kind, metadata).
    pub fn delete(&self, obj: &Value) -> Result<()> {
        let (collection, name) = locate(obj)?;
        self.client()?.call(move |rt, c| {
            rt.block_on(async {
                c.request::<Value>(request("DELETE", &format!("{collection}/{name}"), None))
                    .await
                    .with_context(|| format!("delete {collection}/{name}"))
            })
        })??;
        Ok(())
    }

    fn client(&self) -> Result<&ClientThread> {
        self.client.as_ref().context("kapisrv's client is not running")
    }

    /// The last `n` lines of kapisrv's log.
    pub fn log_tail(&self, n: usize) -> String {
        let log = std::fs::read_to_string(self.dir().join("kapisrv.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }
}

impl Drop for Kapisrv {
    fn drop(&mut self) {
        drop(self.client.take());
        if std::thread::panicking() {
            eprintln!("kapisrv log ({}), last lines:\n{}", self.dir().display(), self.log_tail(30));
        }
        if let Err(e) = self.down() {
            eprintln!("kapisrv: down.sh failed: {e:#}");
        }
        // The TempDir removes the directory (etcd data, certs, logs).
    }
}

/// A shell command for `restart_with_gap(Some(..))` that deletes one object
/// straight from etcd (`resource` as kapisrv stores it: `services`,
/// `discovery.k8s.io/endpointslices`), so only a relist can tell the
/// clients; it fails if nothing was deleted.
pub fn etcd_delete(resource: &str, namespace: &str, name: &str) -> String {
    format!(
        r#"curl -sf "$KAPISRV_ETCD/v3/kv/deleterange" -d "{{\"key\":\"$(printf %s "$KAPISRV_PREFIX/{resource}/{namespace}/{name}" | base64 -w0)\"}}" | grep -q '"deleted":"1"'"#
    )
}

/// A port P such that P, P+1 and P+2 (kapisrv, etcd client, etcd peer) are
/// free on 127.0.0.1 in `ns`, below the ephemeral range.
fn free_ports(ns: Option<&Netns>) -> Result<u16> {
    let free = |p: u16| -> Result<bool> {
        let check = move || (0..3).all(|i| TcpListener::bind(("127.0.0.1", p + i)).is_ok());
        match ns {
            Some(ns) => ns.run(check),
            None => Ok(check()),
        }
    };
    for _ in 0..100 {
        let p = 20000 + (rand::random::<u16>() % 3000) * 3;
        if free(p)? {
            return Ok(p);
        }
    }
    bail!("no three free ports in a row found for kapisrv")
}
