//! `ebpf-proxy run`: source -> model -> reconciler -> maps, with the
//! interface watcher and health server beside it. Stopping leaves the
//! dataplane serving; the next agent adopts it.

use std::{collections::BTreeSet, sync::Arc, time::Duration};

use anyhow::{Context, Result};
use ipnet::IpNet;
use tokio::{
    signal::unix::{SignalKind, signal},
    sync::{oneshot, watch},
    time::Instant,
};
use tracing::{error, info, warn};

use crate::{
    attach::{self, Attacher},
    cgroup,
    cli::RunArgs,
    map_sizes::{self, ConntrackSize, MapSizes, ServiceMapSize},
    health::{self, Health},
    healthcheck::{self, HealthCheckServers},
    maps::{self, Maps},
    incremental::{self, Update},
    kernel,
    maglev::MaglevParams,
    metrics::{self, Metrics},
    model::{self, ModelConfig, ObjectError},
    node_addrs::{self, NodeAddrs},
    reconciler::Reconciler,
    root_lock,
    snat_ports,
    source::{Configured, Snapshot, Source, kube::{self as kube_source, KubeSource}, manifests::ManifestsSource},
};

/// After a failed sync, try again this soon.
const RETRY: Duration = Duration::from_secs(1);

pub async fn run(args: RunArgs) -> Result<()> {
    // Before anything is loaded or attached; held until the agent exits.
    let _root_lock = root_lock::acquire(&args.bpffs_root)?;
    let node_name = match &args.node_name {
        Some(n) => n.clone(),
        None => nix::unistd::gethostname()?.to_string_lossy().into_owned(),
    };
    let source = match &args.manifests {
        Some(dir) => Configured::Manifests(ManifestsSource::new(dir)?),
        None => {
            let client = kube_source::client(args.kubeconfig.as_deref()).await?;
            Configured::Kube(KubeSource::new(client, node_name.clone()))
        }
    };
    // Reading the manifests (or listing the API) and the node's addresses
    // start now, beside the verifier's work below: the first sync finds
    // them ready instead of waiting for them after attach.
    let (tx, mut rx) = watch::channel(None);
    let mut source_task = tokio::spawn(source.run(tx));
    let (addrs_tx, mut addrs_rx) = watch::channel(NodeAddrs::default());
    let mut addrs_task = tokio::spawn(node_addrs::watch(addrs_tx));

    let features = kernel::probe()?;
    let snat_ports = snat_ports::for_this_node()?;
    let sizes = MapSizes {
        conntrack: ConntrackSize::from_flags(args.conntrack_max_per_core, args.conntrack_min, map_sizes::cpus())?,
        services: ServiceMapSize::from_flag(args.service_map_entries)?,
    };
    let maglev = MaglevParams::new(args.maglev_seed, args.maglev_table_size)?;
    let options = maps::LoadOptions { root: args.bpffs_root.clone(), ports: snat_ports.clone(), sizes, features, maglev };
    let (ebpf, mut maps) = maps::load_with(&options)?;
    let held = maps.read_contents().context("read pinned maps")?;
    info!(
        bpffs_root = %args.bpffs_root.display(),
        frontends = held.frontends.len(),
        backends = held.backends.len(),
        masquerade_ports = ?snat_ports,
        conntrack = ?sizes.conntrack,
        service_map_entries = maps.service_capacity[crate::capacity::ServiceMap::Frontends as usize],
        lb_algorithm = args.lb_algorithm.name(),
        maglev_table_size = maglev.size,
        "dataplane loaded (pinned maps adopted)"
    );
    let nothing_held = held == maps::Contents::default();
    let mut reconciler = Reconciler::adopt(held).within(maps.service_capacity).with_maglev(maglev);

    let health = Health::default();
    let mut health_checks = HealthCheckServers::new(health.clone());
    let metrics = Metrics::new(&args.bpffs_root);
    let config = ModelConfig {
        node_name,
        node_port_addresses: args.node_port_addresses.clone(),
        detect_local: !args.cluster_cidr.is_empty(),
        masquerade_all: args.masquerade_all,
        localhost_node_ports: args.localhost_nodeports,
        service_cidrs: args.service_cidr.clone(),
        lb_algorithm: args.lb_algorithm,
        ..Default::default()
    };
    let mut syncer = Syncer {
        config,
        model: incremental::Model::default(),
        maps_behind: true,
        last_errors: Vec::new(),
        service_cidrs: None,
        health,
        metrics,
        started: chrono::Utc::now(),
    };

    // Every program through the verifier before any is attached: a kernel
    // that refuses one leaves the node's attachments as they were, never
    // half-attached. The first sync fills the maps meanwhile, if the first
    // snapshot and the node's addresses come in time.
    let cgroup_root = cgroup::resolve_root_or_warn(args.cgroup_root.as_deref())?;
    let hooks = cgroup_root.is_some();
    let xdp = crate::xdp::XdpSettings::from_flags(&args.xdp_devices, args.xdp_mode, args.devices.as_deref())?;
    let load_xdp = xdp.is_some();
    let (verified_tx, verifying) = oneshot::channel();
    std::thread::Builder::new().name("verifier".into()).spawn(move || {
        // The verifier's CPU comes after the reading and the first sync's
        // (on a node with few cores they would otherwise share it, and the
        // first sync is what /healthz waits for): it takes what they leave.
        // In the agent's container cgroup, nice ranks it among the agent's
        // own threads only, not against other pods. The verifier's worker
        // threads inherit it.
        lower_this_threads_priority();
        let verified = (|| -> Result<aya::Ebpf> {
            let mut ebpf = ebpf;
            let mut programs: Vec<&str> = attach::HOOKS.iter().flat_map(|(program, _, _)| maps::tc_programs(program)).collect();
            if hooks {
                programs.extend(cgroup::SOCK_PROGRAMS);
            }
            if load_xdp {
                programs.extend(crate::xdp::PROGRAMS);
            }
            crate::verifier::verify_all(&mut ebpf, &programs)?;
            for (program, _, _) in attach::HOOKS {
                maps::install_tail_calls(&mut ebpf, program)?;
            }
            if load_xdp {
                crate::xdp::install(&mut ebpf)?;
            }
            Ok(ebpf)
        })();
        let _ = verified_tx.send(verified);
    })?;
    let attachment = Attachment {
        cgroup_root,
        bpffs_root: args.bpffs_root.clone(),
        sysctl_root: args.sysctl_root.clone(),
        options,
        devices: args.devices.clone(),
        xdp,
        tc_attach: args.tc_attach,
        features,
    };
    let verified = async move { verifying.await.context("the verifier thread stopped")? };
    let cluster_cidr = &args.cluster_cidr;
    let first_sync = async |inputs: Option<(Arc<Snapshot>, NodeAddrs)>,
                            syncer: &mut Syncer,
                            reconciler: &mut Reconciler,
                            maps: &mut Maps,
                            health_checks: &mut HealthCheckServers| {
        let (snap, addrs) = inputs?;
        syncer.set_node_addresses(&addrs, cluster_cidr, maps);
        syncer.snapshot_arrived(Some(&snap));
        let outcome = syncer.sync_and_serve(&snap, reconciler, maps, health_checks).await;
        Some((snap, outcome))
    };
    let mut first = None;
    let (mode, mut attach_task) = if nothing_held {
        // Nothing held: the programs would meet only what this first sync
        // writes, in the order every later sync writes it (backends and
        // slots before the frontends that name them). So they attach as
        // soon as they are verified, beside the sync (this task blocks in
        // it; the attach runs on a worker thread), not after it.
        let mut attaching = tokio::spawn(async move { attachment.attach(verified.await?).await });
        tokio::select! {
            attached = &mut attaching => attached??,
            inputs = first_inputs(&mut rx, &mut addrs_rx) => {
                first = first_sync(inputs, &mut syncer, &mut reconciler, &mut maps, &mut health_checks).await;
                attaching.await??
            }
        }
    } else {
        // An adopted dataplane: the programs now attached keep serving
        // until the maps hold this agent's first sync.
        let mut verified = std::pin::pin!(verified);
        let ebpf = tokio::select! {
            ebpf = &mut verified => ebpf?,
            inputs = first_inputs(&mut rx, &mut addrs_rx) => {
                first = first_sync(inputs, &mut syncer, &mut reconciler, &mut maps, &mut health_checks).await;
                verified.await?
            }
        };
        attachment.attach(ebpf).await?
    };

    syncer.health.set_tc_attach(mode.name());
    health::serve(args.healthz_bind_address, syncer.health.clone()).await?;
    metrics::serve(args.metrics_bind_address, syncer.metrics.clone()).await?;

    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;

    // The latest snapshot, and whether it (or the node) changed since the last good sync.
    let mut latest: Option<Arc<Snapshot>> = None;
    let mut pending = false;
    // The first sync waits for the node's addresses: syncing without them
    // would take an adopted dataplane's NodePorts away for a moment.
    let mut addrs_listed = false;
    let mut retry_at: Option<Instant> = None;
    let unsynced = if first.is_none() { rx.borrow_and_update().clone() } else { None };
    if let Some((snap, outcome)) = first {
        latest = Some(snap);
        addrs_listed = true;
        pending = outcome != Outcome::Done;
        retry_at = retry_after(outcome);
    } else if let Some(snap) = unsynced {
        // The first snapshot came, but not yet the addresses, when the
        // verifier finished: waiting for them marked it seen.
        syncer.snapshot_arrived(Some(&snap));
        latest = Some(snap);
        pending = true;
    }
    loop {
        tokio::select! {
            changed = rx.changed() => {
                if changed.is_err() {
                    let res = (&mut source_task).await?;
                    return res.context("source stopped");
                }
                latest = rx.borrow_and_update().clone();
                syncer.snapshot_arrived(latest.as_deref());
                pending = true;
                retry_at = None;
            }
            changed = addrs_rx.changed() => {
                if changed.is_err() {
                    return Err((&mut addrs_task).await?.expect_err("address watcher stopped")).context("node addresses");
                }
                let addrs = addrs_rx.borrow_and_update().clone();
                syncer.set_node_addresses(&addrs, &args.cluster_cidr, &mut maps);
                addrs_listed = true;
                syncer.health.queued_update();
                pending = true;
                retry_at = None;
            }
            _ = async { tokio::time::sleep_until(retry_at.unwrap()).await }, if retry_at.is_some() => {
                retry_at = None;
            }
            res = &mut attach_task => {
                return Err(res?.expect_err("interface watcher stopped")).context("interface watcher");
            }
            _ = sigterm.recv() => break,
            _ = sigint.recv() => break,
        }
        if let (true, true, Some(snap)) = (pending, addrs_listed, &latest) {
            let outcome = syncer.sync_and_serve(snap, &mut reconciler, &mut maps, &mut health_checks).await;
            pending = outcome != Outcome::Done;
            retry_at = retry_after(outcome);
        }
    }
    info!("stopping: programs and pinned maps stay in place, traffic keeps flowing (`ebpf-proxy cleanup` removes them)");
    Ok(())
}

