//! `--manifests DIR`: every *.yaml, *.yml and *.json file under DIR, applied
//! live as files change. A file that does not parse is reported and its last
//! good version keeps being served, so a typo never drops a Service. Objects
//! kube-proxy's label selector leaves out are left out here too. Services,
//! EndpointSlices, a Node and ServiceCIDRs are read; other kinds are ignored.

use std::{
    collections::{BTreeMap, BTreeSet},
    hash::{Hash, Hasher},
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use anyhow::{Context, Result};
use notify::{
    EventKind, RecursiveMode, Watcher,
    event::{AccessKind, AccessMode, CreateKind, ModifyKind, RemoveKind},
};
use rayon::prelude::*;
use tokio::sync::mpsc;
use tracing::{info, warn};

use super::{Snapshot, SnapshotSender, Source, kube};
use crate::manifest::{self, ManifestError, Object};

/// A rescan even without events, in case the filesystem drops one.
const RESCAN: Duration = Duration::from_secs(30);

pub struct ManifestsSource {
    dir: PathBuf,
}

impl ManifestsSource {
    pub fn new(dir: &Path) -> Result<Self> {
        anyhow::ensure!(dir.is_dir(), "--manifests {}: not a directory", dir.display());
        Ok(ManifestsSource { dir: dir.to_path_buf() })
    }
}

/// One file as last read: a hash of its text (to tell a real change from a
/// rewrite of the same bytes, without keeping the text), and its objects
/// from the last time it parsed.
struct FileState {
    hash: u64,
    objects: Vec<Object>,
    error: Option<ManifestError>,
}

/// What reading one file gave.
enum Read {
    Gone,
    Unreadable(std::io::Error),
    Unchanged,
    Parsed(u64, Result<Vec<Object>, ManifestError>),
}

#[derive(Default)]
pub struct DirState {
    files: BTreeMap<PathBuf, FileState>,
}

impl DirState {
    /// Re-reads the whole directory; returns whether the served objects changed.
    pub fn rescan(&mut self, dir: &Path) -> bool {
        let found = manifest_files(dir);
        let mut paths: BTreeSet<PathBuf> = self.files.keys().cloned().collect();
        paths.extend(found);
        self.reload(paths.into_iter().collect())
    }

    /// Re-reads the given files (and forgets those that are gone); returns
    /// whether the served objects changed. Files are read and parsed in
    /// parallel, and applied in path order.
    pub fn reload(&mut self, paths: Vec<PathBuf>) -> bool {
        let known: Vec<Option<u64>> = paths.iter().map(|p| self.files.get(p).map(|f| f.hash)).collect();
        let reads = read_all(&paths, &known);
        let mut changed = false;
        for (path, read) in paths.into_iter().zip(reads) {
            match read {
                Read::Unchanged => {}
                Read::Gone => changed |= self.files.remove(&path).is_some(),
                Read::Unreadable(e) => {
                    // Unreadable for now: keep what we had.
                    warn!(path = %path.display(), error = %e, "cannot read manifest; keeping its last good version");
                }
                Read::Parsed(hash, Ok(objects)) => {
                    if self.files.get(&path).is_some_and(|f| f.error.is_some()) {
                        info!(path = %path.display(), "manifest fixed");
                    }
                    self.files.insert(path, FileState { hash, objects, error: None });
                    changed = true;
                }
                Read::Parsed(hash, Err(e)) => {
                    warn!("bad manifest {e}; ignored until fixed, its last good version (if any) is still served");
                    let objects = self.files.remove(&path).map(|f| f.objects).unwrap_or_default();
                    self.files.insert(path, FileState { hash, objects, error: Some(e) });
                }
            }
        }
        changed
    }

    /// Whether any file read so far lies under `dir`.
    fn has_files_under(&self, dir: &Path) -> bool {
        self.files.range(dir.to_path_buf()..).next().is_some_and(|(p, _)| p.starts_with(dir))
    }

    pub fn errors(&self) -> Vec<&ManifestError> {
        self.files.values().filter_map(|f| f.error.as_ref()).collect()
    }

    pub fn snapshot(&self) -> Snapshot {
        let mut snap = Snapshot::default();
        for obj in self.files.values().flat_map(|f| f.objects.iter()) {
            snap.add(obj);
        }
        snap
    }
}

/// A file's objects as this source serves them: those the API source's label
/// selector would let through (`kube::is_ours`). The others (another proxy's
/// Services, headless Services' slices) are left out silently, as the API
/// server leaves them out of the watches; a label added later takes the
/// object away at the file's next read, and removing it brings it back.
pub fn ours(mut objects: Vec<Object>) -> Vec<Object> {
    objects.retain(|obj| match obj {
        Object::Service(s) => kube::is_ours(s.metadata.labels.as_ref()),
        Object::EndpointSlice(s) => s.ours,
        // The selector is for Services and slices; the API source lists these unfiltered.
        Object::Node(_) | Object::ServiceCIDR(_) => true,
    });
    objects
}

fn content_hash(bytes: &[u8]) -> u64 {
    let mut h = std::hash::DefaultHasher::new();
    bytes.hash(&mut h);
    h.finish()
}

/// Reads, hashes and (when the hash differs from `known`) parses each file,
/// on every CPU: parsing YAML is the bulk of a cold start.
fn read_all(paths: &[PathBuf], known: &[Option<u64>]) -> Vec<Read> {
    let read_one = |path: &PathBuf, known: Option<u64>| match std::fs::read(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Read::Gone,
        Err(e) => Read::Unreadable(e),
        Ok(bytes) => {
            let hash = content_hash(&bytes);
            if known == Some(hash) {
                return Read::Unchanged;
            }
            let parsed = match std::str::from_utf8(&bytes) {
                Ok(text) => manifest::parse(path, text).map(ours),
                Err(e) => Err(ManifestError { path: path.display().to_string(), line: 0, reason: format!("not UTF-8: {e}") }),
            };
            Read::Parsed(hash, parsed)
        }
    };
    // A file per task: idle CPUs steal the next file, so files of unequal
    // size (or a CPU busy elsewhere) leave none idle.
    paths.par_iter().zip(known).with_max_len(1).map(|(path, known)| read_one(path, *known)).collect()
}

fn is_manifest(path: &Path) -> bool {
    let hidden = path.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with('.'));
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    !hidden && matches!(ext, "yaml" | "yml" | "json")
}

