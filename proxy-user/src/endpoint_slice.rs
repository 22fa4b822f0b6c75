//! EndpointSlices as the agent keeps them: only what the model reads.
//! k8s-openapi's Endpoint has every field of the API (~350 bytes before its
//! strings: 35 MB at 100,000 endpoints, held for as long as the slice
//! lives). This one is deserialized from the same YAML or JSON, passing
//! over the rest, and is what both sources hand the model. It is a kube-rs
//! `Resource`, so the API source watches and stores it as it would
//! k8s-openapi's.

use std::borrow::Cow;

use compact_str::CompactString;
use k8s_openapi::{
    NamespaceResourceScope,
    api::discovery::v1::{EndpointConditions, EndpointHints, EndpointPort},
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use serde::{Deserialize, Deserializer};

use crate::{
    model::{SERVICE_NAME_LABEL, trigger_times::TRIGGER_TIME_ANNOTATION},
    source::kube,
};

type Api = k8s_openapi::api::discovery::v1::EndpointSlice;

/// Strings are `CompactString`s: an address, a node name or a zone is
/// stored inline (up to 24 bytes), not as a heap allocation of its own.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(from = "Wire")]
pub struct EndpointSlice {
    /// Name, namespace and resourceVersion: labels and annotations are read
    /// into the fields below and not kept.
    pub metadata: ObjectMeta,
    /// The Service it belongs to: its `kubernetes.io/service-name` label.
    pub service_name: Option<CompactString>,
    /// Its `endpoints.kubernetes.io/last-change-trigger-time` annotation.
    pub trigger_time: Option<CompactString>,
    /// Whether kube-proxy's label selector admits it (`kube::is_ours`).
    pub ours: bool,
    /// Unset reads as "", as k8s-openapi reads a missing required field.
    pub address_type: CompactString,
    pub endpoints: Vec<Endpoint>,
    pub ports: Option<Vec<EndpointPort>>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Endpoint {
    /// The first of `addresses`: the one kube-proxy uses (the API allows one).
    #[serde(rename = "addresses", default, deserialize_with = "first")]
    pub address: Option<CompactString>,
    #[serde(default)]
    pub conditions: Option<EndpointConditions>,
    #[serde(default)]
    pub node_name: Option<CompactString>,
    #[serde(default)]
    pub zone: Option<CompactString>,
    /// Boxed: most endpoints have none.
    #[serde(default)]
    pub hints: Option<Box<EndpointHints>>,
}

/// The object as the API and manifests spell it.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Wire {
    #[serde(default)]
    metadata: ObjectMeta,
    #[serde(default, deserialize_with = "null_as_default")]
    address_type: CompactString,
    #[serde(default, deserialize_with = "null_as_default")]
    endpoints: Vec<Endpoint>,
    #[serde(default)]
    ports: Option<Vec<EndpointPort>>,
}

impl From<Wire> for EndpointSlice {
    fn from(wire: Wire) -> EndpointSlice {
        let ObjectMeta { name, namespace, resource_version, labels, annotations, .. } = wire.metadata;
        let label = labels.as_ref().and_then(|l| l.get(SERVICE_NAME_LABEL));
        let annotation = annotations.as_ref().and_then(|a| a.get(TRIGGER_TIME_ANNOTATION));
        EndpointSlice {
            metadata: ObjectMeta { name, namespace, resource_version, ..Default::default() },
            service_name: label.map(CompactString::from),
            trigger_time: annotation.map(CompactString::from),
            ours: kube::is_ours(labels.as_ref()),
            address_type: wire.address_type,
            // Cut to their length: serde grows them by doubling (see `service`).
            endpoints: shrunk(wire.endpoints),
            ports: wire.ports.map(shrunk),
        }
    }
}

fn shrunk<T>(mut list: Vec<T>) -> Vec<T> {
    list.shrink_to_fit();
    list
}

fn null_as_default<'de, D: Deserializer<'de>, T: Deserialize<'de> + Default>(d: D) -> Result<T, D::Error> {
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

fn first<'de, D: Deserializer<'de>>(d: D) -> Result<Option<CompactString>, D::Error> {
    Ok(Option::<Vec<CompactString>>::deserialize(d)?.and_then(|all| all.into_iter().next()))
}

impl ::kube::Resource for EndpointSlice {
    type DynamicType = ();
    type Scope = NamespaceResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        <Api as k8s_openapi::Resource>::KIND.into()
    }

    fn group(_: &()) -> Cow<'_, str> {
        <Api as k8s_openapi::Resource>::GROUP.into()
    }

    fn version(_: &()) -> Cow<'_, str> {
        <Api as k8s_openapi::Resource>::VERSION.into()
    }

    fn plural(_: &()) -> Cow<'_, str> {
        <Api as k8s_openapi::Resource>::URL_PATH_SEGMENT.into()
    }

    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field the model reads comes through; the rest is passed over,
    /// and what k8s-openapi reads as a default reads the same here.
    #[test]
    fn reads_what_the_model_uses_from_an_api_object() {
        let json = serde_json::json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "web-1", "namespace": "a", "resourceVersion": "7", "uid": "u",
                         "labels": {"kubernetes.io/service-name": "web", "app": "web"},
                         "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": "2026-01-01T00:00:00Z"}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": [
                {"addresses": ["10.0.0.1", "10.0.0.9"], "conditions": {"ready": false, "terminating": true},
                 "nodeName": "ip-10-0-1-23.eu-west-1.compute.internal", "zone": "z1",
                 "hints": {"forZones": [{"name": "z1"}]}, "targetRef": {"kind": "Pod", "name": "web-1"}, "hostname": "h"},
                {"addresses": []}
            ]
        });
        let ours: EndpointSlice = serde_json::from_value(json.clone()).unwrap();
        let theirs: Api = serde_json::from_value(json).unwrap();
        let meta = &theirs.metadata;
        assert_eq!(ours.metadata.name, meta.name);
        assert_eq!(ours.metadata.namespace, meta.namespace);
        assert_eq!(ours.metadata.resource_version, meta.resource_version);
        assert_eq!(ours.service_name.as_deref(), Some("web"));
        assert_eq!(ours.trigger_time.as_deref(), Some("2026-01-01T00:00:00Z"));
        assert!(ours.ours);
        assert_eq!(ours.address_type, theirs.address_type);
        assert_eq!(ours.ports, theirs.ports);
        assert_eq!(ours.endpoints.len(), theirs.endpoints.len());
        for (o, t) in ours.endpoints.iter().zip(&theirs.endpoints) {
            assert_eq!(o.address.as_deref(), t.addresses.first().map(String::as_str));
            assert_eq!(o.conditions, t.conditions);
            assert_eq!(o.node_name.as_deref(), t.node_name.as_deref());
            assert_eq!(o.zone.as_deref(), t.zone.as_deref());
            assert_eq!(o.hints.as_deref(), t.hints.as_ref());
        }
        let empty: EndpointSlice = serde_json::from_value(serde_json::json!({"endpoints": null})).unwrap();
        assert!(empty.endpoints.is_empty() && empty.address_type.is_empty() && empty.service_name.is_none());
        let elsewhere = serde_json::json!({"metadata": {"labels": {"service.kubernetes.io/headless": ""}}});
        assert!(!serde_json::from_value::<EndpointSlice>(elsewhere).unwrap().ours);
    }
}
