//! The ebpf-proxy agent and CLI.

pub mod agent;
pub mod attach;
pub mod cgroup;
pub mod cleanup;
pub mod cli;
pub mod clsact;
pub mod dump;
pub mod endpoint_ips;
pub mod health;
pub mod healthcheck;
pub mod incremental;
pub mod kernel;
pub mod manifest;
pub mod maps;
pub mod metrics;
pub mod model;
pub mod node_addrs;
pub mod precedence;
pub mod rbac;
pub mod reconciler;
pub mod service_cidrs;
pub mod snat_ports;
pub mod source;
pub mod topology;
pub mod trace;