/// Sorted, so the same directory always reads the same way.
fn manifest_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = walkdir::WalkDir::new(dir)
        .follow_links(true)
        .into_iter()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_type().is_file())
        .map(|e| e.into_path())
        .filter(|p| is_manifest(p))
        .collect();
    files.sort();
    files
}

/// What one filesystem event asks for.
#[derive(Debug, PartialEq, Eq)]
enum Todo {
    Nothing,
    /// Re-read these files (they may be gone).
    Files(Vec<PathBuf>),
    /// A directory appeared, went or moved: re-read everything.
    Rescan,
}

/// Files are re-read when complete: closed after writing, or renamed in
/// (atomic). A file being written is not read half-way, so there is no need
/// for a debounce window.
fn todo(kind: &EventKind, paths: Vec<PathBuf>, state: &DirState) -> Todo {
    let dir_event = |p: &PathBuf| p.is_dir() || state.has_files_under(p);
    match kind {
        EventKind::Create(CreateKind::Folder) | EventKind::Remove(RemoveKind::Folder) => Todo::Rescan,
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => Todo::Files(paths.into_iter().filter(|p| is_manifest(p)).collect()),
        EventKind::Modify(ModifyKind::Name(_)) | EventKind::Remove(_) | EventKind::Any | EventKind::Other => {
            if paths.iter().any(|p| !is_manifest(p) && dir_event(p)) {
                Todo::Rescan
            } else {
                Todo::Files(paths.into_iter().filter(|p| is_manifest(p)).collect())
            }
        }
        _ => Todo::Nothing,
    }
}