/// What attaching the verified programs takes.
struct Attachment {
    cgroup_root: Option<std::path::PathBuf>,
    bpffs_root: std::path::PathBuf,
    sysctl_root: std::path::PathBuf,
    options: maps::LoadOptions,
    devices: Option<Vec<String>>,
    xdp: Option<crate::xdp::XdpSettings>,
    tc_attach: crate::cli::TcAttachMode,
    features: kernel::Features,
}

impl Attachment {
    /// The socket hooks, then the TC (and XDP) programs on every interface;
    /// returns once all are attached, with the task that follows
    /// interfaces coming and going.
    async fn attach(self, mut ebpf: aya::Ebpf) -> Result<(attach::AttachMode, tokio::task::JoinHandle<Result<()>>)> {
        let mode = attach::choose_mode(&mut ebpf, self.tc_attach)?;
        info!(
            tc_attach = mode.name(),
            coarse_clock = self.features.coarse_clock,
            sock_set_retval = self.features.sock_set_retval,
            "kernel probed, programs loaded"
        );
        if let Some(root) = &self.cgroup_root {
            cgroup::attach(&mut ebpf, &self.bpffs_root, root)?;
        }
        crate::sysctl::accept_local_on_loopback_or_warn(&self.sysctl_root);
        let attacher = Attacher::new(ebpf, self.options, mode, self.devices, self.xdp)?;
        let (ready_tx, ready_rx) = oneshot::channel();
        let task = tokio::spawn(attacher.run(ready_tx));
        if ready_rx.await.is_err() {
            return Err(task.await?.expect_err("attacher stopped before it was ready"));
        }
        Ok((mode, task))
    }
}

