//! The conformance data: kube-proxy's packet-flow tables transcribed as YAML
//! under `tests/conformance/<proxier>/<TestFunction>.yaml`, one file per test
//! function, holding real Kubernetes objects and the cases unchanged.

use std::{
    collections::BTreeSet,
    fmt,
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};
use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TestFile {
    pub source: Source,
    /// The kube-proxy test function, e.g. `TestLoadBalancer`.
    pub test: String,
    pub setups: Vec<Setup>,
}

/// Where the cases come from.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Source {
    pub file: String,
    pub repo: String,
    pub commit: Option<String>,
    /// The copy that was read, when not `repo` itself.
    pub stored_as: Option<String>,
    pub note: Option<String>,
}

/// One proxier built by the kube-proxy test: a `runPacketFlowTests` context.
/// Subtests (`t.Run`) are setups of their own, named `Test/subtest`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Setup {
    pub name: String,
    pub family: Family,
    pub config: Config,
    pub note: Option<String>,
    /// The first phase is the initial state; later ones are changes applied
    /// live (kube-proxy's tests delete a slice or a Service, sync, run again).
    pub phases: Vec<Phase>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum Family {
    IPv4,
    IPv6,
}

/// The proxier settings the kube-proxy test used.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Config {
    /// `--nodeport-addresses`; none means every node address.
    pub node_port_addresses: Option<Vec<String>>,
    pub masquerade_all: bool,
    /// false: the test replaced the pod-CIDR local-traffic detector with a
    /// no-op one, which is `--cluster-cidr` left unset.
    pub local_detector: bool,
    /// iptables' `--iptables-localhost-nodeports`: `--localhost-nodeports`.
    pub localhost_node_ports: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Phase {
    pub name: String,
    /// Services and EndpointSlices as the API would serve them.
    pub objects: Vec<serde_yaml::Value>,
    pub cases: Vec<Case>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Case {
    pub name: String,
    #[serde(rename = "sourceIP")]
    pub source_ip: IpAddr,
    pub protocol: Protocol,
    #[serde(rename = "destIP")]
    pub dest_ip: IpAddr,
    pub dest_port: u16,
    /// As kube-proxy's test writes it: "IP:port, IP:port", REJECT, DROP,
    /// ACCEPT, or "" for a packet the proxy leaves alone.
    pub output: String,
    pub masq: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum Protocol {
    TCP,
    UDP,
    SCTP,
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Protocol::TCP => "tcp",
            Protocol::UDP => "udp",
            Protocol::SCTP => "sctp",
        })
    }
}

/// What a case expects, parsed from `output`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expect {
    /// Only these endpoints may answer (and, when several, more than one does).
    Endpoints(BTreeSet<SocketAddr>),
    Reject,
    Drop,
    /// Delivered to the node itself (a health-check NodePort).
    Accept,
    /// Not translated: no endpoint may answer.
    Untouched,
}

impl Case {
    pub fn expect(&self) -> Result<Expect> {
        Ok(match self.output.trim() {
            "" => Expect::Untouched,
            "REJECT" => Expect::Reject,
            "DROP" => Expect::Drop,
            "ACCEPT" => Expect::Accept,
            list => Expect::Endpoints(
                list.split(',')
                    .map(|s| s.trim().parse::<SocketAddr>().with_context(|| format!("endpoint {s:?} in output {list:?}")))
                    .collect::<Result<_>>()?,
            ),
        })
    }
}

/// Every file under `dir/*/`, sorted, as (proxier, file).
pub fn load_dir(dir: &Path) -> Result<Vec<(String, PathBuf, TestFile)>> {
    let mut paths = Vec::new();
    for kind in std::fs::read_dir(dir).with_context(|| format!("read {}", dir.display()))? {
        let kind = kind?.path();
        if !kind.is_dir() {
            continue;
        }
        for f in std::fs::read_dir(&kind)? {
            let f = f?.path();
            if f.extension().is_some_and(|e| e == "yaml") {
                paths.push(f);
            }
        }
    }
    paths.sort();
    paths
        .into_iter()
        .map(|p| {
            let kind = p.parent().and_then(|k| k.file_name()).unwrap().to_string_lossy().into_owned();
            let text = std::fs::read_to_string(&p).with_context(|| format!("read {}", p.display()))?;
            let file: TestFile = serde_yaml::from_str(&text).with_context(|| format!("parse {}", p.display()))?;
            for s in &file.setups {
                for ph in &s.phases {
                    for c in &ph.cases {
                        c.expect().with_context(|| format!("{}: {} / {}", p.display(), s.name, c.name))?;
                    }
                }
            }
            Ok((kind, p, file))
        })
        .collect()
}
