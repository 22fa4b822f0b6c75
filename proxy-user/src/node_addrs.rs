//! The node's own addresses, followed through netlink: NodePorts open on
//! them, and masqueraded flows leave with one of them.

use std::{collections::BTreeMap, net::IpAddr};

use anyhow::{Context, Result};
use proxy_common::SNAT_ADDR_IPV6;
use futures::{StreamExt, TryStreamExt};
use netlink_packet_route::address::{AddressAttribute, AddressHeaderFlags, AddressMessage};
use rtnetlink::{Handle, MulticastGroup, new_multicast_connection};
use tokio::sync::watch;

/// IPv4 and IPv6 addresses by interface, primary address first; loopback
/// and IPv6 link-local (fe80::/10, never a NodePort or SNAT source) left out.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeAddrs {
    pub by_ifindex: BTreeMap<u32, Vec<IpAddr>>,
}

impl NodeAddrs {
    pub fn all(&self) -> Vec<IpAddr> {
        self.by_ifindex.values().flatten().copied().collect()
    }

    /// The SNAT source per interface and family (IPv6 under
    /// `ifindex | SNAT_ADDR_IPV6`), and under ifindex 0 the default for
    /// interfaces without an address (pod veths): the first interface's primary.
    pub fn snat_sources(&self) -> BTreeMap<u32, IpAddr> {
        let mut out = BTreeMap::new();
        for (family, ipv6) in [(0, false), (SNAT_ADDR_IPV6, true)] {
            let first_of = |ips: &Vec<IpAddr>| ips.iter().find(|ip| ip.is_ipv6() == ipv6).copied();
            let sources: BTreeMap<u32, IpAddr> =
                self.by_ifindex.iter().filter_map(|(i, ips)| Some((*i | family, first_of(ips)?))).collect();
            if let Some(first) = sources.values().next().copied() {
                out.insert(family, first);
            }
            out.extend(sources);
        }
        out
    }

    fn from_messages(msgs: &[AddressMessage]) -> Self {
        let mut by_ifindex: BTreeMap<u32, Vec<(bool, IpAddr)>> = BTreeMap::new();
        for m in msgs {
            // IFA_LOCAL is the interface's own address (IFA_ADDRESS is the peer on point-to-point links).
            let local = m.attributes.iter().find_map(|a| match a {
                AddressAttribute::Local(ip) => Some(*ip),
                _ => None,
            });
            let Some(ip) = local.or_else(|| {
                m.attributes.iter().find_map(|a| match a {
                    AddressAttribute::Address(ip) => Some(*ip),
                    _ => None,
                })
            }) else {
                continue;
            };
            if ip.is_loopback() || is_ipv6_link_local(&ip) {
                continue;
            }
            let secondary = m.header.flags.contains(AddressHeaderFlags::Secondary);
            by_ifindex.entry(m.header.index).or_default().push((secondary, ip));
        }
        let by_ifindex = by_ifindex
            .into_iter()
            .map(|(i, mut ips)| {
                ips.sort_by_key(|(secondary, _)| *secondary); // stable: kernel order within each kind
                (i, ips.into_iter().map(|(_, ip)| ip).collect())
            })
            .collect();
        NodeAddrs { by_ifindex }
    }
}

fn is_ipv6_link_local(ip: &IpAddr) -> bool {
    matches!(ip, IpAddr::V6(v6) if v6.segments()[0] & 0xffc0 == 0xfe80)
}

async fn list(handle: &Handle) -> Result<NodeAddrs> {
    let msgs: Vec<AddressMessage> = handle.address().get().execute().try_collect().await.context("list addresses")?;
    Ok(NodeAddrs::from_messages(&msgs))
}

/// Publishes the node's addresses now and after every change.
pub async fn watch(tx: watch::Sender<NodeAddrs>) -> Result<()> {
    // Subscribe before listing, so no change can slip between the two.
    let (conn, handle, mut events) =
        new_multicast_connection(&[MulticastGroup::Ipv4Ifaddr, MulticastGroup::Ipv6Ifaddr]).context("netlink socket for address events")?;
    tokio::spawn(conn);
    tx.send_replace(list(&handle).await?);
    while events.next().await.is_some() {
        // Any change: list again rather than patch, so the result is always whole.
        let now = list(&handle).await?;
        tx.send_if_modified(|held| {
            let changed = *held != now;
            *held = now.clone();
            changed
        });
    }
    anyhow::bail!("netlink address events stopped")
}

#[cfg(test)]
mod tests {
    use netlink_packet_route::address::AddressMessage;

    use super::*;

    fn msg(index: u32, ip: &str, secondary: bool) -> AddressMessage {
        let mut m = AddressMessage::default();
        m.header.index = index;
        if secondary {
            m.header.flags = AddressHeaderFlags::Secondary;
        }
        m.attributes.push(AddressAttribute::Address(ip.parse().unwrap()));
        m
    }

    #[test]
    fn ipv6_addresses_count_but_link_local_and_loopback_do_not_and_each_family_has_snat_sources() {
        let msgs = [
            msg(1, "::1", false),
            msg(2, "2001:db8::1", false),
            msg(2, "fe80::1", false),
            msg(2, "192.168.0.3", true),
            msg(2, "192.168.0.2", false),
            msg(3, "2001:db8:1::2", false),
        ];
        let addrs = NodeAddrs::from_messages(&msgs);
        let all: Vec<String> = addrs.all().iter().map(ToString::to_string).collect();
        assert_eq!(all, ["2001:db8::1", "192.168.0.2", "192.168.0.3", "2001:db8:1::2"]);
        // Each family's primary per interface, and the first as the default.
        let snat: Vec<(u32, String)> = addrs.snat_sources().into_iter().map(|(i, ip)| (i, ip.to_string())).collect();
        let v6 = SNAT_ADDR_IPV6;
        let want = [(0, "192.168.0.2"), (2, "192.168.0.2"), (v6, "2001:db8::1"), (v6 | 2, "2001:db8::1"), (v6 | 3, "2001:db8:1::2")];
        assert_eq!(snat, want.map(|(i, ip)| (i, ip.to_string())));
    }
}
