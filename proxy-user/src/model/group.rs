//! A snapshot's objects by Service, and what cannot be tied to one.

use std::{
    collections::{BTreeMap, HashMap},
    sync::Arc,
};

use k8s_openapi::api::core::v1::Service;

use super::{ObjectError, SkipReason};
use crate::{endpoint_slice::EndpointSlice, source::Snapshot};

/// The label that ties an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// A Service's `(namespace, name)`, borrowed from the snapshot.
pub type ServiceKey<'a> = (&'a str, &'a str);

/// A snapshot's objects by Service: the one Service object of each
/// `namespace/name` (the last, if the snapshot holds several), the
/// EndpointSlices labelled for it, and what could not be tied to a Service.
pub struct Grouped<'a> {
    pub services: BTreeMap<ServiceKey<'a>, &'a Arc<Service>>,
    pub slices: HashMap<ServiceKey<'a>, Vec<&'a Arc<EndpointSlice>>>,
    pub errors: Vec<ObjectError>,
}

pub fn group(snapshot: &Snapshot) -> Grouped<'_> {
    let mut errors = Vec::new();
    let mut slices: HashMap<ServiceKey, Vec<&Arc<EndpointSlice>>> = HashMap::new();
    for slice in &snapshot.slices {
        match slice_owner(slice) {
            Some(key) => slices.entry(key).or_default().push(slice),
            None => errors.push(unlabelled_slice(slice)),
        }
    }
    let mut services = BTreeMap::new();
    for svc in &snapshot.services {
        let key = service_key(svc);
        if services.insert(key, svc).is_some() {
            errors.push(duplicate_service(key));
        }
    }
    let mut orphans: Vec<(&ServiceKey, &Vec<&Arc<EndpointSlice>>)> =
        slices.iter().filter(|(key, _)| !services.contains_key(*key)).collect();
    orphans.sort_by_key(|(key, _)| **key);
    for (key, list) in orphans {
        errors.extend(list.iter().map(|slice| orphan_slice(*key, slice)));
    }
    Grouped { services, slices, errors }
}

/// The key of the Service a slice belongs to, from its label.
pub fn slice_owner(slice: &EndpointSlice) -> Option<ServiceKey<'_>> {
    let ns = slice.metadata.namespace.as_deref().unwrap_or("default");
    slice.service_name.as_deref().map(|svc| (ns, svc))
}

pub fn service_key(svc: &Service) -> ServiceKey<'_> {
    (svc.metadata.namespace.as_deref().unwrap_or("default"), svc.metadata.name.as_deref().unwrap_or(""))
}

pub fn unlabelled_slice(slice: &EndpointSlice) -> ObjectError {
    ObjectError::slice(slice, SkipReason::MissingService, format!("no {SERVICE_NAME_LABEL} label; ignored"))
}

pub fn duplicate_service(key: ServiceKey) -> ObjectError {
    ObjectError::service(key.0, key.1, SkipReason::Duplicate, "defined more than once; the last definition is used".into())
}

pub fn orphan_slice(key: ServiceKey, slice: &EndpointSlice) -> ObjectError {
    let reason = format!("no such service {}/{}; ignored until it exists", key.0, key.1);
    ObjectError::slice(slice, SkipReason::MissingService, reason)
}
