//! kube-proxy's rule sets for a [`ServiceSet`], generated in the shape its
//! proxiers write them (pkg/proxy/iptables/proxier.go and
//! pkg/proxy/nftables/proxier.go), so the peers are measured with the cost
//! structure operators actually run:
//!
//! - iptables: PREROUTING/OUTPUT -> KUBE-SERVICES, one rule per service port
//!   matching ClusterIP and port -> KUBE-SVC-* (`! -s <cluster CIDR>` ->
//!   KUBE-MARK-MASQ, then one `statistic --mode random --probability 1/(n-i)`
//!   rule per endpoint) -> KUBE-SEP-* (hairpin mark, DNAT); KUBE-POSTROUTING
//!   masquerades marked packets; the filter table's KUBE-FORWARD. NodePorts:
//!   the last KUBE-SERVICES rule (destination a local address) ->
//!   KUBE-NODEPORTS -> KUBE-EXT-* (KUBE-MARK-MASQ, then the KUBE-SVC-* chain).
//! - nftables: one table `kube-proxy`, the `services` chain does a single
//!   `ip daddr . meta l4proto . th dport vmap @service-ips` lookup, the service
//!   chain picks an endpoint with `numgen random mod N vmap`, the endpoint
//!   chain DNATs; masquerading as above. NodePorts: `fib daddr type local`
//!   then the `service-nodeports` verdict map -> external-* (mark for
//!   masquerade, then the service chain).
//!
//! Chain names use a hash of the service port name as kube-proxy does, with
//! a different (shorter) hash: the names only need to be unique.

use std::fmt::Write as _;

use super::services::{
    Service, ServiceSet, TCP_NODE_PORT, TCP_PORT, TCP_TARGET, UDP_NODE_PORT, UDP_PORT, UDP_TARGET,
};

/// Pod CIDR given to the rule sets: pod-to-service traffic is not masqueraded.
pub const CLUSTER_CIDR: &str = "10.244.0.0/16";

/// One service port of a Service: what kube-proxy calls a ServicePortName.
struct Port<'a> {
    svc: &'a Service,
    port_name: &'static str,
    proto: &'static str,
    port: u16,
    target: u16,
    /// The NodePort, for a Service of that type.
    node_port: Option<u16>,
}

fn ports(svc: &Service) -> Vec<Port<'_>> {
    let mut ports = Vec::new();
    if svc.tcp {
        let node_port = svc.node_port.then_some(TCP_NODE_PORT);
        ports.push(Port { svc, port_name: "tcp", proto: "tcp", port: TCP_PORT, target: TCP_TARGET, node_port });
    }
    if svc.udp {
        let node_port = svc.node_port.then_some(UDP_NODE_PORT);
        ports.push(Port { svc, port_name: "udp", proto: "udp", port: UDP_PORT, target: UDP_TARGET, node_port });
    }
    ports
}

impl Port<'_> {
    fn name(&self) -> String {
        format!("{}/{}:{}", self.svc.namespace, self.svc.name, self.port_name)
    }
    /// kube-proxy: base32(sha256(name + protocol))[:16]; FNV-1a here.
    fn hash(&self, extra: &str) -> String {
        let mut h: u64 = 0xcbf29ce484222325;
        for b in self.name().bytes().chain(self.proto.bytes()).chain(extra.bytes()) {
            h = (h ^ u64::from(b)).wrapping_mul(0x100000001b3);
        }
        format!("{h:016X}")
    }
}

