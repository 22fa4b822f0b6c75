//! `--manifests DIR`: every *.yaml, *.yml and *.json file under DIR, applied
//! live as files change. A file that does not parse is reported and its last
//! good version keeps being served, so a typo never drops a Service.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use anyhow::{Context, Result};
use notify_debouncer_mini::{DebounceEventResult, new_debouncer, notify::RecursiveMode};
use tokio::sync::mpsc;
use tracing::{info, warn};

use super::{Snapshot, SnapshotSender, Source};
use crate::manifest::{self, ManifestError, Object};

/// Changes that arrive within this window are applied together.
const DEBOUNCE: Duration = Duration::from_millis(50);
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

/// One file as last read: its text, and its objects from the last time it parsed.
struct FileState {
    text: String,
    objects: Vec<Object>,
    error: Option<ManifestError>,
}

#[derive(Default)]
pub struct DirState {
    files: BTreeMap<PathBuf, FileState>,
}

impl DirState {
    /// Re-reads the directory; returns whether the served objects changed.
    pub fn rescan(&mut self, dir: &Path) -> bool {
        let mut changed = false;
        let found = manifest_files(dir);
        let before = self.files.len();
        self.files.retain(|path, _| found.contains(path));
        changed |= self.files.len() != before;

        for path in found {
            let text = match std::fs::read_to_string(&path) {
                Ok(t) => t,
                Err(e) => {
                    // Deleted between listing and reading, or unreadable: keep what we had.
                    warn!(path = %path.display(), error = %e, "cannot read manifest; keeping its last good version");
                    continue;
                }
            };
            if self.files.get(&path).is_some_and(|f| f.text == text) {
                continue;
            }
            match manifest::parse(&path, &text) {
                Ok(objects) => {
                    if self.files.get(&path).is_some_and(|f| f.error.is_some()) {
                        info!(path = %path.display(), "manifest fixed");
                    }
                    self.files.insert(path, FileState { text, objects, error: None });
                    changed = true;
                }
                Err(e) => {
                    warn!("bad manifest {e}; ignored until fixed, its last good version (if any) is still served");
                    let objects = self.files.remove(&path).map(|f| f.objects).unwrap_or_default();
                    self.files.insert(path, FileState { text, objects, error: Some(e) });
                }
            }
        }
        changed
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

/// Sorted, so the same directory always reads the same way.
fn manifest_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = walkdir::WalkDir::new(dir)
        .follow_links(true)
        .into_iter()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_type().is_file())
        .map(|e| e.into_path())
        .filter(|p| {
            let hidden = p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with('.'));
            let ext = p.extension().and_then(|e| e.to_str()).unwrap_or("");
            !hidden && matches!(ext, "yaml" | "yml" | "json")
        })
        .collect();
    files.sort();
    files
}

impl Source for ManifestsSource {
    async fn run(self, updates: SnapshotSender) -> Result<()> {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let mut debouncer = new_debouncer(DEBOUNCE, move |res: DebounceEventResult| {
            let _ = tx.send(res.is_ok());
        })
        .context("start watching the manifests directory")?;
        debouncer
            .watcher()
            .watch(&self.dir, RecursiveMode::Recursive)
            .with_context(|| format!("watch {}", self.dir.display()))?;

        let mut state = DirState::default();
        state.rescan(&self.dir);
        info!(dir = %self.dir.display(), files = state.files.len(), errors = state.errors().len(), "manifests read");
        updates.send_replace(Some(Arc::new(state.snapshot())));

        let mut tick = tokio::time::interval(RESCAN);
        tick.tick().await;
        loop {
            tokio::select! {
                ev = rx.recv() => if ev.is_none() { anyhow::bail!("manifests watcher stopped") },
                _ = tick.tick() => {}
                _ = updates.closed() => return Ok(()),
            }
            if state.rescan(&self.dir) {
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
    }
}
