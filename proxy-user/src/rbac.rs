//! Every Kubernetes API call the agent makes, as (API group, resource, verbs).
//! deploy/'s ClusterRole must grant exactly this (tests/tests/deploy.rs checks
//! it) and the Kubernetes source's mock-API test checks that every request the
//! source sends is covered here. Keep the three in step.

pub struct ApiAccess {
    /// "" is the core group.
    pub group: &'static str,
    pub resource: &'static str,
    pub verbs: &'static [&'static str],
}

pub const API_ACCESS: &[ApiAccess] = &[
    ApiAccess { group: "", resource: "services", verbs: &["list", "watch"] },
    ApiAccess { group: "discovery.k8s.io", resource: "endpointslices", verbs: &["list", "watch"] },
    ApiAccess { group: "", resource: "nodes", verbs: &["get", "list", "watch"] },
    // Only where the API server has them (Kubernetes 1.33+); a 403 here
    // leaves the agent on --service-cidr.
    ApiAccess { group: "networking.k8s.io", resource: "servicecidrs", verbs: &["list", "watch"] },
];
