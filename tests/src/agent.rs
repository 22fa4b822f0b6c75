//! The agent binary started inside a node namespace, killed on drop.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result};

use crate::{cgroup::TestRoot, netns::Netns};

/// The `ebpf-proxy` binary under test: `$EBPF_PROXY_BIN` (set by
/// `cargo xtask test`), else the workspace's debug build.
pub fn agent_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("EBPF_PROXY_BIN") {
        return PathBuf::from(p);
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/debug/ebpf-proxy")
}

pub struct Agent {
    child: Option<Child>,
    /// The hooked cgroup root it runs under (see cgroup.rs).
    _cgroup_root: Option<std::sync::Arc<TestRoot>>,
    pub node: String,
    pub bpffs_root: PathBuf,
    pub healthz: SocketAddr,
    pub metrics: SocketAddr,
    pub log: PathBuf,
}

impl Agent {
    /// `ebpf-proxy run --manifests DIR` in `node` as node `node-a`, logging to a file.
    pub fn start(node: &Netns, manifests: &Path, bpffs_root: &Path, extra: &[&str]) -> Result<Agent> {
        Agent::start_bin(&agent_bin(), node, manifests, bpffs_root, extra)
    }

    /// Like `start`, with the node name the agent runs as.
    pub fn start_as(node: &Netns, node_name: &str, manifests: &Path, bpffs_root: &Path, extra: &[&str]) -> Result<Agent> {
        Agent::launch(&agent_bin(), &[], node, node_name, ("--manifests", manifests), bpffs_root, extra)
    }

    /// Like `start`, with another build of the agent (an upgrade).
    pub fn start_bin(bin: &Path, node: &Netns, manifests: &Path, bpffs_root: &Path, extra: &[&str]) -> Result<Agent> {
        Agent::launch(bin, &[], node, "node-a", ("--manifests", manifests), bpffs_root, extra)
    }

    /// Like `start`, with the agent run through `wrapper` (a command that
    /// execs its arguments, such as `setpriv --bounding-set=...`).
    pub fn start_wrapped(node: &Netns, wrapper: &[&str], manifests: &Path, bpffs_root: &Path, extra: &[&str]) -> Result<Agent> {
        Agent::launch(&agent_bin(), wrapper, node, "node-a", ("--manifests", manifests), bpffs_root, extra)
    }

    /// `ebpf-proxy run --kubeconfig FILE` in `node`.
    pub fn start_kube(node: &Netns, kubeconfig: &Path, bpffs_root: &Path, extra: &[&str]) -> Result<Agent> {
        Agent::launch(&agent_bin(), &[], node, "node-a", ("--kubeconfig", kubeconfig), bpffs_root, extra)
    }

