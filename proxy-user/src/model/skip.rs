//! What the model could not use, named by object, with a typed reason: the
//! labels of `ebpf_proxy_skipped_objects_total` and
//! `ebpf_proxy_invalid_objects` come from here, not from the message.

use std::fmt;

use crate::endpoint_slice::EndpointSlice;

/// The kind of object a problem is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ObjectKind {
    Service,
    EndpointSlice,
    ServiceCidr,
}

impl ObjectKind {
    pub fn label(self) -> &'static str {
        match self {
            ObjectKind::Service => "Service",
            ObjectKind::EndpointSlice => "EndpointSlice",
            ObjectKind::ServiceCidr => "ServiceCIDR",
        }
    }
}

/// Why something was skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SkipReason {
    /// A Service needs more entries than a map has room for.
    MapFull,
    /// An endpoint address that cannot be an endpoint (`endpoint_ips`), or
    /// not of its slice's address type.
    InvalidEndpoint,
    /// An address that does not parse.
    InvalidIp,
    InvalidCidr,
    PortOutOfRange,
    UnknownProtocol,
    UnknownIpMode,
    /// An `ebpf-proxy.io/lb-algorithm` annotation naming no algorithm.
    UnknownLbAlgorithm,
    /// A frontend another Service is served on (`precedence`).
    FrontendConflict,
    /// A slice without a Service (no label, or no such Service).
    MissingService,
    /// Defined twice: a Service, or an endpoint in two slices.
    Duplicate,
    MissingField,
}

impl SkipReason {
    pub fn label(self) -> &'static str {
        match self {
            SkipReason::MapFull => "map_full",
            SkipReason::InvalidEndpoint => "invalid_endpoint",
            SkipReason::InvalidIp => "invalid_ip",
            SkipReason::InvalidCidr => "invalid_cidr",
            SkipReason::PortOutOfRange => "port_out_of_range",
            SkipReason::UnknownProtocol => "unknown_protocol",
            SkipReason::UnknownIpMode => "unknown_ip_mode",
            SkipReason::UnknownLbAlgorithm => "unknown_lb_algorithm",
            SkipReason::FrontendConflict => "frontend_conflict",
            SkipReason::MissingService => "missing_service",
            SkipReason::Duplicate => "duplicate",
            SkipReason::MissingField => "missing_field",
        }
    }
}

/// Something in an object that was skipped: the object (`service ns/name`,
/// as the log names it), why, and a message saying what exactly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectError {
    pub kind: ObjectKind,
    pub object: String,
    pub why: SkipReason,
    pub reason: String,
}

impl ObjectError {
    pub fn service(namespace: &str, name: &str, why: SkipReason, reason: String) -> ObjectError {
        ObjectError { kind: ObjectKind::Service, object: format!("service {namespace}/{name}"), why, reason }
    }

    pub fn slice(slice: &EndpointSlice, why: SkipReason, reason: String) -> ObjectError {
        let ns = slice.metadata.namespace.as_deref().unwrap_or("default");
        let object = format!("endpointslice {ns}/{}", slice.metadata.name.as_deref().unwrap_or("?"));
        ObjectError { kind: ObjectKind::EndpointSlice, object, why, reason }
    }

    pub fn service_cidr(name: &str, why: SkipReason, reason: String) -> ObjectError {
        ObjectError { kind: ObjectKind::ServiceCidr, object: format!("servicecidr {name}"), why, reason }
    }
}

impl fmt::Display for ObjectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.object, self.reason)
    }
}
