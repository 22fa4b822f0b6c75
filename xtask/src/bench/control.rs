//! Control plane: the agent (release build) on generated manifests.
//!
//! - Cold sync: time from starting the agent on an empty bpffs to /healthz
//!   200 (the first full sync is in the maps), and the agent's own figure for
//!   that sync (model + reconcile, from its `sync done ... elapsed_us` log).
//! - Agent RSS (VmRSS and the peak VmHWM from /proc) and BPF map memory
//!   (the `memlock` of every map fd in /proc/PID/fdinfo) once synced.
//! - Change to map: a new Service file is renamed into the manifests
//!   directory; the pinned frontend map is polled until its ClusterIP shows.
//!   The agent's log gives the part spent in its sync.
//! - The same through the Kubernetes API source: the agent on `--kubeconfig`
//!   against kapisrv (a real API server on etcd, tests/src/kapisrv.rs)
//!   holding the same cluster; a new Service and its EndpointSlice are
//!   created through the API and the frontend map is polled until the
//!   Service has all its backends.

use std::{
    net::Ipv4Addr,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use proxy_common::*;
use proxy_tests::{
    agent::Agent,
    bench::services::{self, Service, ServiceSet},
    bpffs::Bpffs,
    cgroup::Cgroup,
    kapisrv::Kapisrv,
    netns::Netns,
};
use proxy_user::maps::Maps;

pub const SCALES: [usize; 3] = [1_000, 10_000, 100_000];
/// Cold starts per scale up to 10 000 Services (one at 100 000): the row is
/// the median start's, so one start slowed by the machine (the previous
/// family's teardown, a neighbour) does not stand for the agent.
pub const COLD_STARTS: usize = 3;
/// Before each start, at most this long for the machine to go idle.
pub const QUIET_WAIT: Duration = Duration::from_secs(5);
/// Change-to-map latency is measured on a cluster of this many Services.
pub const CHANGE_SCALES: [usize; 2] = [1_000, 10_000];

#[derive(Clone, Debug)]
pub struct SyncRow {
    pub services: usize,
    pub endpoints: usize,
    /// The median cold start's.
    pub to_healthy: Duration,
    /// Every cold start's, fastest first.
    pub cold_starts: Vec<Duration>,
    pub agent_sync: Option<Duration>,
    /// From the agent's log timestamps: BPF object loaded, manifests read
    /// and parsed, first sync done — each measured from the previous step.
    pub phases: Option<Phases>,
    pub rss_mib: f64,
    pub hwm_mib: f64,
    pub map_mib: f64,
}

#[derive(Clone, Copy, Debug)]
pub struct Phases {
    /// Process start to "dataplane loaded".
    pub load: Duration,
    /// Process start to "manifests read" (the source starts first, beside the load).
    pub read: Duration,
    /// "manifests read" to the first "sync done".
    pub sync: Duration,
    /// "dataplane loaded" to "programs loaded": the verifier, beside the read and the sync.
    pub verify: Duration,
}

/// Where a change comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChangeSource {
    /// A file renamed into `--manifests DIR`.
    Manifests,
    /// Objects created in a Kubernetes API server (kapisrv).
    Api,
}

impl ChangeSource {
    pub fn label(self) -> &'static str {
        match self {
            ChangeSource::Manifests => "manifests",
            ChangeSource::Api => "Kubernetes API (kapisrv)",
        }
    }
}

