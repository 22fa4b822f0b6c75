//! `ebpf-proxy dump`: what the pinned maps hold, by name and address rather
//! than by raw ID. Reads the pins directly, so it works with the agent stopped.

use std::{collections::BTreeMap, net::SocketAddr, path::Path};

use anyhow::Result;
use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use proxy_common::*;
use serde::Serialize;

use crate::maps::Maps;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    Table,
    Json,
}

#[derive(Debug, Serialize, PartialEq, Eq, PartialOrd, Ord)]
pub struct ServiceRow {
    pub service: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub frontend: String,
    /// Which clients this row is for: `internal` (in-cluster sources) or `external`.
    pub scope: String,
    /// Which endpoints serve it: `Cluster` (every usable one) or `Local` (this node's).
    pub policy: &'static str,
    /// New flows get the node's address as source (kube-proxy's masquerade).
    pub masquerade: bool,
    /// Only sources in loadBalancerSourceRanges may connect; others are dropped.
    pub source_ranges: bool,
    /// sessionAffinity ClientIP timeout; 0 = no affinity.
    pub affinity_timeout_seconds: u32,
    /// How a new flow picks its backend: `random` or `maglev`.
    pub algorithm: &'static str,
    /// What a packet gets while `backends` is empty: REJECT (no endpoint at
    /// all) or DROP (endpoints exist, none for this policy).
    pub if_no_backends: &'static str,
    pub backends: Vec<BackendRef>,
}

#[derive(Debug, Serialize, PartialEq, Eq, PartialOrd, Ord)]
pub struct BackendRef {
    pub address: String,
    pub state: Vec<&'static str>,
}

#[derive(Debug, Serialize)]
pub struct BackendRow {
    pub id: u32,
    pub address: String,
    pub protocol: &'static str,
    pub state: Vec<&'static str>,
    pub services: Vec<String>,
}

#[derive(Debug, Serialize)]
pub struct ConntrackRow {
    pub direction: &'static str,
    /// `confirmed` once the flow completed its TCP handshake or, for UDP and
    /// SCTP, was answered; `unconfirmed` entries live in the table a flood
    /// turns over, and lapse after 30 s idle, giving up their masquerade port.
    pub state: &'static str,
    pub protocol: &'static str,
    pub source: String,
    pub destination: String,
    /// ORIGINAL: the backend the destination becomes; REPLY: the frontend the source becomes.
    pub translated_to: String,
    /// The flow leaves with the node's address as source (kube-proxy's masquerade).
    pub masquerade: bool,
    /// REPLY of a masqueraded flow: the client the reply is sent back to.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client: Option<String>,
    /// ORIGINAL of a masqueraded flow: the node's address and port it leaves
    /// with, once its first packet went out (the same as its REPLY entry's
    /// destination).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub masquerade_source: Option<String>,
    pub service: String,
    pub age_seconds: f64,
    pub idle_seconds: f64,
}

pub fn protocol_name(proto: u8) -> &'static str {
    match proto {
        IPPROTO_TCP => "TCP",
        IPPROTO_UDP => "UDP",
        IPPROTO_SCTP => "SCTP",
        _ => "?",
    }
}

pub fn kind_name(kind: u8) -> &'static str {
    match kind {
        KIND_CLUSTER_IP => "ClusterIP",
        KIND_NODE_PORT => "NodePort",
        KIND_EXTERNAL_IP => "ExternalIP",
        KIND_LOAD_BALANCER => "LoadBalancer",
        _ => "?",
    }
}

/// A frontend's backend choice, by its flags.
pub fn algorithm_name(flags: u8) -> &'static str {
    if flags & SVC_MAGLEV != 0 { "maglev" } else { "random" }
}

fn scope_name(scope: u8) -> &'static str {
    if scope == SCOPE_EXTERNAL { "external" } else { "internal" }
}

fn policy_name(policy: u8) -> &'static str {
    if policy == POLICY_LOCAL { "Local" } else { "Cluster" }
}

fn state_names(flags: u8) -> Vec<&'static str> {
    let mut s = Vec::new();
    for (bit, name) in [
        (BACKEND_READY, "ready"),
        (BACKEND_SERVING, "serving"),
        (BACKEND_TERMINATING, "terminating"),
        (BACKEND_LOCAL, "local"),
    ] {
        if flags & bit != 0 {
            s.push(name);
        }
    }
    s
}

fn endpoint(addr: Addr, port_be: u16) -> String {
    SocketAddr::new(addr.to_ip(), u16::from_be(port_be)).to_string()
}

