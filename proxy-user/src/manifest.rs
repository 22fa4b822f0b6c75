//! Kubernetes objects from YAML or JSON text: every document of a file,
//! typed, with errors that name the file, the line and the field.

use std::{fmt, path::Path, sync::Arc};

use k8s_openapi::api::{
    core::v1::{Node, Service},
    networking::v1::ServiceCIDR,
};
use serde::{
    Deserialize, Deserializer,
    de::{self, DeserializeSeed, IgnoredAny, MapAccess, Visitor, value::MapAccessDeserializer},
};

use crate::endpoint_slice::EndpointSlice;

/// The objects ebpf-proxy reads. Other kinds are ignored (a manifests
/// directory may well hold Deployments next to Services).
#[derive(Debug, Clone)]
pub enum Object {
    Service(Arc<Service>),
    EndpointSlice(Arc<EndpointSlice>),
    Node(Box<Node>),
    ServiceCIDR(Arc<ServiceCIDR>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManifestError {
    pub path: String,
    /// 1-based; 0 when the parser could not tell.
    pub line: usize,
    pub reason: String,
}

impl fmt::Display for ManifestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line > 0 {
            write!(f, "{}:{}: {}", self.path, self.line, self.reason)
        } else {
            write!(f, "{}: {}", self.path, self.reason)
        }
    }
}

impl std::error::Error for ManifestError {}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct TypeMeta {
    api_version: Option<String>,
    kind: Option<String>,
}

enum Kind {
    Service,
    EndpointSlice,
    Node,
    ServiceCIDR,
    Other,
}

/// Parses all documents of one file. One bad document fails the whole file,
/// so a half-read file never replaces the last good version of it.
pub fn parse(path: &Path, text: &str) -> Result<Vec<Object>, ManifestError> {
    // The fast path reads the text once and has no field tracking; any error
    // sends the file through `parse_reporting`, which finds its line and field.
    parse_fast(text).ok_or(()).or_else(|()| parse_reporting(path, text))
}

/// Every document typed in one pass over the text, without buffering it
/// when `apiVersion` and `kind` are its first keys (as kubectl and every
/// generator write them): the object is read straight from the parser.
/// Keys before them are buffered, and only those. `None` on any error.
fn parse_fast(text: &str) -> Option<Vec<Object>> {
    let mut objects = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(text) {
        // A comment-only document is null.
        if let Some(object) = doc.deserialize_any(DocumentVisitor).ok()? {
            objects.push(object);
        }
    }
    Some(objects)
}

fn service(mut svc: Service) -> Object {
    crate::service::shrink(&mut svc);
    Object::Service(Arc::new(svc))
}

/// One document: its type meta first, then the object of that kind.
struct DocumentVisitor;

impl<'de> Visitor<'de> for DocumentVisitor {
    type Value = Option<Object>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a Kubernetes object")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let (mut api_version, mut kind) = (None::<String>, None::<String>);
        let mut before = Vec::new();
        while api_version.is_none() || kind.is_none() {
            let Some(key) = map.next_key::<String>()? else { break };
            match key.as_str() {
                "apiVersion" => api_version = Some(map.next_value()?),
                "kind" => kind = Some(map.next_value()?),
                _ => before.push((key, map.next_value::<serde_yaml::Value>()?)),
            }
        }
        let kind = kind_of(api_version.as_deref(), kind.as_deref()).map_err(de::Error::custom)?;
        let rest = || MapAccessDeserializer::new(Rest { before: before.into_iter(), value: None, map });
        Ok(Some(match kind {
            Kind::Service => service(Service::deserialize(rest())?),
            Kind::EndpointSlice => Object::EndpointSlice(Arc::new(EndpointSlice::deserialize(rest())?)),
            Kind::Node => Object::Node(Box::new(Node::deserialize(rest())?)),
            Kind::ServiceCIDR => Object::ServiceCIDR(Arc::new(ServiceCIDR::deserialize(rest())?)),
            Kind::Other => {
                IgnoredAny::deserialize(rest())?;
                return Ok(None);
            }
        }))
    }
}