#[derive(Clone, Debug)]
pub struct ChangeRow {
    pub source: ChangeSource,
    pub services: usize,
    pub samples: usize,
    pub p50: Duration,
    pub p99: Duration,
    pub max: Duration,
    pub agent_sync_p50: Option<Duration>,
    pub agent_sync_p99: Option<Duration>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_start_stands_for_the_scale() {
        let row = |ms: u64, rss_mib: f64| SyncRow {
            services: 10,
            endpoints: 100,
            to_healthy: Duration::from_millis(ms),
            cold_starts: Vec::new(),
            agent_sync: None,
            phases: None,
            rss_mib,
            hwm_mib: 0.0,
            map_mib: 0.0,
        };
        let m = median_start(vec![row(900, 1.0), row(1300, 2.0), row(800, 3.0)]);
        assert_eq!((m.to_healthy, m.rss_mib), (Duration::from_millis(900), 1.0), "the median start's own figures");
        assert_eq!(m.cold_starts, [800, 900, 1300].map(Duration::from_millis));
        let m = median_start(vec![row(700, 1.0), row(600, 2.0)]);
        assert_eq!(m.to_healthy, Duration::from_millis(700), "of two, the slower");
        assert_eq!(median_start(vec![row(500, 1.0)]).cold_starts, [Duration::from_millis(500)]);
    }

    #[test]
    fn log_timestamps_parse() {
        let t = log_time("2026-11-21T12:12:33.678752Z  INFO proxy_user::agent: sync done").unwrap();
        // date -u -d 2026-11-21T12:12:33Z +%s
        assert!((t - 1_795_263_153.678752).abs() < 1e-6, "{t}");
        assert_eq!(log_time("no timestamp here"), None);
    }
}

#[derive(Clone, Debug, Default)]
pub struct Results {
    pub syncs: Vec<SyncRow>,
    pub changes: Vec<ChangeRow>,
    /// Scales whose measurement failed, with the reason: reported, and the
    /// other scales still run.
    pub failed: Vec<(usize, String)>,
}