/// The first snapshot and the node's first list of addresses, once both
/// are in (`None`: a source stopped; the main loop reports why).
async fn first_inputs(
    rx: &mut watch::Receiver<Option<Arc<Snapshot>>>,
    addrs_rx: &mut watch::Receiver<NodeAddrs>,
) -> Option<(Arc<Snapshot>, NodeAddrs)> {
    let snap = rx.wait_for(Option::is_some).await.ok()?.clone()?;
    addrs_rx.changed().await.ok()?;
    let addrs = addrs_rx.borrow_and_update().clone();
    Some((snap, addrs))
}

/// Nice 10 for the calling thread only (Linux's nice is per thread); a
/// thread that exits afterwards needs no way back, which would take
/// CAP_SYS_NICE.
fn lower_this_threads_priority() {
    // SAFETY: gettid and setpriority take integers and touch no memory of ours.
    let done = unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, 10) } == 0;
    if !done {
        tracing::debug!("could not lower the verifier thread's priority: {}", std::io::Error::last_os_error());
    }
}

/// When to sync again after a sync that went this way.
fn retry_after(outcome: Outcome) -> Option<Instant> {
    match outcome {
        Outcome::Failed => Some(Instant::now() + RETRY),
        // Room the sync freed is counted from the next one: now.
        Outcome::Again => Some(Instant::now()),
        Outcome::Done => None,
    }
}