/// The rest of a document's map: the entries read before its kind was
/// known, then those the parser still holds.
struct Rest<A> {
    before: std::vec::IntoIter<(String, serde_yaml::Value)>,
    /// The value of the buffered key just handed out.
    value: Option<serde_yaml::Value>,
    map: A,
}

impl<'de, A: MapAccess<'de>> MapAccess<'de> for Rest<A> {
    type Error = A::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, seed: K) -> Result<Option<K::Value>, A::Error> {
        match self.before.next() {
            Some((key, value)) => {
                self.value = Some(value);
                seed.deserialize(de::value::StringDeserializer::<A::Error>::new(key)).map(Some)
            }
            None => self.map.next_key_seed(seed),
        }
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, A::Error> {
        match self.value.take() {
            Some(value) => seed.deserialize(value).map_err(de::Error::custom),
            None => self.map.next_value_seed(seed),
        }
    }
}

fn kind_of(api_version: Option<&str>, kind: Option<&str>) -> Result<Kind, String> {
    Ok(match (api_version, kind) {
        (Some("v1"), Some("Service")) => Kind::Service,
        (Some("discovery.k8s.io/v1"), Some("EndpointSlice")) => Kind::EndpointSlice,
        (Some("v1"), Some("Node")) => Kind::Node,
        (Some("networking.k8s.io/v1"), Some("ServiceCIDR")) => Kind::ServiceCIDR,
        (_, None) => return Err("a document has no `kind`".into()),
        _ => Kind::Other,
    })
}

/// Two passes (kinds, then typed objects through serde_path_to_error), so an
/// error carries the field path and line.
fn parse_reporting(path: &Path, text: &str) -> Result<Vec<Object>, ManifestError> {
    let err = |line: usize, reason: String| ManifestError { path: path.display().to_string(), line, reason };
    let line_of = |e: &serde_yaml::Error| e.location().map(|l| l.line()).unwrap_or(0);

    // First pass: what kind each document is. Comment-only documents are null.
    let mut kinds = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(text) {
        let meta = Option::<TypeMeta>::deserialize(doc).map_err(|e| err(line_of(&e), e.to_string()))?;
        let kind = match meta {
            None => Kind::Other,
            Some(TypeMeta { api_version, kind }) => kind_of(api_version.as_deref(), kind.as_deref()).map_err(|e| err(0, e))?,
        };
        kinds.push(kind);
    }

    // Second pass: the typed object, so errors carry the field path and line.
    let mut objects = Vec::new();
    for (doc, kind) in serde_yaml::Deserializer::from_str(text).zip(kinds) {
        let typed = |e: serde_path_to_error::Error<serde_yaml::Error>| {
            let field = e.path().to_string();
            let inner = e.into_inner();
            err(line_of(&inner), format!("{field}: {inner}"))
        };
        match kind {
            Kind::Service => objects.push(service(serde_path_to_error::deserialize(doc).map_err(typed)?)),
            Kind::EndpointSlice => {
                objects.push(Object::EndpointSlice(Arc::new(serde_path_to_error::deserialize(doc).map_err(typed)?)))
            }
            Kind::Node => objects.push(Object::Node(Box::new(serde_path_to_error::deserialize(doc).map_err(typed)?))),
            Kind::ServiceCIDR => {
                objects.push(Object::ServiceCIDR(Arc::new(serde_path_to_error::deserialize(doc).map_err(typed)?)))
            }
            Kind::Other => {}
        }
    }
    Ok(objects)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
# a comment-only document first
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  clusterIP: 10.96.0.10
  ports: [{name: http, port: 80, targetPort: 8080, protocol: TCP}]
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: ignored}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-abc, namespace: default, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
endpoints: [{addresses: [10.244.0.11]}]
ports: [{name: http, port: 8080, protocol: TCP}]
"#;

    #[test]
    fn reads_every_document_and_skips_other_kinds() {
        let objs = parse(Path::new("good.yaml"), GOOD).unwrap();
        assert_eq!(objs.len(), 2);
        assert!(matches!(&objs[0], Object::Service(s) if s.metadata.name.as_deref() == Some("web")));
        assert!(matches!(&objs[1], Object::EndpointSlice(_)));
    }

    #[test]
    fn service_cidrs_are_read_and_other_networking_kinds_skipped() {
        let yaml = "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {name: kubernetes}\nspec: {cidrs: [10.96.0.0/16]}\n---\n\
                    apiVersion: networking.k8s.io/v1\nkind: IPAddress\nmetadata: {name: 10.96.0.1}\n";
        let objs = parse(Path::new("cidrs.yaml"), yaml).unwrap();
        assert_eq!(objs.len(), 1);
        let Object::ServiceCIDR(cidr) = &objs[0] else { panic!("{objs:?}") };
        assert_eq!(cidr.spec.as_ref().and_then(|s| s.cidrs.clone()), Some(vec!["10.96.0.0/16".to_string()]));
        // A type error names the field, as for the other kinds.
        let e = parse(Path::new("cidrs.yaml"), "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nspec: {cidrs: 10.96.0.0/16}\n").unwrap_err();
        assert!(e.reason.starts_with("spec.cidrs"), "{e}");
    }

    #[test]
    fn json_is_read_too() {
        let json = r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"j"},"spec":{"ports":[{"port":53,"protocol":"UDP"}]}}"#;
        assert_eq!(parse(Path::new("s.json"), json).unwrap().len(), 1);
    }

    #[test]
    fn syntax_error_names_file_and_line() {
        let bad = "apiVersion: v1\nkind: Service\nmetadata:\n  name: [unclosed\n";
        let e = parse(Path::new("/m/bad.yaml"), bad).unwrap_err();
        assert_eq!(e.path, "/m/bad.yaml");
        assert!(e.line >= 4, "{e}");
    }

    #[test]
    fn type_error_names_the_field_and_line() {
        let bad = "apiVersion: v1\nkind: Service\nmetadata:\n  name: web\nspec:\n  ports:\n  - port: eighty\n";
        let e = parse(Path::new("bad.yaml"), bad).unwrap_err();
        assert!(e.reason.starts_with("spec.ports[0].port"), "{e}");
        assert_eq!(e.line, 7, "{e}");
    }

    /// Kinds of the same name in other groups or versions, which are not ours.
    const LOOKALIKES: &str = r#"