/// An `iptables-restore` input (nat and filter tables).
pub fn iptables_restore(set: &ServiceSet) -> String {
    let mut nat = String::with_capacity(set.services.len() * 4000);
    let mut chains = String::new();
    let _ = writeln!(chains, "*nat");
    for c in ["KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING", "KUBE-MARK-MASQ"] {
        let _ = writeln!(chains, ":{c} - [0:0]");
    }
    let comment = |s: &str| format!("-m comment --comment \"{s}\"");
    let _ = writeln!(nat, "-A PREROUTING {} -j KUBE-SERVICES", comment("kubernetes service portals"));
    let _ = writeln!(nat, "-A OUTPUT {} -j KUBE-SERVICES", comment("kubernetes service portals"));
    let _ = writeln!(nat, "-A POSTROUTING {} -j KUBE-POSTROUTING", comment("kubernetes postrouting rules"));
    let _ = writeln!(nat, "-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN");
    let _ = writeln!(nat, "-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000");
    let _ = writeln!(
        nat,
        "-A KUBE-POSTROUTING {} -j MASQUERADE --random-fully",
        comment("kubernetes service traffic requiring SNAT")
    );
    let _ = writeln!(nat, "-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000");
    let mut per_service = String::new();
    for svc in &set.services {
        for p in ports(svc) {
            let svc_chain = format!("KUBE-SVC-{}", p.hash(""));
            let name = p.name();
            let _ = writeln!(chains, ":{svc_chain} - [0:0]");
            let _ = writeln!(
                nat,
                "-A KUBE-SERVICES {} -m {proto} -p {proto} -d {ip}/32 --dport {port} -j {svc_chain}",
                comment(&format!("{name} cluster IP")),
                proto = p.proto,
                ip = svc.cluster_ip,
                port = p.port,
            );
            let _ = writeln!(
                per_service,
                "-A {svc_chain} {} -m {proto} -p {proto} -d {ip}/32 --dport {port} ! -s {CLUSTER_CIDR} -j KUBE-MARK-MASQ",
                comment(&format!("{name} cluster IP")),
                proto = p.proto,
                ip = svc.cluster_ip,
                port = p.port,
            );
            if let Some(np) = p.node_port {
                // External traffic to a NodePort (externalTrafficPolicy Cluster) is masqueraded.
                let ext = format!("KUBE-EXT-{}", p.hash(""));
                let _ = writeln!(chains, ":{ext} - [0:0]");
                let _ = writeln!(
                    nat,
                    "-A KUBE-NODEPORTS {} -m {proto} -p {proto} --dport {np} -j {ext}",
                    comment(&name),
                    proto = p.proto
                );
                let _ = writeln!(
                    per_service,
                    "-A {ext} {} -j KUBE-MARK-MASQ",
                    comment(&format!("masquerade traffic for {name} external destinations"))
                );
                let _ = writeln!(per_service, "-A {ext} -j {svc_chain}");
            }
            let n = svc.endpoints.len();
            for (i, ep) in svc.endpoints.iter().enumerate() {
                let sep = format!("KUBE-SEP-{}", p.hash(&ep.to_string()));
                let _ = writeln!(chains, ":{sep} - [0:0]");
                let to = format!("{name} -> {ep}:{}", p.target);
                if i + 1 < n {
                    let _ = writeln!(
                        per_service,
                        "-A {svc_chain} {} -m statistic --mode random --probability {:.10} -j {sep}",
                        comment(&to),
                        1.0 / (n - i) as f64
                    );
                } else {
                    let _ = writeln!(per_service, "-A {svc_chain} {} -j {sep}", comment(&to));
                }
                let _ = writeln!(per_service, "-A {sep} {} -s {ep}/32 -j KUBE-MARK-MASQ", comment(&name));
                let _ = writeln!(
                    per_service,
                    "-A {sep} {} -m {proto} -p {proto} -j DNAT --to-destination {ep}:{target}",
                    comment(&name),
                    proto = p.proto,
                    target = p.target,
                );
            }
        }
    }
    let _ = writeln!(
        nat,
        "-A KUBE-SERVICES {} -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS",
        comment("kubernetes service nodeports; NOTE: this must be the last rule in this chain")
    );
    let mut out = chains;
    out.push_str(&nat);
    out.push_str(&per_service);
    out.push_str("COMMIT\n");
    out.push_str(
        "*filter\n:KUBE-FORWARD - [0:0]\n:KUBE-SERVICES - [0:0]\n:KUBE-PROXY-FIREWALL - [0:0]\n\
         -A FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL\n\
         -A FORWARD -m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD\n\
         -A FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
         -A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP\n\
         -A KUBE-FORWARD -m comment --comment \"kubernetes forwarding rules\" -m mark --mark 0x4000/0x4000 -j ACCEPT\n\
         -A KUBE-FORWARD -m comment --comment \"kubernetes forwarding conntrack rule\" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT\n\
         COMMIT\n",
    );
    out
}