/// How a sync went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Done,
    /// Done, but it removed entries while Services waited for room in a
    /// map: sync again, so they are admitted now that the room is there.
    Again,
    /// Retry in a moment.
    Failed,
}

struct Syncer {
    config: ModelConfig,
    model: incremental::Model,
    /// The maps may differ from the model by more than the next update's
    /// touched keys (first sync, or the last one failed): sync everything.
    maps_behind: bool,
    last_errors: Vec<ObjectError>,
    /// The service CIDRs last logged.
    service_cidrs: Option<BTreeSet<IpNet>>,
    health: Health,
    metrics: Metrics,
    /// Like kube-proxy, changes older than the agent's start are not
    /// counted in the programming latency: it would measure the downtime.
    started: chrono::DateTime<chrono::Utc>,
}

impl Syncer {
    /// A new snapshot is waiting to be synced: /healthz counts the change
    /// as pending and follows the node's eligibility at once.
    fn snapshot_arrived(&self, snap: Option<&Snapshot>) {
        if let Some(snap) = snap {
            self.health.set_node_eligible(model::node::eligible(snap.node.as_ref()));
        }
        self.health.queued_update();
    }

    /// The node's addresses, for the model and the masquerade sources.
    fn set_node_addresses(&mut self, addrs: &NodeAddrs, cluster_cidrs: &[IpNet], maps: &mut Maps) {
        info!(addresses = ?addrs.all(), "node addresses");
        self.config.node_addresses = addrs.all();
        if let Err(e) = maps.write_node_config(&addrs.snat_sources(), cluster_cidrs) {
            error!("writing node settings to the maps failed: {e:#}");
        }
    }

