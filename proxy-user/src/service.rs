//! Services as the agent keeps them: k8s-openapi's type, with its lists cut
//! to their length. serde fills a list without knowing its length (neither
//! the YAML nor the JSON parser tells it), so a list grows by doubling: a
//! Service with one port holds room for four, a slice of 10 endpoints room
//! for 16: ~10 MiB of such room at 10,000 Services with 100,000 endpoints.
//! EndpointSlices are cut in `endpoint_slice`.

use k8s_openapi::api::core::v1::Service;

/// Shrinks the lists a Service holds (both sources call it on every Service
/// they read).
pub fn shrink(svc: &mut Service) {
    if let Some(spec) = &mut svc.spec {
        for list in [&mut spec.cluster_ips, &mut spec.external_ips, &mut spec.ip_families, &mut spec.load_balancer_source_ranges] {
            shrink_list(list);
        }
        shrink_list(&mut spec.ports);
    }
    if let Some(ingress) = svc.status.as_mut().and_then(|s| s.load_balancer.as_mut()).and_then(|lb| lb.ingress.as_mut()) {
        ingress.shrink_to_fit();
        for ip in ingress {
            shrink_list(&mut ip.ports);
        }
    }
    shrink_list(&mut svc.metadata.finalizers);
    shrink_list(&mut svc.metadata.owner_references);
}

fn shrink_list<T>(list: &mut Option<Vec<T>>) {
    if let Some(list) = list {
        list.shrink_to_fit();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_keep_no_room_beyond_their_length() {
        let yaml = "metadata: {name: web}\nspec: {clusterIPs: [10.96.0.1], ports: [{port: 80}]}\n";
        let mut svc: Service = serde_yaml::from_str(yaml).unwrap();
        assert!(svc.spec.as_ref().unwrap().ports.as_ref().unwrap().capacity() > 1, "serde's growth: the room this removes");
        shrink(&mut svc);
        let spec = svc.spec.as_ref().unwrap();
        assert_eq!(spec.ports.as_ref().unwrap().capacity(), 1);
        assert_eq!(spec.cluster_ips.as_ref().unwrap().capacity(), 1);
    }
}
