//! A node namespace with pods attached by veth pairs, wired the way a
//! routed CNI (Calico-style) wires them: each pod has a /32 on `eth0` and a
//! default route to a link-local gateway; the node routes each pod's /32 to
//! its veth. Neighbours are static so nothing depends on ARP timing.
//! An IPv6 pod is wired the same way: a /128 (no duplicate address
//! detection, so it is usable at once) and a link-local gateway.

use std::net::{IpAddr, Ipv4Addr};

use anyhow::{Context, Result};

use crate::{netns::Netns, unique_suffix};

const POD_GATEWAY: &str = "169.254.1.1";
const POD_GATEWAY6: &str = "fe80::1";

pub struct Node {
    pub ns: Netns,
    /// Prefix of every name this topology creates (namespaces, interfaces).
    pub prefix: String,
    next_if: u32,
}

pub struct Pod<A = Ipv4Addr> {
    pub name: String,
    pub ip: A,
    /// The node-side end of the pod's veth.
    pub host_if: String,
    pub ns: Netns,
}

impl Node {
    /// `label` shows in namespace names; a random suffix keeps runs apart.
    pub fn new(label: &str) -> Result<Node> {
        let prefix = format!("ep{}", unique_suffix());
        let ns = Netns::new(&format!("{prefix}-{label}-node"))?;
        ns.sysctl("net.ipv4.ip_forward", "1")?;
        ns.sysctl("net.ipv4.conf.all.rp_filter", "0")?;
        ns.sysctl("net.ipv4.conf.default.rp_filter", "0")?;
        ns.sysctl("net.ipv6.conf.all.forwarding", "1")?;
        Ok(Node { ns, prefix, next_if: 0 })
    }

    pub fn add_pod<A: Into<IpAddr> + Copy>(&mut self, name: &str, addr: A) -> Result<Pod<A>> {
        let ip: IpAddr = addr.into();
        let pod_ns = Netns::new(&format!("{}-{name}", self.prefix))?;
        let host_if = format!("{}h{}", self.prefix, self.next_if);
        self.next_if += 1;
        self.ns
            .ip(&["link", "add", &host_if, "type", "veth", "peer", "name", "eth0", "netns", &pod_ns.name])
            .with_context(|| format!("veth for pod {name}"))?;
        self.ns.ip(&["link", "set", &host_if, "up"])?;
        // Pods send with TX checksum offload (a partial checksum); the node
        // side finishes the checksum in software, as a NIC would on the wire,
        // so the receiving pod verifies it and drops a wrong one instead of
        // trusting a partial checksum the datapath got wrong.
        let out = self.ns.command("ethtool").args(["-K", &host_if, "tx", "off"]).output()?;
        anyhow::ensure!(out.status.success(), "ethtool -K {host_if} tx off: {}", String::from_utf8_lossy(&out.stderr));
        let host = host_prefix(ip);
        if ip.is_ipv4() {
            pod_ns.ip(&["addr", "add", &host, "dev", "eth0"])?;
        } else {
            pod_ns.ip(&["addr", "add", &host, "dev", "eth0", "nodad"])?;
        }
        pod_ns.ip(&["link", "set", "eth0", "up"])?;

        let host_mac = mac_of(&self.ns, &host_if)?;
        let pod_mac = mac_of(&pod_ns, "eth0")?;
        if ip.is_ipv4() {
            pod_ns.ip(&["route", "add", POD_GATEWAY, "dev", "eth0", "scope", "link"])?;
            pod_ns.ip(&["route", "add", "default", "via", POD_GATEWAY, "dev", "eth0"])?;
            pod_ns.ip(&["neigh", "replace", POD_GATEWAY, "lladdr", &host_mac, "dev", "eth0", "nud", "permanent"])?;
        } else {
            pod_ns.ip(&["-6", "route", "add", "default", "via", POD_GATEWAY6, "dev", "eth0"])?;
            pod_ns.ip(&["neigh", "replace", POD_GATEWAY6, "lladdr", &host_mac, "dev", "eth0", "nud", "permanent"])?;
        }
        self.ns.ip(&["route", "add", &host, "dev", &host_if])?;
        self.ns.ip(&["neigh", "replace", &ip.to_string(), "lladdr", &pod_mac, "dev", &host_if, "nud", "permanent"])?;
        Ok(Pod { name: name.to_string(), ip: addr, host_if, ns: pod_ns })
    }
}

/// A host outside the cluster on a LAN with the node: the node holds
/// `node_ip`/24 on its end, the host `client_ips` (the first one /24, the
/// rest /32) with routes to `via_node` CIDRs through the node.
pub struct External {
    pub ns: Netns,
    pub node_if: String,
}