    fn launch(
        bin: &Path,
        wrapper: &[&str],
        node: &Netns,
        node_name: &str,
        source: (&str, &Path),
        bpffs_root: &Path,
        extra: &[&str],
    ) -> Result<Agent> {
        let healthz: SocketAddr = ([127, 0, 0, 1], 10256).into();
        let metrics: SocketAddr = ([127, 0, 0, 1], 10249).into();
        // Next to the bpffs mount (a bpffs holds no regular files).
        let mount = bpffs_root.parent().unwrap_or(bpffs_root);
        let log = PathBuf::from(format!("{}.agent.log", mount.display()));
        let log_file = std::fs::File::create(&log)?;
        let bin_str = bin.to_str().context("agent path is not UTF-8")?;
        // Production's layout unless the test chose a root: the hooks on the
        // root above every pod (here, above the test process itself).
        let cgroup_root = if extra.contains(&"--cgroup-root") { None } else { Some(TestRoot::get()?) };
        let mut cmd = match wrapper.split_first() {
            Some((program, args)) => {
                let mut c = node.command(program);
                c.args(args).arg(bin_str);
                c
            }
            None => node.command(bin_str),
        };
        let child = cmd
            .arg("run")
            .arg(source.0)
            .arg(source.1)
            .arg("--bpffs-root")
            .arg(bpffs_root)
            .arg("--node-name")
            .arg(node_name)
            .arg("--healthz-bind-address")
            .arg(healthz.to_string())
            .arg("--metrics-bind-address")
            .arg(metrics.to_string())
            .args(extra)
            .args(cgroup_root.iter().flat_map(|r| [std::ffi::OsStr::new("--cgroup-root"), r.path.as_os_str()]))
            .env("RUST_LOG", std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()))
            .stdin(Stdio::null())
            .stdout(log_file.try_clone()?)
            .stderr(log_file)
            .spawn()
            .with_context(|| format!("start {}", bin.display()))?;
        Ok(Agent {
            child: Some(child),
            _cgroup_root: cgroup_root,
            node: node.name.clone(),
            bpffs_root: bpffs_root.to_path_buf(),
            healthz,
            metrics,
            log,
        })
    }

    /// The agent's PID (`ip netns exec` execs it, so the child's own).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until /healthz answers 200 (first sync in the maps).
    pub fn wait_healthy(&mut self, node: &Netns, timeout: Duration) -> Result<()> {
        self.wait_healthy_polling(node, timeout, Duration::from_millis(100))
    }

    /// `wait_healthy`, asking every `every` (a benchmark timing the start
    /// asks often, so the answer is not late by up to a whole interval).
    pub fn wait_healthy_polling(&mut self, node: &Netns, timeout: Duration, every: Duration) -> Result<()> {
        let timeout = crate::patience(timeout);
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.as_mut().unwrap().try_wait()? {
                anyhow::bail!("agent exited with {status}:\n{}", self.logs());
            }
            if healthz_status(node, self.healthz)? == Some(200) {
                return Ok(());
            }
            if Instant::now() > deadline {
                anyhow::bail!("agent not healthy after {timeout:?}:\n{}", self.logs());
            }
            std::thread::sleep(every);
        }
    }

    /// How the agent attached its TC programs (`tcx` or `netlink`), as
    /// /healthz reports it.
    pub fn tc_attach(&self, node: &Netns) -> Result<String> {
        let (_, body) = healthz_get(node, self.healthz)?.context("nothing listens on the healthz address")?;
        let json: serde_json::Value = serde_json::from_str(&body).with_context(|| format!("/healthz body: {body}"))?;
        Ok(json["tcAttach"].as_str().with_context(|| format!("no tcAttach in /healthz: {body}"))?.to_string())
    }

    /// GET /metrics: each sample line as `name{labels}` -> value.
    pub fn scrape(&self, node: &Netns) -> Result<std::collections::BTreeMap<String, f64>> {
        let (status, body) = http_get(node, self.metrics, "/metrics")?.context("nothing listens on the metrics address")?;
        anyhow::ensure!(status == 200, "/metrics answered {status}: {body}");
        Ok(body
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .filter_map(|l| l.rsplit_once(' '))
            .filter_map(|(series, value)| Some((series.to_string(), value.parse().ok()?)))
            .collect())
    }

    /// SIGKILL and wait: no chance to clean anything up, like an OOM kill.
    pub fn kill(mut self) -> Result<std::process::ExitStatus> {
        let mut child = self.child.take().unwrap();
        child.kill()?;
        Ok(child.wait()?)
    }

    /// SIGTERM and wait: the dataplane stays.
    pub fn stop(mut self) -> Result<std::process::ExitStatus> {
        let mut child = self.child.take().unwrap();
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), nix::sys::signal::Signal::SIGTERM)?;
        Ok(child.wait()?)
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        // Kept when a test fails, for the post-mortem.
        if !std::thread::panicking() {
            let _ = std::fs::remove_file(&self.log);
        }
    }
}