pub fn services(maps: &Maps) -> Result<Vec<ServiceRow>> {
    let c = maps.read_contents()?;
    let mut rows: Vec<ServiceRow> = c
        .frontends
        .iter()
        // Port 0, protocol 0: the marker of an allocated ClusterIP, not a frontend.
        .filter(|(key, _)| !(key.port == 0 && key.proto == 0))
        .map(|(key, entry)| {
            let name = c.names.get(&entry.service_id);
            let backends = (0..entry.backend_count)
                .filter_map(|slot| c.slots.get(&SlotKey { service_id: entry.service_id, slot }))
                .filter_map(|id| c.backends.get(id))
                .map(|b| BackendRef { address: endpoint(b.addr, b.port), state: state_names(b.flags) })
                .collect();
            ServiceRow {
                service: name.map_or_else(|| format!("<id {}>", entry.service_id), |n| n.0.clone()),
                kind: kind_name(entry.kind).into(),
                frontend: format!("{}/{}", endpoint(key.addr, key.port), protocol_name(key.proto)),
                scope: scope_name(key.scope).into(),
                policy: policy_name(name.map_or(POLICY_CLUSTER, |n| n.1)),
                masquerade: entry.flags & SVC_MASQUERADE != 0,
                source_ranges: entry.flags & SVC_SOURCE_RANGES != 0,
                affinity_timeout_seconds: entry.affinity_timeout_s,
                algorithm: algorithm_name(entry.flags),
                if_no_backends: if entry.flags & SVC_DROP_IF_EMPTY != 0 { "DROP" } else { "REJECT" },
                backends,
            }
        })
        .collect();
    rows.sort();
    Ok(rows)
}

pub fn backends(maps: &Maps) -> Result<Vec<BackendRow>> {
    let c = maps.read_contents()?;
    let mut users: BTreeMap<u32, Vec<String>> = BTreeMap::new();
    for (slot, id) in &c.slots {
        if let Some((name, _)) = c.names.get(&slot.service_id) {
            let list = users.entry(*id).or_default();
            if !list.contains(name) {
                list.push(name.clone());
            }
        }
    }
    let mut rows: Vec<BackendRow> = c
        .backends
        .iter()
        .map(|(id, b)| BackendRow {
            id: *id,
            address: endpoint(b.addr, b.port),
            protocol: protocol_name(b.proto),
            state: state_names(b.flags),
            services: users.remove(id).map(|mut v| {
                v.sort();
                v
            }).unwrap_or_default(),
        })
        .collect();
    rows.sort_by_key(|r| r.id);
    Ok(rows)
}

pub fn conntrack(maps: &Maps) -> Result<Vec<ConntrackRow>> {
    let names = maps.read_contents()?.names;
    let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)?;
    let now_ns = now.tv_sec() as u64 * 1_000_000_000 + now.tv_nsec() as u64;
    let secs = |t: u64| now_ns.saturating_sub(t) as f64 / 1e9;
    let mut rows = Vec::new();
    let tables = [("confirmed", &maps.conntrack), ("unconfirmed", &maps.ct_unconfirmed)];
    for (state, kv) in tables.into_iter().flat_map(|(state, map)| map.iter().map(move |kv| (state, kv))) {
        let (k, v) = kv?;
        rows.push(ConntrackRow {
            direction: if v.direction == CT_REPLY { "reply" } else { "original" },
            state,
            protocol: protocol_name(k.proto),
            source: endpoint(k.src, k.sport),
            destination: endpoint(k.dst, k.dport),
            translated_to: endpoint(v.nat_addr, v.nat_port),
            masquerade: v.flags & CT_MASQUERADE != 0,
            client: (v.direction == CT_REPLY && v.flags & CT_MASQUERADE != 0).then(|| endpoint(v.rev_addr, v.rev_port)),
            // Port 0: masquerade has not chosen the flow's source yet.
            masquerade_source: (v.direction != CT_REPLY && v.flags & CT_MASQUERADE != 0 && v.rev_port != 0)
                .then(|| endpoint(v.rev_addr, v.rev_port)),
            service: names.get(&v.service_id).map_or_else(|| format!("<id {}>", v.service_id), |n| n.0.clone()),
            age_seconds: (secs(v.created_ns) * 10.0).round() / 10.0,
            idle_seconds: (secs(v.last_seen_ns) * 10.0).round() / 10.0,
        });
    }
    // Both directions of a flow next to each other: by service, then client.
    let key = |r: &ConntrackRow| {
        let client = if r.direction == "reply" { &r.destination } else { &r.source };
        (r.service.clone(), client.clone(), r.direction)
    };
    rows.sort_by_cached_key(key);
    Ok(rows)
}

