//! One address type for IPv4 and IPv6, so no map key needs a redesign when
//! IPv6 traffic is added: IPv4 is stored IPv4-mapped (`::ffff:a.b.c.d`).

use core::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// 16 bytes in network order.
#[repr(C)]
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Addr(pub [u8; 16]);

impl Addr {
    /// From the four IPv4 bytes as they sit in a packet.
    #[inline(always)]
    pub const fn from_v4_octets(o: [u8; 4]) -> Self {
        Addr([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, o[0], o[1], o[2], o[3]])
    }

    #[inline(always)]
    pub const fn is_v4(&self) -> bool {
        let b = &self.0;
        b[0] == 0 && b[1] == 0 && b[2] == 0 && b[3] == 0 && b[4] == 0 && b[5] == 0 && b[6] == 0
            && b[7] == 0 && b[8] == 0 && b[9] == 0 && b[10] == 0xff && b[11] == 0xff
    }

    /// The IPv4 bytes, meaningful only when `is_v4()`.
    #[inline(always)]
    pub const fn v4_octets(&self) -> [u8; 4] {
        [self.0[12], self.0[13], self.0[14], self.0[15]]
    }

    pub fn to_ip(self) -> IpAddr {
        if self.is_v4() {
            IpAddr::V4(Ipv4Addr::from(self.v4_octets()))
        } else {
            IpAddr::V6(Ipv6Addr::from(self.0))
        }
    }
}

impl From<IpAddr> for Addr {
    fn from(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(v4) => Addr::from_v4_octets(v4.octets()),
            IpAddr::V6(v6) => Addr(v6.octets()),
        }
    }
}

impl core::fmt::Debug for Addr {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        core::fmt::Display::fmt(&self.to_ip(), f)
    }
}

impl core::fmt::Display for Addr {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        core::fmt::Display::fmt(&self.to_ip(), f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v4_round_trips_and_v6_stays_v6() {
        let v4: IpAddr = "10.96.0.10".parse().unwrap();
        let a = Addr::from(v4);
        assert!(a.is_v4());
        assert_eq!(a.v4_octets(), [10, 96, 0, 10]);
        assert_eq!(a.to_ip(), v4);

        let v6: IpAddr = "fd00::10".parse().unwrap();
        let b = Addr::from(v6);
        assert!(!b.is_v4());
        assert_eq!(b.to_ip(), v6);
        // An IPv4-mapped IPv6 literal is the same frontend as the IPv4 address.
        let mapped: IpAddr = "::ffff:10.96.0.10".parse().unwrap();
        assert_eq!(Addr::from(mapped), a);
    }
}
