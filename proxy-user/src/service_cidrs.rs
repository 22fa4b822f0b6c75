//! The service CIDRs whose unallocated addresses are dropped. Where the
//! cluster has ServiceCIDR objects (`networking.k8s.io/v1`, Kubernetes
//! 1.33+), they are the allocator's own configuration and decide, as they
//! do for kube-proxy: the union of every object's `spec.cidrs`, terminating
//! ones included (their addresses may still be allocated). Without any
//! object, `--service-cidr` is the fallback.

use std::{collections::BTreeSet, sync::Arc};

use ipnet::IpNet;
use k8s_openapi::api::networking::v1::ServiceCIDR;

use crate::model::{ObjectError, SkipReason};

/// The effective service CIDRs, and what in the objects was skipped. An
/// object whose every entry is invalid still counts as the cluster's word:
/// a bad entry means fewer drops, never `fallback`'s guess.
pub fn effective(objects: &[Arc<ServiceCIDR>], fallback: &[IpNet]) -> (BTreeSet<IpNet>, Vec<ObjectError>) {
    if objects.is_empty() {
        return (fallback.iter().map(IpNet::trunc).collect(), Vec::new());
    }
    let mut cidrs = BTreeSet::new();
    let mut errors = Vec::new();
    for obj in objects {
        let name = obj.metadata.name.as_deref().unwrap_or("?");
        let Some(entries) = obj.spec.as_ref().and_then(|s| s.cidrs.as_ref()).filter(|c| !c.is_empty()) else {
            errors.push(ObjectError::service_cidr(name, SkipReason::MissingField, "no spec.cidrs; it adds no CIDR".into()));
            continue;
        };
        for (i, cidr) in entries.iter().enumerate() {
            match cidr.trim().parse::<IpNet>() {
                Ok(net) => {
                    cidrs.insert(net.trunc());
                }
                Err(_) => {
                    let reason = format!("spec.cidrs[{i}]: invalid CIDR {cidr:?}; skipped");
                    errors.push(ObjectError::service_cidr(name, SkipReason::InvalidCidr, reason));
                }
            }
        }
    }
    (cidrs, errors)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::Snapshot;

    fn nets(list: &[&str]) -> BTreeSet<IpNet> {
        list.iter().map(|n| n.parse().unwrap()).collect()
    }

    fn objects(yaml: &str) -> Vec<Arc<ServiceCIDR>> {
        Snapshot::from_yaml(yaml).service_cidrs
    }

    const KUBERNETES: &str = "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {name: kubernetes}\n\
                              spec: {cidrs: [10.96.0.0/16, 'fd00:10:96::/112']}\n";
    const EXTRA: &str = "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {name: extra}\n\
                         spec: {cidrs: [10.97.0.0/16, 10.96.0.0/16]}\n";

    #[test]
    fn without_objects_the_flag_decides() {
        let flag = ["172.30.0.0/16".parse().unwrap()];
        assert_eq!(effective(&[], &flag), (nets(&["172.30.0.0/16"]), vec![]));
        assert_eq!(effective(&[], &[]), (BTreeSet::new(), vec![]));
    }

    #[test]
    fn objects_replace_the_flag_with_the_union_of_their_cidrs() {
        let flag = ["172.30.0.0/16".parse().unwrap()];
        let (cidrs, errors) = effective(&objects(&format!("{KUBERNETES}---\n{EXTRA}")), &flag);
        assert!(errors.is_empty(), "{errors:?}");
        // Both families, each CIDR once though two objects list it.
        assert_eq!(cidrs, nets(&["10.96.0.0/16", "10.97.0.0/16", "fd00:10:96::/112"]));
        // Host bits are cleared, as for loadBalancerSourceRanges.
        let sloppy = KUBERNETES.replace("10.96.0.0/16", "10.96.3.4/16");
        assert_eq!(effective(&objects(&sloppy), &flag).0, nets(&["10.96.0.0/16", "fd00:10:96::/112"]));
    }

    #[test]
    fn invalid_cidrs_are_reported_and_skipped_and_never_bring_the_flag_back() {
        let flag = ["172.30.0.0/16".parse().unwrap()];
        let bad = KUBERNETES.replace("10.96.0.0/16", "10.96.0.0/33");
        let (cidrs, errors) = effective(&objects(&format!("{bad}---\n{EXTRA}")), &flag);
        assert_eq!(cidrs, nets(&["10.96.0.0/16", "10.97.0.0/16", "fd00:10:96::/112"]));
        let text: Vec<String> = errors.iter().map(ToString::to_string).collect();
        assert_eq!(text, ["servicecidr kubernetes: spec.cidrs[0]: invalid CIDR \"10.96.0.0/33\"; skipped"]);
        assert_eq!(crate::metrics::classify(&errors[0]), ("ServiceCIDR", "invalid_cidr"));

        // Nothing valid at all: the objects still decide (no drop), not the flag.
        let (cidrs, errors) = effective(&objects(&bad.replace("'fd00:10:96::/112'", "bogus")), &flag);
        assert!(cidrs.is_empty(), "{cidrs:?}");
        assert_eq!(errors.len(), 2, "{errors:?}");
        let (cidrs, errors) = effective(&objects("apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {name: empty}\n"), &flag);
        assert!(cidrs.is_empty());
        assert_eq!(crate::metrics::classify(&errors[0]), ("ServiceCIDR", "missing_field"));
    }
}
