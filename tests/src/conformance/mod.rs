//! kube-proxy conformance: the packet-flow tables of kube-proxy's own
//! proxier tests (`tests/conformance/`), run with real TCP and UDP traffic
//! through the real agent and BPF programs on a two-node cluster built in
//! network namespaces. `tests/tests/conformance.rs` drives it.

pub mod cluster;
pub mod data;
pub mod frontends;
pub mod probe;
pub mod run;
pub mod verdict;