/// An `nft -f` script: the `ip kube-proxy` table.
pub fn nftables_script(set: &ServiceSet) -> String {
    let mut s = String::with_capacity(set.services.len() * 4000);
    // Chain names hold '/', which nft takes in a bare name after the first character.
    s.push_str(&format!(
        r#"table ip kube-proxy {{
  comment "rules for kube-proxy"
  map service-ips {{
    type ipv4_addr . inet_proto . inet_service : verdict
    comment "ClusterIP, ExternalIP and LoadBalancer IP traffic"
  }}
  map service-nodeports {{
    type inet_proto . inet_service : verdict
    comment "NodePort traffic"
  }}
  map no-endpoint-services {{
    type ipv4_addr . inet_proto . inet_service : verdict
    comment "vmap to drop or reject packets to services with no endpoints"
  }}
  chain filter-prerouting {{
    type filter hook prerouting priority dstnat - 10;
    ct state new jump firewall-check
  }}
  chain filter-forward {{
    type filter hook forward priority -110;
    ct state new jump service-endpoints-check
    ct state new jump cluster-ips-check
  }}
  chain firewall-check {{
  }}
  chain service-endpoints-check {{
    ip daddr . meta l4proto . th dport vmap @no-endpoint-services
  }}
  chain cluster-ips-check {{
  }}
  chain mark-for-masquerade {{
    mark set mark or 0x4000
  }}
  chain masquerading {{
    mark and 0x4000 == 0 return
    mark set mark xor 0x4000
    masquerade fully-random
  }}
  chain services {{
    ip daddr . meta l4proto . th dport vmap @service-ips
    fib daddr type local ip daddr != 127.0.0.0/8 meta l4proto . th dport vmap @service-nodeports
  }}
  chain nat-prerouting {{
    type nat hook prerouting priority dstnat;
    jump services
  }}
  chain nat-output {{
    type nat hook output priority -100;
    jump services
  }}
  chain nat-postrouting {{
    type nat hook postrouting priority srcnat;
    jump masquerading
  }}
}}
"#
    ));
    let mut elements = Vec::new();
    for svc in &set.services {
        for p in ports(svc) {
            let svc_chain = format!("service-{}-{}/{}/{}/p{}", &p.hash("")[..8], svc.namespace, svc.name, p.proto, p.port);
            let mut ep_chains = Vec::new();
            for ep in &svc.endpoints {
                let chain = format!(
                    "endpoint-{}-{}/{}/{}/p{}__{ep}/{}",
                    &p.hash(&ep.to_string())[..8],
                    svc.namespace,
                    svc.name,
                    p.proto,
                    p.port,
                    p.target
                );
                let _ = writeln!(
                    s,
                    "add chain ip kube-proxy {chain}\nadd rule ip kube-proxy {chain} ip saddr {ep} jump mark-for-masquerade\n\
                     add rule ip kube-proxy {chain} meta l4proto {proto} dnat to {ep}:{target}",
                    proto = p.proto,
                    target = p.target
                );
                ep_chains.push(chain);
            }
            let vmap: Vec<String> =
                ep_chains.iter().enumerate().map(|(i, c)| format!("{i} : goto {c}")).collect();
            let _ = writeln!(
                s,
                "add chain ip kube-proxy {svc_chain}\n\
                 add rule ip kube-proxy {svc_chain} ip daddr {ip} {proto} dport {port} ip saddr != {CLUSTER_CIDR} jump mark-for-masquerade\n\
                 add rule ip kube-proxy {svc_chain} numgen random mod {n} vmap {{ {vmap} }}",
                ip = svc.cluster_ip,
                proto = p.proto,
                port = p.port,
                n = ep_chains.len(),
                vmap = vmap.join(", "),
            );
            elements.push(format!("{} . {} . {} : goto {svc_chain}", svc.cluster_ip, p.proto, p.port));
            if let Some(np) = p.node_port {
                let ext = format!("external-{}-{}/{}/{}/p{}", &p.hash("")[..8], svc.namespace, svc.name, p.proto, p.port);
                let _ = writeln!(
                    s,
                    "add chain ip kube-proxy {ext}\n\
                     add rule ip kube-proxy {ext} jump mark-for-masquerade\n\
                     add rule ip kube-proxy {ext} goto {svc_chain}\n\
                     add element ip kube-proxy service-nodeports {{ {} . {np} : goto {ext} }}",
                    p.proto
                );
            }
        }
    }
    for chunk in elements.chunks(1000) {
        let _ = writeln!(s, "add element ip kube-proxy service-ips {{ {} }}", chunk.join(", "));
    }
    s
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    /// Every chain a rule jumps to is declared, and every declared chain but
    /// the built-in ones is used.
    fn check_chains(text: &str) {
        let declared: BTreeSet<&str> =
            text.lines().filter_map(|l| l.strip_prefix(':')).map(|l| l.split(' ').next().unwrap()).collect();
        let builtin = ["PREROUTING", "OUTPUT", "POSTROUTING", "FORWARD", "INPUT", "DNAT", "MARK", "MASQUERADE", "RETURN", "ACCEPT", "DROP"];
        for l in text.lines().filter(|l| l.starts_with("-A ")) {
            let target = l.split(" -j ").nth(1).unwrap().split(' ').next().unwrap();
            assert!(declared.contains(target) || builtin.contains(&target), "undeclared chain {target} in {l}");
        }
    }

    #[test]
    fn iptables_rules_have_kube_proxys_shape() {
        let set = ServiceSet::new(3);
        let text = iptables_restore(&set);
        check_chains(&text);
        // One KUBE-SERVICES rule per service port: 3 Services, the probe (index 1) with two ports.
        let portals = text.lines().filter(|l| l.starts_with("-A KUBE-SERVICES") && l.contains("cluster IP")).count();
        assert_eq!(portals, 4);
        // For each service port: 10 endpoint rules in its KUBE-SVC chain, each
        // with the probability kube-proxy gives it (1/10, 1/9, ... 1/2, then none).
        let probe = set.probe();
        let svc_line = text
            .lines()
            .find(|l| l.starts_with("-A KUBE-SERVICES") && l.contains(&format!("-d {}/32 --dport 80", probe.cluster_ip)))
            .expect("probe TCP portal");
        let svc_chain = svc_line.split(" -j ").nth(1).unwrap();
        let jumps: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with(&format!("-A {svc_chain} ")) && l.contains("-j KUBE-SEP-"))
            .collect();
        assert_eq!(jumps.len(), 10);
        for (i, l) in jumps.iter().enumerate() {
            if i < 9 {
                let want = format!("--probability {:.10}", 1.0 / (10 - i) as f64);
                assert!(l.contains(&want), "rule {i} lacks {want}: {l}");
            } else {
                assert!(!l.contains("statistic"), "last endpoint rule must be unconditional: {l}");
            }
        }
        // Each of those endpoint chains DNATs to its endpoint's target port.
        for (l, ep) in jumps.iter().zip(&probe.endpoints) {
            let sep = l.split(" -j ").nth(1).unwrap();
            let dnat = format!("-A {sep} ");
            assert!(
                text.lines().any(|r| r.starts_with(&dnat) && r.ends_with(&format!("--to-destination {ep}:8080"))),
                "{sep} does not DNAT to {ep}:8080"
            );
        }
        assert_eq!(text.matches("COMMIT").count(), 2);
        // The probe is a NodePort: KUBE-NODEPORTS -> KUBE-EXT-* -> the same KUBE-SVC-* chain.
        let np = text.lines().find(|l| l.starts_with("-A KUBE-NODEPORTS") && l.contains("--dport 30080")).expect("TCP NodePort rule");
        let ext = np.split(" -j ").nth(1).unwrap();
        assert!(text.contains(&format!("-A {ext} -j {svc_chain}\n")), "{ext} does not lead to {svc_chain}");
        assert!(text.lines().any(|l| l.starts_with(&format!("-A {ext} ")) && l.ends_with("-j KUBE-MARK-MASQ")));
    }

    #[test]
    fn nftables_script_uses_one_verdict_map_lookup() {
        let set = ServiceSet::new(3);
        let text = nftables_script(&set);
        assert!(text.contains("ip daddr . meta l4proto . th dport vmap @service-ips"));
        let elements: usize = text
            .lines()
            .filter(|l| l.starts_with("add element ip kube-proxy service-ips"))
            .map(|l| l.matches(": goto").count())
            .sum();
        assert_eq!(elements, 4, "one verdict map element per service port");
        assert_eq!(text.matches("numgen random mod 10 vmap").count(), 4);
        let probe = set.probe();
        for ep in &probe.endpoints {
            assert!(text.contains(&format!("meta l4proto tcp dnat to {ep}:8080")), "no TCP DNAT to {ep}");
            assert!(text.contains(&format!("meta l4proto udp dnat to {ep}:5353")), "no UDP DNAT to {ep}");
        }
        // Every chain a verdict jumps to is added.
        let gotos: Vec<&str> = text.split("goto ").skip(1).map(|g| g.split(|c: char| c.is_whitespace() || c == ',').next().unwrap()).collect();
        // A goto per service port, per endpoint, and two per NodePort (map element, external chain).
        assert_eq!(gotos.len(), 4 + 4 * 10 + 2 * 2);
        assert!(text.contains("add element ip kube-proxy service-nodeports { tcp . 30080 : goto external-"));
        for chain in gotos {
            assert!(text.contains(&format!("add chain ip kube-proxy {chain}\n")), "chain {chain} never added");
        }
    }
}
