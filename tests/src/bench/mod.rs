//! Pieces of `cargo xtask bench` that run inside the test topologies: a
//! synthetic Service set and its manifests, kube-proxy-shaped iptables and
//! nftables rule sets generated from the same set, and a load generator with
//! its server.

pub mod load;
pub mod rules;
pub mod services;
pub mod xdp_gen;
