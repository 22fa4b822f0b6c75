//! When the changes behind EndpointSlices happened (the endpoints
//! controller's last-change-trigger-time), for the network programming
//! latency: the incremental model notes each slice that changed, and the
//! agent takes the times once the change is in the maps.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use crate::endpoint_slice::EndpointSlice;

/// The annotation the endpoints controller sets to when the change it
/// reflects happened (network programming latency starts there).
pub const TRIGGER_TIME_ANNOTATION: &str = "endpoints.kubernetes.io/last-change-trigger-time";

#[derive(Default)]
pub struct TriggerTimes {
    /// The last trigger time noted per slice (`namespace/name`): a slice
    /// re-listed unchanged, or rebuilt, is not counted again.
    last: HashMap<String, DateTime<Utc>>,
    /// Noted, not yet taken.
    fresh: Vec<DateTime<Utc>>,
}

impl TriggerTimes {
    /// A slice that is new or changed since the last snapshot.
    pub fn changed(&mut self, slice: &EndpointSlice) {
        let Some(t) = slice.trigger_time.as_deref() else { return };
        let Ok(t) = DateTime::parse_from_rfc3339(t).map(|t| t.with_timezone(&Utc)) else { return };
        if self.last.insert(key(slice), t) != Some(t) {
            self.fresh.push(t);
        }
    }

    /// Forgets slices that are gone, once more are remembered than exist
    /// (twice as many: a cost per object only now and then).
    pub fn forget_gone<'a>(&mut self, slices: impl ExactSizeIterator<Item = &'a EndpointSlice>) {
        if self.last.len() <= 2 * slices.len().max(64) {
            return;
        }
        let live: std::collections::HashSet<String> = slices.map(key).collect();
        self.last.retain(|key, _| live.contains(key));
    }

    /// The trigger times noted since the last call.
    pub fn take(&mut self) -> Vec<DateTime<Utc>> {
        std::mem::take(&mut self.fresh)
    }
}

fn key(slice: &EndpointSlice) -> String {
    format!("{}/{}", slice.metadata.namespace.as_deref().unwrap_or(""), slice.metadata.name.as_deref().unwrap_or(""))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::Snapshot;

    fn slices(list: &[(&str, &str)]) -> Snapshot {
        let yaml: String = list
            .iter()
            .map(|(name, t)| {
                format!(
                    "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}, namespace: a, annotations: {{{TRIGGER_TIME_ANNOTATION}: '{t}'}}}}\naddressType: IPv4\nendpoints: []\n---\n"
                )
            })
            .collect();
        Snapshot::from_yaml(&yaml)
    }

    #[test]
    fn each_change_is_counted_once() {
        let mut tt = TriggerTimes::default();
        let snap = slices(&[("old", "2025-12-31T23:59:00Z"), ("new", "2026-01-01T00:00:05Z")]);
        snap.slices.iter().for_each(|s| tt.changed(s));
        assert_eq!(tt.take().len(), 2);
        assert!(tt.take().is_empty(), "taken once");
        // Re-listed (new objects, same times): nothing new; one changed: one.
        let snap = slices(&[("old", "2026-01-01T00:00:09Z"), ("new", "2026-01-01T00:00:05Z")]);
        snap.slices.iter().for_each(|s| tt.changed(s));
        assert_eq!(tt.take(), vec![DateTime::parse_from_rfc3339("2026-01-01T00:00:09Z").unwrap().with_timezone(&Utc)]);
    }
}