/// GET /healthz from inside the node namespace; None while nothing listens.
pub fn healthz_status(node: &Netns, addr: SocketAddr) -> Result<Option<u16>> {
    Ok(healthz_get(node, addr)?.map(|(status, _)| status))
}

/// Status and body of GET /healthz, None while nothing listens.
pub fn healthz_get(node: &Netns, addr: SocketAddr) -> Result<Option<(u16, String)>> {
    http_get(node, addr, "/healthz")
}

/// Status and body of GET `path` from inside `node`, None while nothing listens.
pub fn http_get(node: &Netns, addr: SocketAddr, path: &str) -> Result<Option<(u16, String)>> {
    let path = path.to_string();
    node.run(move || {
        let agent = ureq::Agent::config_builder()
            .timeout_global(Some(Duration::from_secs(2)))
            .http_status_as_error(false)
            .build()
            .new_agent();
        match agent.get(format!("http://{addr}{path}")).call() {
            Ok(mut resp) => {
                let status = resp.status().as_u16();
                let body = resp.body_mut().read_to_string().unwrap_or_default();
                Some((status, body))
            }
            Err(_) => None,
        }
    })
}

/// Polls `check` every 50 ms until it returns true; fails after `timeout`
/// with the last error or "condition not met".
pub fn wait_until(what: &str, timeout: Duration, mut check: impl FnMut() -> Result<bool>) -> Result<()> {
    let timeout = crate::patience(timeout);
    let deadline = Instant::now() + timeout;
    let mut last = None;
    while Instant::now() < deadline {
        match check() {
            Ok(true) => return Ok(()),
            Ok(false) => last = None,
            Err(e) => last = Some(e),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    match last {
        Some(e) => Err(e.context(format!("timed out waiting for {what}"))),
        None => anyhow::bail!("timed out after {timeout:?} waiting for {what}"),
    }
}

/// Whether a TC program is attached at ingress of `ifname` in `node`.
pub fn tc_attached(node: &Netns, ifname: &str) -> Result<bool> {
    crate::hooks::attached(node, ifname, aya::programs::TcAttachType::Ingress)
}

/// Whether any TC program is attached at egress of `ifname` in `node`.
pub fn tc_attached_egress(node: &Netns, ifname: &str) -> Result<bool> {
    crate::hooks::attached(node, ifname, aya::programs::TcAttachType::Egress)
}

/// `ebpf-proxy dump <what> -o json` against a bpffs root.
pub fn dump_json(what: &str, bpffs_root: &Path) -> Result<serde_json::Value> {
    let out = std::process::Command::new(agent_bin())
        .args(["dump", what, "-o", "json", "--bpffs-root"])
        .arg(bpffs_root)
        .output()?;
    anyhow::ensure!(out.status.success(), "dump {what}: {}", String::from_utf8_lossy(&out.stderr));
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// `ebpf-proxy trace --from FROM --to TO -o json` against a bpffs root.
pub fn trace_json(bpffs_root: &Path, from: &str, to: &str) -> Result<serde_json::Value> {
    let out = std::process::Command::new(agent_bin())
        .args(["trace", "--from", from, "--to", to, "-o", "json", "--bpffs-root"])
        .arg(bpffs_root)
        .output()?;
    anyhow::ensure!(out.status.success(), "trace {from} -> {to}: {}", String::from_utf8_lossy(&out.stderr));
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// The backends `dump services` shows for a frontend such as "10.96.0.10:80/TCP".
pub fn dumped_backends(bpffs_root: &Path, frontend: &str) -> Result<Vec<String>> {
    let rows = dump_json("services", bpffs_root)?;
    let row = rows
        .as_array()
        .into_iter()
        .flatten()
        .find(|r| r["frontend"] == frontend)
        .with_context(|| format!("no frontend {frontend} in dump"))?;
    let mut addrs: Vec<String> = row["backends"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|b| b["address"].as_str().map(str::to_string))
        .collect();
    addrs.sort();
    Ok(addrs)
}