pub fn run(work: &Path, changes: usize) -> Result<Results> {
    let mut out = Results::default();
    for &scale in &SCALES {
        let dir = work.join(format!("control-{scale}"));
        if let Err(e) = one_scale(&mut out, &dir, scale, changes) {
            eprintln!("      failed at {scale} services: {e:#}");
            out.failed.push((scale, format!("{e:#}")));
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(out)
}

fn one_scale(out: &mut Results, dir: &Path, scale: usize, changes: usize) -> Result<()> {
    let set = ServiceSet::new(scale);
    let _ = std::fs::remove_dir_all(dir);
    set.write_manifests(dir, 1000)?;
    // Written back now, not by the kernel during the timed starts.
    std::process::Command::new("sync").status().context("sync")?;
    let starts = if scale <= 10_000 { COLD_STARTS } else { 1 };
    let mut rows = Vec::new();
    for start in 1..=starts {
        eprintln!("    control: cold sync of {scale} services ({start} of {starts})");
        let ns = Netns::new(&format!("ep{}-bench-cp", proxy_tests::unique_suffix()))?;
        let bpffs = Bpffs::new("bench-cp")?;
        let root = bpffs.path().join("ebpf-proxy");
        // Socket hooks on an empty cgroup of their own, away from every process.
        let cgroup = Cgroup::new("bench-cp")?;
        let cg = cgroup.path().to_string_lossy().into_owned();
        super::wait_for_quiet(QUIET_WAIT)?;
        let started = Instant::now();
        let started_wall = std::time::SystemTime::now();
        let mut agent = Agent::start(&ns, dir, &root, &["--cgroup-root", &cg])?;
        // The agent's own errors (a full map, say) end up in the message.
        agent.wait_healthy_polling(&ns, Duration::from_secs(300), Duration::from_millis(5)).map_err(|e| {
            let last = agent.logs().lines().rev().find(|l| l.contains("ERROR")).unwrap_or("").to_string();
            anyhow::anyhow!("{}; last agent error: {last}", e.to_string().lines().next().unwrap_or(""))
        })?;
        let to_healthy = started.elapsed();
        let pid = pid_of(&root)?;
        // /healthz turns 200 as the sync ends, a moment before its log line.
        let _ = proxy_tests::agent::wait_until("the first sync's log line", Duration::from_secs(5), || {
            Ok(!agent_syncs(&agent.logs()).is_empty())
        });
        let syncs = agent_syncs(&agent.logs());
        let (rss_mib, hwm_mib) = rss(pid)?;
        let row = SyncRow {
            services: scale,
            endpoints: set.services.iter().map(|s| s.endpoints.len()).sum(),
            to_healthy,
            cold_starts: Vec::new(),
            agent_sync: syncs.first().copied(),
            phases: phases(&agent.logs(), started_wall),
            rss_mib,
            hwm_mib,
            map_mib: map_memory(pid)? as f64 / (1024.0 * 1024.0),
        };
        eprintln!(
            "      healthy after {:.2}s (agent sync {:?}), RSS {:.1} MiB (peak {:.1}), maps {:.1} MiB",
            to_healthy.as_secs_f64(),
            row.agent_sync,
            rss_mib,
            hwm_mib,
            row.map_mib
        );
        rows.push(row);
        if start == starts && CHANGE_SCALES.contains(&scale) {
            eprintln!("    control: {changes} changes at {scale} services");
            out.changes.push(changes_to_map(&agent, dir, &root, scale, changes)?);
        }
        drop(agent);
        drop(bpffs);
        drop(cgroup);
        drop(ns);
    }
    out.syncs.push(median_start(rows));
    if CHANGE_SCALES.contains(&scale) {
        eprintln!("    control: {changes} changes through the Kubernetes API at {scale} services");
        out.changes.push(api_changes_to_map(scale, changes)?);
    }
    Ok(())
}

/// The row of the median start (of an even count, the slower middle one),
/// with every start's time beside it.
fn median_start(mut rows: Vec<SyncRow>) -> SyncRow {
    rows.sort_by_key(|r| r.to_healthy);
    let cold_starts = rows.iter().map(|r| r.to_healthy).collect();
    let mut median = rows.swap_remove(rows.len() / 2);
    median.cold_starts = cold_starts;
    median
}

/// The agent on `--kubeconfig` against kapisrv holding `scale` Services;
/// adds `count` Services (each a Service then its EndpointSlice, created
/// through the API) and times each from the Service's create request to its
/// frontend in the pinned map with every backend.
fn api_changes_to_map(scale: usize, count: usize) -> Result<ChangeRow> {
    let set = ServiceSet::new(scale);
    let ns = Netns::new(&format!("ep{}-bench-api", proxy_tests::unique_suffix()))?;
    let api = Kapisrv::start(Some(&ns))?;
    api.apply(serde_json::json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a"}}))?;
    let (svcs, slices): (Vec<_>, Vec<_>) = set.services.iter().map(services::api_objects).unzip();
    let loading = Instant::now();
    api.apply_all(svcs, 16)?;
    api.apply_all(slices, 16)?;
    eprintln!("      {scale} Services and EndpointSlices created in kapisrv in {:.1}s", loading.elapsed().as_secs_f64());
    let kubeconfig = api.kubeconfig();
    let bpffs = Bpffs::new("bench-api")?;
    let root = bpffs.path().join("ebpf-proxy");
    let cgroup = Cgroup::new("bench-api")?;
    let cg = cgroup.path().to_string_lossy().into_owned();
    let mut agent = Agent::start_kube(&ns, &kubeconfig, &root, &["--cgroup-root", &cg])?;
    agent.wait_healthy(&ns, Duration::from_secs(300)).map_err(|e| {
        let last = agent.logs().lines().rev().find(|l| l.contains("ERROR") || l.contains("WARN")).unwrap_or("").to_string();
        anyhow::anyhow!("{}; last agent error: {last}", e.to_string().lines().next().unwrap_or(""))
    })?;
    let maps = Maps::open_pinned(&root)?;
    let syncs_before = agent_syncs(&agent.logs()).len();
    let mut took = Vec::with_capacity(count);
    for k in 0..count {
        let svc = new_service(k);
        let key = frontend_of(&svc);
        let (service, slice) = services::api_objects(&svc);
        let start = Instant::now();
        api.apply(service)?;
        api.apply(slice)?;
        loop {
            if maps.frontends.get(&key, 0).is_ok_and(|e| e.backend_count as usize == svc.endpoints.len()) {
                took.push(start.elapsed());
                break;
            }
            if start.elapsed() > Duration::from_secs(30) {
                anyhow::bail!("API change {k} at {scale} services not in the maps after 30s");
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        std::thread::sleep(Duration::from_millis(150));
    }
    let syncs: Vec<Duration> = agent_syncs(&agent.logs()).into_iter().skip(syncs_before).collect();
    let row = change_row(ChangeSource::Api, scale, took, syncs);
    eprintln!("      API change to map p50 {:?} p99 {:?}; agent sync p50 {:?}", row.p50, row.p99, row.agent_sync_p50);
    Ok(row)
}

/// The `k`th Service a change adds: one TCP port, the probe's endpoints.
fn new_service(k: usize) -> Service {
    Service {
        namespace: "bench-change".into(),
        name: format!("change{k}"),
        cluster_ip: Ipv4Addr::new(10, 110, (k / 250) as u8, (k % 250) as u8 + 1),
        endpoints: services::probe_endpoints(),
        tcp: true,
        udp: false,
        node_port: false,
    }
}

fn frontend_of(svc: &Service) -> FrontendKey {
    FrontendKey {
        addr: Addr::from_v4_octets(svc.cluster_ip.octets()),
        port: services::TCP_PORT.to_be(),
        proto: IPPROTO_TCP,
        scope: SCOPE_INTERNAL,
    }
}

/// Percentiles of the measured latencies and of the agent's own sync times.
fn change_row(source: ChangeSource, scale: usize, mut took: Vec<Duration>, mut syncs: Vec<Duration>) -> ChangeRow {
    syncs.sort();
    took.sort();
    let pick = |v: &[Duration], q: f64| v.get(((v.len().max(1) - 1) as f64 * q).round() as usize).copied();
    ChangeRow {
        source,
        services: scale,
        samples: took.len(),
        p50: pick(&took, 0.5).unwrap_or_default(),
        p99: pick(&took, 0.99).unwrap_or_default(),
        max: took.last().copied().unwrap_or_default(),
        agent_sync_p50: pick(&syncs, 0.5),
        agent_sync_p99: pick(&syncs, 0.99),
    }
}

/// Adds `count` Services one by one and times each from the rename of its
/// file to its frontend in the pinned map.
fn changes_to_map(agent: &Agent, dir: &Path, root: &Path, scale: usize, count: usize) -> Result<ChangeRow> {
    let maps = Maps::open_pinned(root)?;
    let syncs_before = agent_syncs(&agent.logs()).len();
    let mut took = Vec::with_capacity(count);
    for k in 0..count {
        let svc = new_service(k);
        let key = frontend_of(&svc);
        // Written aside and renamed in, so the watcher never reads half a file.
        let tmp = dir.join(format!(".change{k}.tmp"));
        std::fs::write(&tmp, services::manifest(&svc))?;
        let start = Instant::now();
        std::fs::rename(&tmp, dir.join(format!("change{k}.yaml")))?;
        loop {
            if maps.frontends.get(&key, 0).is_ok() {
                took.push(start.elapsed());
                break;
            }
            if start.elapsed() > Duration::from_secs(30) {
                anyhow::bail!("change {k} at {scale} services not in the maps after 30s");
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        // Apart from the next, so each change is its own sync.
        std::thread::sleep(Duration::from_millis(150));
    }
    let syncs: Vec<Duration> = agent_syncs(&agent.logs()).into_iter().skip(syncs_before).collect();
    let row = change_row(ChangeSource::Manifests, scale, took, syncs);
    eprintln!("      change to map p50 {:?} p99 {:?}; agent sync p50 {:?}", row.p50, row.p99, row.agent_sync_p50);
    Ok(row)
}

/// `elapsed_us` of every `sync done` line, in order.
fn agent_syncs(log: &str) -> Vec<Duration> {
    log.lines()
        .filter(|l| l.contains("sync done"))
        .filter_map(|l| {
            let v = l.split("elapsed_us=").nth(1)?;
            let digits: String = v.chars().take_while(char::is_ascii_digit).collect();
            digits.parse().ok().map(Duration::from_micros)
        })
        .collect()
}

/// Seconds since the Unix epoch of a log line's RFC 3339 UTC timestamp
/// (`2026-11-21T12:12:33.678752Z ...`), the agent's default log format.
fn log_time(line: &str) -> Option<f64> {
    let ts = line.split_whitespace().next()?.strip_suffix('Z')?;
    let (date, time) = ts.split_once('T')?;
    let mut d = date.split('-').map(|v| v.parse::<i64>());
    let (y, m, day) = (d.next()?.ok()?, d.next()?.ok()?, d.next()?.ok()?);
    let mut t = time.split(':');
    let (h, min, sec) = (t.next()?.parse::<f64>().ok()?, t.next()?.parse::<f64>().ok()?, t.next()?.parse::<f64>().ok()?);
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(days as f64 * 86_400.0 + h * 3600.0 + min * 60.0 + sec)
}

fn phases(log: &str, started: std::time::SystemTime) -> Option<Phases> {
    let at = |needle: &str| log.lines().find(|l| l.contains(needle)).and_then(log_time);
    let start = started.duration_since(std::time::UNIX_EPOCH).ok()?.as_secs_f64();
    let (loaded, read, synced) = (at("dataplane loaded")?, at("manifests read")?, at("sync done")?);
    let verified = at("programs loaded")?;
    let d = |a: f64, b: f64| Duration::from_secs_f64((b - a).max(0.0));
    Some(Phases { load: d(start, loaded), read: d(start, read), sync: d(read, synced), verify: d(loaded, verified) })
}

/// The agent process: the one whose command line holds its bpffs root.
fn pid_of(root: &Path) -> Result<u32> {
    let want = root.to_string_lossy().into_owned();
    for entry in std::fs::read_dir("/proc")? {
        let entry = entry?;
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else { continue };
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        let is_agent = args.first().is_some_and(|a| a.ends_with(b"ebpf-proxy"));
        if is_agent && args.iter().any(|a| *a == want.as_bytes()) {
            return Ok(pid);
        }
    }
    anyhow::bail!("no ebpf-proxy process with --bpffs-root {want}")
}

/// (VmRSS, VmHWM) in MiB.
fn rss(pid: u32) -> Result<(f64, f64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib = |field: &str| -> Result<f64> {
        let line = status.lines().find(|l| l.starts_with(field)).with_context(|| format!("{field} of {pid}"))?;
        let n: f64 = line.split_whitespace().nth(1).context("value")?.parse()?;
        Ok(n / 1024.0)
    };
    Ok((kib("VmRSS:")?, kib("VmHWM:")?))
}

/// Bytes charged to the BPF maps the agent holds open, each map once.
fn map_memory(pid: u32) -> Result<u64> {
    let mut total = 0;
    let mut seen = std::collections::BTreeSet::new();
    let fds: PathBuf = format!("/proc/{pid}/fdinfo").into();
    for entry in std::fs::read_dir(&fds)? {
        let Ok(info) = std::fs::read_to_string(entry?.path()) else { continue };
        let field = |name: &str| info.lines().find(|l| l.starts_with(name)).and_then(|l| l.split_whitespace().nth(1));
        let Some(id) = field("map_id:") else { continue };
        if !seen.insert(id.to_string()) {
            continue;
        }
        total += field("memlock:").and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    }
    Ok(total)
}