apiVersion: serving.knative.dev/v1
kind: Service
metadata: {name: knative}
spec: {template: {spec: {containers: [{image: x}]}}}
---
apiVersion: discovery.k8s.io/v1beta1
kind: EndpointSlice
metadata: {name: old}
addressType: IPv4
endpoints: [{addresses: [10.244.0.12]}]
---
apiVersion: v1
kind: Node
metadata: {name: node-a}
---
apiVersion: networking.k8s.io/v1
kind: ServiceCIDR
metadata: {name: kubernetes}
spec: {cidrs: [10.96.0.0/16]}
"#;

    #[test]
    fn both_paths_read_the_same_objects() {
        for text in [GOOD, LOOKALIKES] {
            let fast = parse_fast(text).unwrap();
            let reporting = parse_reporting(Path::new("good.yaml"), text).unwrap();
            assert_eq!(format!("{fast:?}"), format!("{reporting:?}"));
        }
        let kinds: Vec<_> = parse_fast(LOOKALIKES).unwrap().iter().map(|o| format!("{o:?}")[..8].to_string()).collect();
        assert_eq!(kinds, ["Node(Nod", "ServiceC"]);
        // Keys before `kind` (buffered on the fast path) read the same too.
        let late_kind = "metadata: {name: late}\nspec: {clusterIP: 10.96.0.9, ports: [{port: 80}]}\napiVersion: v1\nkind: Service\n";
        let fast = parse_fast(late_kind).unwrap();
        assert!(matches!(&fast[..], [Object::Service(s)] if s.metadata.name.as_deref() == Some("late")), "{fast:?}");
        assert_eq!(format!("{fast:?}"), format!("{:?}", parse_reporting(Path::new("late.yaml"), late_kind).unwrap()));
        // A type error is no object on the fast path; the caller then reports it.
        assert!(parse_fast("apiVersion: v1\nkind: Service\nspec: {ports: [{port: x}]}\n").is_none());
    }

    #[test]
    fn document_without_kind_is_an_error() {
        let e = parse(Path::new("k.yaml"), "apiVersion: v1\nmetadata: {name: x}\n").unwrap_err();
        assert!(e.reason.contains("kind"), "{e}");
    }
}