    /// One pass, then the healthCheckNodePorts it wants served.
    async fn sync_and_serve(
        &mut self,
        snap: &Snapshot,
        reconciler: &mut Reconciler,
        maps: &mut Maps,
        health_checks: &mut HealthCheckServers,
    ) -> Outcome {
        let outcome = self.sync(snap, reconciler, maps);
        if outcome != Outcome::Failed {
            health_checks.sync(&self.model.desired().health_checks, healthcheck::listen_addresses(&self.config)).await;
        }
        outcome
    }

    /// One pass.
    fn sync(&mut self, snap: &Snapshot, reconciler: &mut Reconciler, maps: &mut Maps) -> Outcome {
        let start = std::time::Instant::now();
        // Services are admitted against what the maps hold (capacity.rs).
        let update = self.model.update_within(snap, &self.config, &*reconciler);
        let errors = self.model.errors();
        // Each bad object is reported when it appears, not on every sync.
        let new: Vec<&ObjectError> = errors.iter().filter(|e| !self.last_errors.contains(e)).collect();
        for e in &new {
            warn!("skipped {e}");
        }
        self.metrics.skipped(&errors, &new);
        self.last_errors = errors;
        let desired = self.model.desired();
        if self.service_cidrs.as_ref() != Some(&desired.service_cidrs) {
            let from = if snap.service_cidrs.is_empty() { "--service-cidr" } else { "ServiceCIDR objects" };
            info!(cidrs = ?desired.service_cidrs, from, "service CIDRs (unallocated addresses in them are dropped)");
            self.service_cidrs = Some(desired.service_cidrs.clone());
        }
        let full = !matches!(update, Update::Touched(_)) || self.maps_behind;
        let result = match update {
            Update::Touched(touched) if !self.maps_behind => reconciler.sync_touched(desired, &touched, maps),
            _ => reconciler.sync(desired, maps),
        };
        if full {
            release_freed_memory();
        }
        self.maps_behind = result.is_err();
        if result.is_ok() {
            let now = chrono::Utc::now();
            for t in self.model.take_trigger_times().into_iter().filter(|t| *t > self.started) {
                self.metrics.programmed_after((now - t).num_milliseconds().max(0) as f64 / 1000.0);
            }
        }
        let desired = self.model.desired();
        match result {
            Ok(stats) => {
                self.health.sync_succeeded();
                self.metrics.sync_succeeded(
                    start.elapsed().as_secs_f64(),
                    desired.backend_sets.len(),
                    stats.frontends,
                    stats.backends,
                );
                info!(
                    services = desired.backend_sets.len(),
                    frontends = stats.frontends,
                    backends = stats.backends,
                    writes = stats.writes,
                    deletes = stats.deletes,
                    affinity_purged = stats.affinity_purged,
                    skipped_objects = self.last_errors.len(),
                    waiting_for_room = self.model.refused(),
                    elapsed_us = start.elapsed().as_micros() as u64,
                    "sync done"
                );
                if self.model.refused() > 0 && stats.deletes > 0 { Outcome::Again } else { Outcome::Done }
            }
            Err(e) => {
                self.health.sync_failed();
                self.metrics.sync_failed();
                error!("sync failed, retrying in {RETRY:?}: {e:#}");
                if let Some(full) = maps::full_map(&e) {
                    // Admission counted wrong (a map holds what the agent
                    // does not know of): admit every Service again, against
                    // what the maps hold now.
                    warn!(map = full.map, capacity = full.capacity, "a map is full: every Service is admitted again at the next sync");
                    self.model = incremental::Model::default();
                }
                Outcome::Failed
            }
        }
    }
}

/// Hands the heap that reading and building everything freed back to the
/// kernel: glibc keeps freed memory in its arenas (one per thread that
/// parsed manifests), where it would count as the agent's RSS for good.
fn release_freed_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only returns unused pages of the allocator's arenas.
    unsafe {
        libc::malloc_trim(0);
    }
}
