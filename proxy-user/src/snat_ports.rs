//! The source ports masqueraded flows take. Processes on the node reach
//! backends directly (socket hooks) from ephemeral ports the kernel picks
//! without knowing our SNAT table; a masqueraded flow holding the same node
//! address and port towards the same backend would take that socket's
//! replies. So masquerade draws ports outside the node's ephemeral range:
//! TCP from every port from 1024 up but those (it also asks the node's
//! socket table), UDP and SCTP from one range above or below them.

use std::ops::RangeInclusive;

use anyhow::{Context, Result};
use proxy_common::{DEFAULT_EPHEMERAL_PORTS, DEFAULT_SNAT_PORTS, TCP_SNAT_PORT_LOW};
use tracing::warn;

const EPHEMERAL_SYSCTL: &str = "/proc/sys/net/ipv4/ip_local_port_range";
/// Masquerade stays above the NodePort range (30000-32767 by default), so a
/// reply's port never looks like a NodePort.
const ABOVE_NODE_PORTS: u16 = 32768;
/// Fewer free ports than this and collisions between masqueraded flows to
/// one backend become likely: worth a warning.
const FEW_PORTS: usize = 1024;

/// What the agent hands the BPF object (host order, inclusive).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnatPorts {
    /// UDP and SCTP draw (and keep a client's port) only here.
    pub masquerade: RangeInclusive<u16>,
    /// The node's ephemeral ports, within TCP_SNAT_PORT_LOW..=65535: TCP
    /// draws from the rest of that span.
    pub ephemeral: RangeInclusive<u16>,
}

impl Default for SnatPorts {
    fn default() -> Self {
        SnatPorts {
            masquerade: DEFAULT_SNAT_PORTS.0..=DEFAULT_SNAT_PORTS.1,
            ephemeral: DEFAULT_EPHEMERAL_PORTS.0..=DEFAULT_EPHEMERAL_PORTS.1,
        }
    }
}

/// The ranges for this node, from its ephemeral port range (sysctl).
pub fn for_this_node() -> Result<SnatPorts> {
    let text = std::fs::read_to_string(EPHEMERAL_SYSCTL).with_context(|| format!("read {EPHEMERAL_SYSCTL}"))?;
    let ephemeral = parse_port_range(&text).with_context(|| format!("{EPHEMERAL_SYSCTL}: {text:?} is not two ports"))?;
    let range = outside(&ephemeral);
    let overlaps = range.start() <= ephemeral.end() && ephemeral.start() <= range.end();
    if overlaps || range.len() < FEW_PORTS {
        warn!(
            ephemeral = ?ephemeral,
            masquerade_ports = ?range,
            "the node's ephemeral port range leaves few or no ports for masquerade (a masqueraded flow may take a node socket's replies); narrow net.ipv4.ip_local_port_range"
        );
    }
    Ok(SnatPorts { masquerade: range, ephemeral: tcp_hole(&ephemeral) })
}

/// The ephemeral range as TCP's drawing skips it: clipped to the ports it
/// draws from, and never all of them (then it draws from all, and a drawn
/// port may meet a node socket's later choice: warned about above).
// The empty range (MAX..=MAX-1) is meant: no hole.
#[allow(clippy::reversed_empty_ranges)]
fn tcp_hole(ephemeral: &RangeInclusive<u16>) -> RangeInclusive<u16> {
    let hole = (*ephemeral.start()).max(TCP_SNAT_PORT_LOW)..=*ephemeral.end();
    let left = usize::from(u16::MAX - TCP_SNAT_PORT_LOW) + 1 - hole.clone().count();
    if left < FEW_PORTS { u16::MAX..=u16::MAX - 1 } else { hole }
}

fn parse_port_range(text: &str) -> Option<RangeInclusive<u16>> {
    let mut it = text.split_whitespace().map(|w| w.parse::<u16>().ok());
    let (lo, hi) = (it.next()??, it.next()??);
    (lo <= hi && it.next().is_none()).then_some(lo..=hi)
}

/// Above `ephemeral` if there is room, else between the NodePort range and
/// `ephemeral`; if the ephemeral range leaves neither, the default (and a
/// collision risk, warned about).
fn outside(ephemeral: &RangeInclusive<u16>) -> RangeInclusive<u16> {
    let above = ephemeral.end().checked_add(1).map(|lo| lo..=u16::MAX);
    let below = ephemeral.start().checked_sub(1).map(|hi| ABOVE_NODE_PORTS..=hi);
    [above, below].into_iter().flatten().find(|r| r.len() >= FEW_PORTS).unwrap_or(DEFAULT_SNAT_PORTS.0..=DEFAULT_SNAT_PORTS.1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linux_default_leaves_the_ports_above() {
        assert_eq!(outside(&parse_port_range("32768\t60999\n").unwrap()), 61000..=65535);
    }

    #[test]
    fn above_unless_too_few_then_below() {
        assert_eq!(outside(&(50000..=65000)), 32768..=49999);
        assert_eq!(outside(&(2000..=40000)), 40001..=65535);
    }

    #[test]
    fn no_room_falls_back_to_the_default() {
        assert_eq!(outside(&(1024..=65535)), 61000..=65535);
        assert_eq!(outside(&(1..=65535)), 61000..=65535);
        assert_eq!(outside(&(33000..=65000)), 61000..=65535);
    }

    #[test]
    fn tcp_draws_around_the_ephemeral_ports_within_its_span() {
        assert_eq!(tcp_hole(&(32768..=60999)), 32768..=60999);
        assert_eq!(tcp_hole(&(1..=30000)), 1024..=30000);
        // All but a few: nothing skipped (an empty range).
        assert_eq!(tcp_hole(&(1024..=65000)).count(), 0);
    }

    #[test]
    fn malformed_sysctl_text_is_refused() {
        for bad in ["", "32768", "60999 32768", "a b", "1 2 3", "70000 80000"] {
            assert_eq!(parse_port_range(bad), None, "{bad:?}");
        }
    }
}