impl Source for ManifestsSource {
    async fn run(self, updates: SnapshotSender) -> Result<()> {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let mut watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
            let _ = tx.send(res);
        })
        .context("start watching the manifests directory")?;
        watcher.watch(&self.dir, RecursiveMode::Recursive).with_context(|| format!("watch {}", self.dir.display()))?;

        let mut state = DirState::default();
        state.rescan(&self.dir);
        info!(dir = %self.dir.display(), files = state.files.len(), errors = state.errors().len(), "manifests read");
        updates.send_replace(Some(Arc::new(state.snapshot())));

        let mut tick = tokio::time::interval(RESCAN);
        tick.tick().await;
        loop {
            let first = tokio::select! {
                ev = rx.recv() => match ev {
                    Some(ev) => Some(ev),
                    None => anyhow::bail!("manifests watcher stopped"),
                },
                _ = tick.tick() => None,
                _ = updates.closed() => return Ok(()),
            };
            let changed = match first {
                None => state.rescan(&self.dir),
                Some(first) => {
                    // Everything already queued is applied together, as one snapshot.
                    let mut rescan = false;
                    let mut files = BTreeSet::new();
                    let mut next = Some(first);
                    while let Some(ev) = next {
                        match ev {
                            // The kernel's event queue overflowed: events were lost.
                            Ok(ev) if ev.need_rescan() => rescan = true,
                            Ok(ev) => match todo(&ev.kind, ev.paths, &state) {
                                Todo::Nothing => {}
                                Todo::Files(f) => files.extend(f),
                                Todo::Rescan => rescan = true,
                            },
                            Err(e) => {
                                warn!("manifests watcher: {e}; re-reading the directory");
                                rescan = true;
                            }
                        }
                        next = rx.try_recv().ok();
                    }
                    if rescan { state.rescan(&self.dir) } else { state.reload(files.into_iter().collect()) }
                }
            };
            if changed {
                updates.send_replace(Some(Arc::new(state.snapshot())));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) {
        std::fs::write(dir.join(name), text).unwrap();
    }

    const SVC: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: NAME, namespace: default}\nspec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}\n";

    #[test]
    fn bad_file_keeps_its_last_good_version_and_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "a.yaml", &SVC.replace("NAME", "a"));
        write(dir.path(), "b.yml", &SVC.replace("NAME", "b"));
        write(dir.path(), "notes.txt", "not a manifest");
        let mut st = DirState::default();
        assert!(st.rescan(dir.path()));
        assert_eq!(st.snapshot().services.len(), 2);

        // b breaks: reported, still served as it was.
        write(dir.path(), "b.yml", "kind: Service\nspec: [oops\n");
        assert!(!st.rescan(dir.path()));
        assert_eq!(st.errors().len(), 1);
        assert!(st.errors()[0].path.ends_with("b.yml"));
        assert_eq!(st.snapshot().services.len(), 2);

        // A new bad file serves nothing and hides nothing.
        write(dir.path(), "c.yaml", "apiVersion: v1\nkind: Service\nspec: {ports: [{port: x}]}\n");
        st.rescan(dir.path());
        assert_eq!(st.errors().len(), 2);
        assert_eq!(st.snapshot().services.len(), 2);

        // Fixed and deleted files apply.
        write(dir.path(), "b.yml", &SVC.replace("NAME", "b2"));
        std::fs::remove_file(dir.path().join("a.yaml")).unwrap();
        assert!(st.rescan(dir.path()));
        let names: Vec<_> = st.snapshot().services.iter().map(|s| s.metadata.name.clone().unwrap()).collect();
        assert_eq!(names, vec!["b2".to_string()]);

        // The same bytes again change nothing.
        write(dir.path(), "b.yml", &SVC.replace("NAME", "b2"));
        assert!(!st.reload(vec![dir.path().join("b.yml")]));
    }

    #[test]
    fn service_cidr_files_are_served_and_followed() {
        let dir = tempfile::tempdir().unwrap();
        let cidr = |cidrs: &str| format!("apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {{name: kubernetes}}\nspec: {{cidrs: {cidrs}}}\n");
        let config = crate::model::ModelConfig { service_cidrs: vec!["172.30.0.0/16".parse().unwrap()], ..Default::default() };
        let effective = |st: &DirState| {
            let (state, errors) = crate::model::build(&st.snapshot(), &config);
            (state.service_cidrs.iter().map(ToString::to_string).collect::<Vec<_>>(), errors.iter().map(ToString::to_string).collect::<Vec<_>>())
        };
        write(dir.path(), "web.yaml", &SVC.replace("NAME", "web"));
        let mut st = DirState::default();
        st.rescan(dir.path());
        assert_eq!(effective(&st), (vec!["172.30.0.0/16".to_string()], vec![]), "no ServiceCIDR: the flag");

        // With the Service's own file or apart, a ServiceCIDR replaces the flag.
        write(dir.path(), "cidrs.yaml", &cidr("[10.96.0.0/16, 'fd00:10:96::/112']"));
        assert!(st.rescan(dir.path()));
        assert_eq!(st.snapshot().services.len(), 1);
        assert_eq!(effective(&st).0, ["10.96.0.0/16", "fd00:10:96::/112"]);
        // A bad entry is reported with the object and skipped.
        write(dir.path(), "cidrs.yaml", &cidr("[10.96.0.0/16, 10.96.0.0/40]"));
        assert!(st.rescan(dir.path()));
        let (cidrs, errors) = effective(&st);
        assert_eq!(cidrs, ["10.96.0.0/16"]);
        assert_eq!(errors, ["servicecidr kubernetes: spec.cidrs[1]: invalid CIDR \"10.96.0.0/40\"; skipped"]);
        // A file that does not parse keeps its last good version.
        write(dir.path(), "cidrs.yaml", &cidr("10.96.0.0/16"));
        assert!(!st.rescan(dir.path()));
        assert_eq!(st.errors().len(), 1);
        assert_eq!(effective(&st).0, ["10.96.0.0/16"]);
        // Removed: the flag again.
        std::fs::remove_file(dir.path().join("cidrs.yaml")).unwrap();
        assert!(st.rescan(dir.path()));
        assert_eq!(effective(&st).0, ["172.30.0.0/16"]);
    }

    #[test]
    fn events_name_the_files_to_read() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "a.yaml", &SVC.replace("NAME", "a"));
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        write(&dir.path().join("sub"), "b.yaml", &SVC.replace("NAME", "b"));
        let mut st = DirState::default();
        st.rescan(dir.path());
        let a = dir.path().join("a.yaml");
        let tmp = dir.path().join(".a.yaml.tmp");
        let closed = EventKind::Access(AccessKind::Close(AccessMode::Write));
        let renamed = EventKind::Modify(ModifyKind::Name(notify::event::RenameMode::To));
        // A file closed after writing, or renamed in: that file.
        assert_eq!(todo(&closed, vec![a.clone()], &st), Todo::Files(vec![a.clone()]));
        assert_eq!(todo(&renamed, vec![a.clone()], &st), Todo::Files(vec![a.clone()]));
        // Writes still under way, and temporary files, are not read.
        assert_eq!(todo(&EventKind::Modify(ModifyKind::Data(notify::event::DataChange::Any)), vec![a.clone()], &st), Todo::Nothing);
        assert_eq!(todo(&closed, vec![tmp.clone()], &st), Todo::Files(vec![]));
        assert_eq!(todo(&EventKind::Modify(ModifyKind::Name(notify::event::RenameMode::From)), vec![tmp], &st), Todo::Files(vec![]));
        // A directory that moves or goes: everything.
        let sub = dir.path().join("sub");
        assert_eq!(todo(&renamed, vec![sub.clone()], &st), Todo::Rescan);
        std::fs::remove_dir_all(&sub).unwrap();
        assert_eq!(todo(&EventKind::Remove(RemoveKind::Any), vec![sub], &st), Todo::Rescan);
        // The reload of a removed file drops it.
        std::fs::remove_file(&a).unwrap();
        assert!(st.reload(vec![a]));
        assert_eq!(st.snapshot().services.len(), 1);
    }

    #[test]
    fn objects_kube_proxys_selector_leaves_out_are_neither_served_nor_reported() {
        let yaml = r#"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: a}
spec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: a, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
endpoints: [{addresses: [10.244.0.1]}]
ports: [{port: 8080}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-2, namespace: a, labels: {kubernetes.io/service-name: web, service.kubernetes.io/headless: ""}}
addressType: IPv4
endpoints: [{addresses: [10.244.0.2]}]
ports: [{port: 8080}]
---
apiVersion: v1
kind: Service
metadata: {name: theirs, namespace: a, labels: {service.kubernetes.io/service-proxy-name: cilium}}
spec: {clusterIP: 10.96.0.11, ports: [{port: 80}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: theirs-1, namespace: a, labels: {kubernetes.io/service-name: theirs, service.kubernetes.io/service-proxy-name: cilium}}
addressType: IPv4
endpoints: [{addresses: [10.244.0.3]}]
ports: [{port: 8080}]
"#;
        let (state, errors) = crate::model::build(&Snapshot::from_yaml(yaml), &crate::model::ModelConfig::default());
        assert!(errors.is_empty(), "{errors:?}");
        let served: BTreeSet<String> = state.frontends.values().map(|f| f.set.service.to_string()).collect();
        assert_eq!(served, BTreeSet::from(["a/web".to_string()]));
        let backends: Vec<String> = state.backend_sets.values().flatten().map(|b| b.addr.to_string()).collect();
        assert_eq!(backends, ["10.244.0.1"]);
    }
}
