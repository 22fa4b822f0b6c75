//! Which Service serves a frontend (address, port, protocol, scope) that
//! several Services claim. The API keeps ClusterIPs and NodePorts unique but
//! not ExternalIPs or load balancer IPs: a tenant may list another Service's
//! ClusterIP as an ExternalIP (CVE-2020-8554), and a manifests directory has
//! no API server to check anything. kube-proxy writes each Service's
//! ClusterIP, ExternalIP and load balancer rules together, Service after
//! Service in the order of its Go map, so which one matches may change from
//! one sync to the next. Here the order is fixed, and never the order the
//! Services' names sort in:
//!
//! 1. A ClusterIP first: the one address the API allocates to a Service and
//!    keeps unique, so another Service's ExternalIP or load balancer IP never
//!    takes it.
//! 2. ExternalIPs and load balancer IPs next: kube-proxy matches them before
//!    NodePorts (iptables jumps to KUBE-NODEPORTS last in KUBE-SERVICES;
//!    nftables looks up `service-nodeports` after `service-ips`).
//! 3. NodePorts last.
//!
//! Between claims of one rank (two Services' ExternalIPs, say), the older
//! Service by creationTimestamp wins, so a new Service never takes an address
//! from one already serving it; Services without a timestamp (most
//! manifests) come after those with one, and among themselves go by
//! namespace/name. The losing Service keeps everything else it has.

use std::{cmp::Ordering, net::SocketAddr};

use k8s_openapi::{api::core::v1::Service, jiff::Timestamp};
use proxy_common::{FrontendKey, KIND_CLUSTER_IP, KIND_EXTERNAL_IP, KIND_LOAD_BALANCER};

use crate::{
    dump::{kind_name, protocol_name},
    model::{ObjectError, ServiceKey, SkipReason},
};

/// One Service's claim on one frontend. Of the claims on a frontend, the
/// least is served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claim<'a> {
    /// The KIND_* of the Service's frontend there.
    pub kind: u8,
    pub created: Option<Timestamp>,
    pub service: ServiceKey<'a>,
}

impl<'a> Claim<'a> {
    pub fn new(kind: u8, svc: &Service, service: ServiceKey<'a>) -> Self {
        Claim { kind, created: created(svc), service }
    }

    /// Rank, then age (no timestamp after any), then namespace/name; the
    /// kind last only to keep the order total.
    fn order(&self) -> (u8, bool, Option<Timestamp>, ServiceKey<'a>, u8) {
        (rank(self.kind), self.created.is_none(), self.created, self.service, self.kind)
    }
}

impl Ord for Claim<'_> {
    fn cmp(&self, other: &Self) -> Ordering {
        self.order().cmp(&other.order())
    }
}

impl PartialOrd for Claim<'_> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// A Service's creationTimestamp, the age claims of one rank go by.
pub fn created(svc: &Service) -> Option<Timestamp> {
    svc.metadata.creation_timestamp.as_ref().map(|t| t.0)
}

/// The order kube-proxy's rules match frontend kinds in; lower first.
pub fn rank(kind: u8) -> u8 {
    match kind {
        KIND_CLUSTER_IP => 0,
        KIND_EXTERNAL_IP | KIND_LOAD_BALANCER => 1,
        _ => 2,
    }
}

/// Reports every losing claim on a contested frontend: one problem per
/// losing Service and address:port/protocol, added to `errors` once (the
/// internal and external scopes of an address report the same).
pub fn report_losers(key: &FrontendKey, claims: &[Claim], errors: &mut Vec<ObjectError>) {
    let Some(winner) = claims.iter().min() else { return };
    for loser in claims.iter().filter(|c| *c != winner) {
        let error = conflict(key, winner, loser);
        if !errors.contains(&error) {
            errors.push(error);
        }
    }
}

fn conflict(key: &FrontendKey, winner: &Claim, loser: &Claim) -> ObjectError {
    let at = SocketAddr::new(key.addr.to_ip(), u16::from_be(key.port));
    let (ns, name) = winner.service;
    let reason = format!(
        "{} {at}/{} is also service {ns}/{name}'s {}, which is served there (frontend conflict); skipped",
        kind_name(loser.kind),
        protocol_name(key.proto),
        kind_name(winner.kind),
    );
    ObjectError::service(loser.service.0, loser.service.1, SkipReason::FrontendConflict, reason)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proxy_common::KIND_NODE_PORT;

    fn at(day: i8) -> Option<Timestamp> {
        Some(format!("2025-01-{day:02}T00:00:00Z").parse().unwrap())
    }

    #[test]
    fn cluster_ip_first_then_service_ips_then_node_ports_then_the_oldest() {
        let claim = |kind, created, service| Claim { kind, created, service };
        let z_cluster_ip = claim(KIND_CLUSTER_IP, at(9), ("z", "z"));
        let a_external = claim(KIND_EXTERNAL_IP, at(1), ("a", "a"));
        assert!(z_cluster_ip < a_external, "a ClusterIP wins whatever the age or name");
        assert!(a_external < claim(KIND_NODE_PORT, at(1), ("a", "0")));
        // Same rank: the older Service, whatever the name; without a timestamp, after.
        let z_old_lb = claim(KIND_LOAD_BALANCER, at(1), ("z", "z"));
        assert!(z_old_lb < claim(KIND_EXTERNAL_IP, at(2), ("a", "a")));
        assert!(claim(KIND_EXTERNAL_IP, at(9), ("z", "z")) < claim(KIND_EXTERNAL_IP, None, ("a", "a")));
        assert!(claim(KIND_EXTERNAL_IP, None, ("a", "b")) < claim(KIND_EXTERNAL_IP, None, ("b", "a")));
    }
}
