//! Where Services, EndpointSlices, the Node and ServiceCIDRs come from.
//! Every source publishes full snapshots; the model and reconciler never know
//! which source fed them.

pub mod kube;
pub mod manifests;
pub mod retry;

use std::sync::Arc;

use k8s_openapi::api::{
    core::v1::{Node, Service},
    networking::v1::ServiceCIDR,
};
use tokio::sync::watch;

use crate::{endpoint_slice::EndpointSlice, manifest::Object};

/// Objects are shared (`Arc`) between the source, successive snapshots and
/// the model, so publishing a snapshot copies no object, and the model can
/// tell an unchanged object from a changed one by pointer.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub services: Vec<Arc<Service>>,
    pub slices: Vec<Arc<EndpointSlice>>,
    pub node: Option<Node>,
    /// The cluster's ServiceCIDRs; none where the API has no such resource
    /// (`service_cidrs` falls back to `--service-cidr` then).
    pub service_cidrs: Vec<Arc<ServiceCIDR>>,
}

impl Snapshot {
    /// Files a parsed object under its kind (a later Node replaces an earlier one).
    pub fn add(&mut self, obj: &Object) {
        match obj {
            Object::Service(s) => self.services.push(s.clone()),
            Object::EndpointSlice(s) => self.slices.push(s.clone()),
            Object::Node(n) => self.node = Some((**n).clone()),
            Object::ServiceCIDR(c) => self.service_cidrs.push(c.clone()),
        }
    }

    /// The objects of one YAML text as the manifests source serves them, for
    /// unit tests of what consumes snapshots.
    #[cfg(test)]
    pub fn from_yaml(yaml: &str) -> Snapshot {
        let mut snap = Snapshot::default();
        for obj in manifests::ours(crate::manifest::parse(std::path::Path::new("t.yaml"), yaml).unwrap()) {
            snap.add(&obj);
        }
        snap
    }
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
