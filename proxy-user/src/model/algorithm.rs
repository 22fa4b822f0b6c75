//! How a Service's new flows pick a backend: `random` (a random slot of
//! its set) or `maglev` (the flow's cell of a Maglev table, the same on
//! every node: `crate::maglev`). Per Service by annotation, else the
//! `--lb-algorithm` default.

use k8s_openapi::api::core::v1::Service;

pub const LB_ALGORITHM_ANNOTATION: &str = "ebpf-proxy.io/lb-algorithm";

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LbAlgorithm {
    #[default]
    Random,
    Maglev,
}

impl LbAlgorithm {
    pub fn name(self) -> &'static str {
        match self {
            LbAlgorithm::Random => "random",
            LbAlgorithm::Maglev => "maglev",
        }
    }
}

/// The Service's algorithm: its annotation's, else `default`. An unknown
/// value is an error saying so; the Service is then served with the default.
pub fn of(svc: &Service, default: LbAlgorithm) -> Result<LbAlgorithm, String> {
    let annotation = svc.metadata.annotations.as_ref().and_then(|a| a.get(LB_ALGORITHM_ANNOTATION));
    let Some(value) = annotation else { return Ok(default) };
    match value.trim() {
        "maglev" => Ok(LbAlgorithm::Maglev),
        "random" => Ok(LbAlgorithm::Random),
        other => Err(format!(
            "metadata.annotations[{LB_ALGORITHM_ANNOTATION}]: unknown algorithm {other:?} (maglev or random); \
             served with the default, {}",
            default.name()
        )),
    }
}
