//! What the model reads of this node's Node object, besides its zone
//! (`topology`): whether it may receive load-balanced traffic.

use k8s_openapi::api::core::v1::Node;

/// The taint the cluster autoscaler puts on a node it is about to delete.
pub const TO_BE_DELETED_TAINT: &str = "ToBeDeletedByClusterAutoscaler";

/// Whether a node may receive load-balanced traffic, as kube-proxy judges
/// it: not when it is being deleted or tainted for deletion (/healthz
/// fails then, /livez does not).
pub fn eligible(node: Option<&Node>) -> bool {
    let Some(node) = node else { return true };
    let deleting = node.metadata.deletion_timestamp.is_some();
    let tainted = node.spec.as_ref().and_then(|s| s.taints.as_ref()).into_iter().flatten().any(|t| t.key == TO_BE_DELETED_TAINT);
    !deleting && !tainted
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(extra: serde_json::Value) -> Node {
        let mut n = serde_json::json!({"metadata": {"name": "node-a"}});
        n.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        serde_json::from_value(n).unwrap()
    }

    #[test]
    fn a_node_being_deleted_or_tainted_for_it_is_not_eligible() {
        let tainted = node(serde_json::json!({"spec": {"taints": [{"key": TO_BE_DELETED_TAINT, "effect": "NoSchedule"}]}}));
        let other_taint = node(serde_json::json!({"spec": {"taints": [{"key": "dedicated", "effect": "NoSchedule"}]}}));
        let mut deleting = node(serde_json::json!({}));
        deleting.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Default::default()));
        assert!(eligible(None) && eligible(Some(&other_taint)));
        assert!(!eligible(Some(&tainted)) && !eligible(Some(&deleting)));
    }
}
