//! Which of a service port's endpoints serve: every endpoint once, with its
//! conditions, validated (`endpoint_ips`), then kube-proxy's
//! CategorizeEndpoints with topology hints.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use ipnet::IpNet;
use proxy_common::{
    BACKEND_LOCAL, BACKEND_READY, BACKEND_SERVING, BACKEND_TERMINATING, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP,
};

use super::{DesiredBackend, ModelConfig, ObjectError, SkipReason};
use crate::{
    endpoint_ips,
    endpoint_slice::{Endpoint, EndpointSlice},
    topology::{self, Hints},
};

/// kube-proxy's CategorizeEndpoints: the cluster set (ready and in this
/// node's topology, else serving-terminating), the local set (this node's ready, else its
/// serving-terminating) and whether any endpoint is usable at all.
pub(super) struct Categorized {
    pub cluster: Vec<DesiredBackend>,
    pub local: Vec<DesiredBackend>,
    pub any: bool,
}

pub(super) fn categorize(
    all: &[DesiredBackend],
    uses_local: bool,
    hints: &BTreeMap<(IpAddr, u16), Hints>,
    node_name: &str,
    zone: &str,
) -> Categorized {
    let ready = |b: &&DesiredBackend| b.flags & BACKEND_READY != 0;
    let serving_terminating = |b: &&DesiredBackend| b.flags & BACKEND_SERVING != 0 && b.flags & BACKEND_TERMINATING != 0;
    let is_local = |b: &&DesiredBackend| b.flags & BACKEND_LOCAL != 0;
    let pick = |f: &dyn Fn(&&DesiredBackend) -> bool| all.iter().filter(f).copied().collect::<Vec<_>>();
    let no_hints = Hints::default();
    let hints_of = |b: &DesiredBackend| hints.get(&(b.addr, b.port)).unwrap_or(&no_hints);
    let mode = topology::mode(all.iter().filter(ready).map(hints_of), node_name, zone);
    let mut cluster = pick(&|b| ready(b) && topology::available(hints_of(b), mode, node_name, zone));
    if cluster.is_empty() {
        cluster = pick(&serving_terminating);
    }
    let mut local = Vec::new();
    if uses_local {
        local = pick(&|b| is_local(b) && ready(b));
        if local.is_empty() {
            local = pick(&|b| is_local(b) && serving_terminating(b));
        }
    }
    let any = all.iter().any(|b| ready(&b) || serving_terminating(&b));
    Categorized { cluster, local, any }
}

/// Every endpoint of a service port, once (by address and port), with its
/// conditions as flags, and its topology hints; `categorize` decides which
/// ones serve. Addresses that cannot be endpoints (`endpoint_ips`) are
/// skipped, the rest of their slice kept.
pub(super) fn select_endpoints(
    slices: &[&EndpointSlice],
    port_name: &str,
    proto: u8,
    ipv6: bool,
    config: &ModelConfig,
    service_cidrs: &BTreeSet<IpNet>,
    errors: &mut Vec<ObjectError>,
) -> (Vec<DesiredBackend>, BTreeMap<(IpAddr, u16), Hints>) {
    let mut hints: BTreeMap<(IpAddr, u16), Hints> = BTreeMap::new();
    // Which slice listed each endpoint first, to report it listed again elsewhere.
    let mut listed_in: BTreeMap<(IpAddr, u16), &str> = BTreeMap::new();
    // Keyed by address and port: the same endpoint in two slices counts once.
    let mut all: BTreeMap<(IpAddr, u16), DesiredBackend> = BTreeMap::new();
    for slice in slices {
        // FQDN slices (deprecated) are not proxied, as in kube-proxy.
        if slice.address_type != if ipv6 { "IPv6" } else { "IPv4" } {
            continue;
        }
        // The slice's port carries the resolved targetPort (named ports included).
        let Some(port) = slice.ports.iter().flatten().find(|p| {
            p.name.as_deref().unwrap_or("") == port_name && protocol_of(p.protocol.as_deref()) == Some(proto)
        }) else {
            continue;
        };
        let Some(port_num) = port.port.and_then(|p| u16::try_from(p).ok()).filter(|p| *p != 0) else {
            let reason = format!("port {port_name:?}: missing or out of range; skipped");
            errors.push(ObjectError::slice(slice, SkipReason::PortOutOfRange, reason));
            continue;
        };
        for ep in &slice.endpoints {
            let Some(addr) = ep.address.as_deref() else { continue };
            // A bad address is reported once, not once per service port.
            let mut skip = |why: SkipReason, reason: String| {
                let error = ObjectError::slice(slice, why, reason);
                if !errors.contains(&error) {
                    errors.push(error);
                }
            };
            let addr = match addr.parse::<IpAddr>() {
                Ok(ip) if ip.is_ipv6() == ipv6 => ip,
                Ok(_) => {
                    skip(SkipReason::InvalidEndpoint, format!("endpoint address {addr} is not of the slice's addressType {}; skipped", slice.address_type));
                    continue;
                }
                Err(_) => {
                    skip(SkipReason::InvalidIp, format!("invalid endpoint address {addr:?}; skipped"));
                    continue;
                }
            };
            if let Some(why) = endpoint_ips::refused(addr, service_cidrs) {
                skip(SkipReason::InvalidEndpoint, format!("endpoint address {addr} refused: {why}; skipped"));
                continue;
            }
            let backend = DesiredBackend { addr, port: port_num, proto, flags: endpoint_flags(ep, config) };
            let this_slice = slice.metadata.name.as_deref().unwrap_or("?");
            let first = *listed_in.entry((addr, port_num)).or_insert(this_slice);
            if first != this_slice {
                let reason = format!("endpoint {addr}:{port_num} duplicates one in endpointslice {first}; counted once");
                errors.push(ObjectError::slice(slice, SkipReason::Duplicate, reason));
            }
            all.entry((addr, port_num))
                .and_modify(|b| b.flags |= backend.flags)
                .or_insert(backend);
            hints.entry((addr, port_num)).or_default().merge(&Hints::of(ep));
        }
    }
    (all.into_values().collect(), hints)
}

/// A Kubernetes protocol name (unset means TCP) as an IP protocol number.
pub(super) fn protocol_of(p: Option<&str>) -> Option<u8> {
    match p.unwrap_or("TCP") {
        "TCP" => Some(IPPROTO_TCP),
        "UDP" => Some(IPPROTO_UDP),
        "SCTP" => Some(IPPROTO_SCTP),
        _ => None,
    }
}

/// Conditions as the EndpointSlice API defines their defaults: ready unset
/// means ready, serving unset means "as ready", terminating unset means no.
pub fn endpoint_flags(ep: &Endpoint, config: &ModelConfig) -> u8 {
    let c = ep.conditions.as_ref();
    let ready = c.and_then(|c| c.ready).unwrap_or(true);
    let serving = c.and_then(|c| c.serving).unwrap_or(ready);
    let terminating = c.and_then(|c| c.terminating).unwrap_or(false);
    let local = !config.node_name.is_empty() && ep.node_name.as_deref() == Some(config.node_name.as_str());
    let mut flags = 0;
    if ready {
        flags |= BACKEND_READY;
    }
    if serving {
        flags |= BACKEND_SERVING;
    }
    if terminating {
        flags |= BACKEND_TERMINATING;
    }
    if local {
        flags |= BACKEND_LOCAL;
    }
    flags
}
