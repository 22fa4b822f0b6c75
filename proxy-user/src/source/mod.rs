//! Where Services, EndpointSlices and the Node come from. Every source
//! publishes full snapshots; the model and reconciler never know which source
//! fed them.

pub mod kube;
pub mod manifests;

use std::sync::Arc;

use k8s_openapi::api::{core::v1::{Node, Service}, discovery::v1::EndpointSlice};
use tokio::sync::watch;

#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub services: Vec<Service>,
    pub slices: Vec<EndpointSlice>,
    pub node: Option<Node>,
}

/// The newest snapshot; `None` until the source's first complete read.
pub type SnapshotSender = watch::Sender<Option<Arc<Snapshot>>>;
pub type SnapshotReceiver = watch::Receiver<Option<Arc<Snapshot>>>;

pub trait Source: Send + 'static {
    /// Publishes a snapshot after the first full read and after each change,
    /// until the receiver is gone. Returns only on a fatal error.
    fn run(self, updates: SnapshotSender) -> impl std::future::Future<Output = anyhow::Result<()>> + Send;
}

/// The source `run` was configured with.
pub enum Configured {
    Manifests(manifests::ManifestsSource),
    Kube(kube::KubeSource),
}

impl Source for Configured {
    async fn run(self, updates: SnapshotSender) -> anyhow::Result<()> {
        match self {
            Configured::Manifests(s) => s.run(updates).await,
            Configured::Kube(s) => s.run(updates).await,
        }
    }
}