/// Masquerade's ports: how many flows hold one, and how often masquerade
/// ran out (`snat_port_shared`: a TCP tuple still reserved for a closed
/// flow, or a UDP/SCTP port inside the ephemeral range, was shared;
/// `snat_failed`: a packet left un-masqueraded).
pub fn masquerade_summary(rows: &[ConntrackRow], counters: &[u64]) -> String {
    let held = |state: &str| rows.iter().filter(|r| r.client.is_some() && r.state == state).count();
    format!(
        "masquerade ports held: {} by confirmed flows, {} by unconfirmed ones; out of ports: {} shared, {} failed",
        held("confirmed"),
        held("unconfirmed"),
        counters[proxy_common::Counter::SnatPortShared as usize],
        counters[proxy_common::Counter::SnatFailed as usize],
    )
}

fn table(header: &[&str], rows: impl IntoIterator<Item = Vec<String>>) -> String {
    let mut t = Table::new();
    t.load_style(UTF8_FULL_CONDENSED).set_header(header.to_vec());
    for r in rows {
        t.add_row(r);
    }
    t.to_string()
}

pub fn print(what: crate::cli::DumpWhat, output: Output, root: &Path) -> Result<()> {
    use crate::cli::DumpWhat;
    let maps = Maps::open_pinned(root)?;
    let text = match (what, output) {
        (DumpWhat::Services, Output::Json) => serde_json::to_string_pretty(&services(&maps)?)?,
        (DumpWhat::Backends, Output::Json) => serde_json::to_string_pretty(&backends(&maps)?)?,
        (DumpWhat::Conntrack, Output::Json) => serde_json::to_string_pretty(&conntrack(&maps)?)?,
        (DumpWhat::Services, Output::Table) => table(
            &["SERVICE", "TYPE", "FRONTEND", "SCOPE", "POLICY", "LB", "FLAGS", "BACKENDS"],
            services(&maps)?.into_iter().map(|r| {
                let backends = if r.backends.is_empty() {
                    format!("(none: {})", r.if_no_backends)
                } else {
                    r.backends.iter().map(|b| format!("{} ({})", b.address, b.state.join(","))).collect::<Vec<_>>().join("\n")
                };
                let mut flags = Vec::new();
                if r.masquerade {
                    flags.push("masquerade".to_string());
                }
                if r.source_ranges {
                    flags.push("source-ranges".to_string());
                }
                if r.affinity_timeout_seconds > 0 {
                    flags.push(format!("affinity {}s", r.affinity_timeout_seconds));
                }
                vec![r.service, r.kind, r.frontend, r.scope, r.policy.into(), r.algorithm.into(), flags.join("\n"), backends]
            }),
        ),
        (DumpWhat::Backends, Output::Table) => table(
            &["ID", "BACKEND", "PROTO", "STATE", "SERVICES"],
            backends(&maps)?.into_iter().map(|r| {
                vec![r.id.to_string(), r.address, r.protocol.into(), r.state.join(","), r.services.join("\n")]
            }),
        ),
        (DumpWhat::Conntrack, Output::Table) => {
            let rows = conntrack(&maps)?;
            let summary = masquerade_summary(&rows, &maps.read_counters()?);
            let header = ["SERVICE", "DIR", "STATE", "PROTO", "SOURCE", "DESTINATION", "TRANSLATED TO", "MASQ", "AGE", "IDLE"];
            let t = table(&header, rows.into_iter().map(|r| {
                let translated = match (&r.client, &r.masquerade_source) {
                    (Some(client), _) => format!("{}\nto client {client}", r.translated_to),
                    (None, Some(source)) => format!("{}\nfrom {source}", r.translated_to),
                    (None, None) => r.translated_to,
                };
                vec![
                    r.service,
                    r.direction.into(),
                    r.state.into(),
                    r.protocol.into(),
                    r.source,
                    r.destination,
                    translated,
                    if r.masquerade { "yes" } else { "" }.into(),
                    format!("{:.1}s", r.age_seconds),
                    format!("{:.1}s", r.idle_seconds),
                ]
            }));
            format!("{t}\n{summary}")
        }
    };
    println!("{text}");
    Ok(())
}