impl Node {
    pub fn add_external(&mut self, name: &str, node_ip: Ipv4Addr, client_ips: &[Ipv4Addr], via_node: &[&str]) -> Result<External> {
        let ns = Netns::new(&format!("{}-{name}", self.prefix))?;
        let node_if = format!("{}l{}", self.prefix, self.next_if);
        self.next_if += 1;
        self.ns
            .ip(&["link", "add", &node_if, "type", "veth", "peer", "name", "eth0", "netns", &ns.name])
            .with_context(|| format!("veth for {name}"))?;
        let out = self.ns.command("ethtool").args(["-K", &node_if, "tx", "off"]).output()?;
        anyhow::ensure!(out.status.success(), "ethtool -K {node_if} tx off: {}", String::from_utf8_lossy(&out.stderr));
        self.ns.ip(&["addr", "add", &format!("{node_ip}/24"), "dev", &node_if])?;
        self.ns.ip(&["link", "set", &node_if, "up"])?;
        ns.ip(&["link", "set", "eth0", "up"])?;
        for (i, ip) in client_ips.iter().enumerate() {
            let len = if i == 0 { 24 } else { 32 };
            ns.ip(&["addr", "add", &format!("{ip}/{len}"), "dev", "eth0"])?;
        }
        let node_mac = mac_of(&self.ns, &node_if)?;
        let client_mac = mac_of(&ns, "eth0")?;
        ns.ip(&["route", "add", &format!("{node_ip}/32"), "dev", "eth0", "scope", "link"])?;
        ns.ip(&["neigh", "replace", &node_ip.to_string(), "lladdr", &node_mac, "dev", "eth0", "nud", "permanent"])?;
        for net in via_node {
            ns.ip(&["route", "add", net, "via", &node_ip.to_string(), "dev", "eth0"])?;
        }
        for ip in client_ips {
            self.ns.ip(&["route", "replace", &format!("{ip}/32"), "dev", &node_if])?;
            self.ns.ip(&["neigh", "replace", &ip.to_string(), "lladdr", &client_mac, "dev", &node_if, "nud", "permanent"])?;
        }
        Ok(External { ns, node_if })
    }
}

/// A pod behind a router: node <-> router over a transit link, router <->
/// pod, where the router's end of the pod link has a smaller MTU than the
/// pod's own (a hop in the middle of the path, as between two nodes: the
/// pod still advertises its full MSS, so only path MTU discovery, the
/// router's ICMP errors, brings the node's packets down to size). Each of
/// `pod_ips` is routed to the router; the transit link holds
/// `transit4`.1/.2 (/30) and `transit6`::1/::2 (/64).
pub struct RoutedPod {
    pub router: Netns,
    pub pod: Netns,
}

impl Node {
    pub fn add_routed_pod(
        &mut self,
        name: &str,
        pod_ips: &[IpAddr],
        hop_mtu: u32,
        transit4: [u8; 3],
        transit6: &str,
    ) -> Result<RoutedPod> {
        let router = Netns::new(&format!("{}-{name}-rt", self.prefix))?;
        let pod = Netns::new(&format!("{}-{name}", self.prefix))?;
        router.sysctl("net.ipv4.ip_forward", "1")?;
        router.sysctl("net.ipv6.conf.all.forwarding", "1")?;
        let node_if = format!("{}r{}", self.prefix, self.next_if);
        self.next_if += 1;
        let [a, b, c] = transit4;
        let (node4, router4) = (format!("{a}.{b}.{c}.1"), format!("{a}.{b}.{c}.2"));
        let (node6, router6) = (format!("{transit6}::1"), format!("{transit6}::2"));
        self.ns.ip(&["link", "add", &node_if, "type", "veth", "peer", "name", "up0", "netns", &router.name])?;
        let out = self.ns.command("ethtool").args(["-K", &node_if, "tx", "off"]).output()?;
        anyhow::ensure!(out.status.success(), "ethtool -K {node_if} tx off: {}", String::from_utf8_lossy(&out.stderr));
        self.ns.ip(&["addr", "add", &format!("{node4}/30"), "dev", &node_if])?;
        self.ns.ip(&["addr", "add", &format!("{node6}/64"), "dev", &node_if, "nodad"])?;
        self.ns.ip(&["link", "set", &node_if, "up"])?;
        router.ip(&["addr", "add", &format!("{router4}/30"), "dev", "up0"])?;
        router.ip(&["addr", "add", &format!("{router6}/64"), "dev", "up0", "nodad"])?;
        router.ip(&["link", "set", "up0", "up"])?;
        router.ip(&["route", "add", "default", "via", &node4])?;
        router.ip(&["-6", "route", "add", "default", "via", &node6])?;
        router.ip(&["link", "add", "down0", "type", "veth", "peer", "name", "eth0", "netns", &pod.name])?;
        router.ip(&["link", "set", "down0", "mtu", &hop_mtu.to_string(), "up"])?;
        pod.ip(&["link", "set", "eth0", "up"])?;
        // The pod reaches everything through the router's end of its link.
        router.ip(&["addr", "add", "169.254.1.1/32", "dev", "down0"])?;
        router.ip(&["addr", "add", "fe80::1/64", "dev", "down0", "nodad"])?;
        pod.ip(&["route", "add", POD_GATEWAY, "dev", "eth0", "scope", "link"])?;
        pod.ip(&["route", "add", "default", "via", POD_GATEWAY, "dev", "eth0"])?;
        pod.ip(&["-6", "route", "add", "default", "via", POD_GATEWAY6, "dev", "eth0"])?;
        for ip in pod_ips {
            let host = host_prefix(*ip);
            if ip.is_ipv4() {
                pod.ip(&["addr", "add", &host, "dev", "eth0"])?;
                self.ns.ip(&["route", "add", &host, "via", &router4])?;
            } else {
                pod.ip(&["addr", "add", &host, "dev", "eth0", "nodad"])?;
                self.ns.ip(&["-6", "route", "add", &host, "via", &router6])?;
            }
            router.ip(&["route", "add", &host, "dev", "down0"])?;
        }
        Ok(RoutedPod { router, pod })
    }
}

/// `ip` as a one-address prefix: /32 or /128.
pub fn host_prefix(ip: IpAddr) -> String {
    format!("{ip}/{}", if ip.is_ipv4() { 32 } else { 128 })
}

/// The MAC address of `ifname` in `ns`.
pub fn mac_of(ns: &Netns, ifname: &str) -> Result<String> {
    let out = ns.ip(&["-o", "link", "show", "dev", ifname])?;
    out.split_whitespace()
        .skip_while(|w| *w != "link/ether")
        .nth(1)
        .map(str::to_string)
        .with_context(|| format!("no MAC for {ifname} in {}", ns.name))
}
