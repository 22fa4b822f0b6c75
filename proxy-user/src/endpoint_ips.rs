//! Addresses that cannot be endpoints. A backend address is where the
//! datapath points a connection (the socket hooks rewrite connect() to it),
//! so one of these would hand a Service's clients to the node itself or its
//! link instead of a pod.
//!
//! The API server refuses in an EndpointSlice or Endpoints what
//! `ValidateNonSpecialIP` (pkg/apis/core/validation, called by
//! pkg/apis/discovery/validation) refuses: unspecified, loopback,
//! link-local unicast, link-local multicast; and, as not IPv6, IPv4-mapped
//! addresses in an IPv6 slice (on a dual-stack socket `::ffff:127.0.0.1`
//! is loopback again). Manifests have no API server, and objects written
//! before that validation may remain, so they are checked here too.
//! Refused beyond the API server, because no single peer of a flow can
//! live there:
//! - every multicast range, not only link-local multicast, and the IPv4
//!   broadcast address: a connection has one peer, never a group;
//! - an address inside the effective service CIDRs (`service_cidrs`): only
//!   ClusterIPs live there, and a ClusterIP is a frontend, never a backend
//!   (the datapath translates once: the flow would go to an address nothing
//!   answers, or be dropped as unallocated).

use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr},
};

use ipnet::IpNet;

/// Why `ip` cannot be an endpoint, or `None` if it can.
pub fn refused(ip: IpAddr, service_cidrs: &BTreeSet<IpNet>) -> Option<String> {
    let special = match ip {
        IpAddr::V4(v4) if v4.is_unspecified() => Some("unspecified (0.0.0.0, ::)"),
        IpAddr::V4(v4) if v4.is_loopback() => Some("loopback (127.0.0.0/8, ::1)"),
        IpAddr::V4(v4) if v4.is_link_local() => Some("link-local (169.254.0.0/16, fe80::/10)"),
        IpAddr::V4(v4) if v4.is_multicast() => Some("multicast (224.0.0.0/4, ff00::/8)"),
        IpAddr::V4(v4) if v4 == Ipv4Addr::BROADCAST => Some("broadcast (255.255.255.255)"),
        IpAddr::V6(v6) if v6.is_unspecified() => Some("unspecified (0.0.0.0, ::)"),
        IpAddr::V6(v6) if v6.is_loopback() => Some("loopback (127.0.0.0/8, ::1)"),
        IpAddr::V6(v6) if v6.is_unicast_link_local() => Some("link-local (169.254.0.0/16, fe80::/10)"),
        IpAddr::V6(v6) if v6.is_multicast() => Some("multicast (224.0.0.0/4, ff00::/8)"),
        IpAddr::V6(v6) if v6.to_ipv4_mapped().is_some() => Some("IPv4-mapped (::ffff:0:0/96)"),
        _ => None,
    };
    if let Some(what) = special {
        return Some(what.to_string());
    }
    service_cidrs.iter().find(|net| net.contains(&ip)).map(|net| format!("in service CIDR {net}, which holds only ClusterIPs"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn why(ip: &str, cidrs: &[&str]) -> Option<String> {
        let cidrs = cidrs.iter().map(|c| c.parse().unwrap()).collect();
        refused(ip.parse().unwrap(), &cidrs)
    }

    #[test]
    fn what_the_api_server_refuses_is_refused() {
        for (ip, what) in [
            ("0.0.0.0", "unspecified"),
            ("::", "unspecified"),
            ("127.0.0.1", "loopback"),
            ("127.1.2.3", "loopback"),
            ("::1", "loopback"),
            ("169.254.169.254", "link-local"),
            ("fe80::1", "link-local"),
            ("febf::1", "link-local"),
            ("224.0.0.1", "multicast"),
            ("ff02::1", "multicast"),
            ("::ffff:127.0.0.1", "IPv4-mapped"),
            ("::ffff:10.244.0.1", "IPv4-mapped"),
        ] {
            let got = why(ip, &[]).unwrap_or_else(|| panic!("{ip} accepted"));
            assert!(got.starts_with(what), "{ip}: {got}");
        }
    }

    #[test]
    fn more_than_the_api_server_refuses_is_refused_too() {
        for (ip, what) in [
            ("239.1.2.3", "multicast"),
            ("ff05::2", "multicast"),
            ("255.255.255.255", "broadcast"),
        ] {
            let got = why(ip, &[]).unwrap_or_else(|| panic!("{ip} accepted"));
            assert!(got.starts_with(what), "{ip}: {got}");
        }
    }

    #[test]
    fn an_address_in_a_service_cidr_is_refused_and_pod_addresses_are_not() {
        let cidrs = ["10.96.0.0/16", "fd00:10:96::/112"];
        assert_eq!(why("10.96.0.10", &cidrs).as_deref(), Some("in service CIDR 10.96.0.0/16, which holds only ClusterIPs"));
        assert_eq!(why("fd00:10:96::a", &cidrs).as_deref(), Some("in service CIDR fd00:10:96::/112, which holds only ClusterIPs"));
        for ip in ["10.244.0.11", "10.97.0.1", "192.168.0.2", "fd00:10:244::11", "2001:db8::1", "fec0::1", "1.2.3.4"] {
            assert_eq!(why(ip, &cidrs), None, "{ip}");
        }
        // Only where there are service CIDRs at all.
        assert_eq!(why("10.96.0.10", &[]), None);
    }
}
