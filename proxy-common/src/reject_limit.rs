//! REJECT's rate limit per source, as the kernel limits the ICMP errors it
//! sends (net.ipv4.icmp_ratelimit, per peer): a token bucket kept in time
//! units, so one u64 of credit and the time it was last topped up are the
//! whole state. Pure, so it is tested on the host (and run in BPF as is).

/// Rejects a source gets per second, sustained.
pub const REJECTS_PER_SEC: u64 = 20;
/// Rejects a source may get at once after a quiet spell.
pub const REJECT_BURST: u64 = 100;
/// Sources whose budget is remembered (an LRU: the quietest are forgotten,
/// and get a full bucket when they come back).
pub const MAX_REJECT_SOURCES: u32 = 16_384;

const NS_PER_REJECT: u64 = 1_000_000_000 / REJECTS_PER_SEC;
const MAX_CREDIT_NS: u64 = REJECT_BURST * NS_PER_REJECT;

/// One source's budget. A new source starts from `RejectBudget::full(now)`.
#[repr(C)]
#[derive(Copy, Clone, PartialEq, Eq, Debug, Default)]
pub struct RejectBudget {
    pub credit_ns: u64,
    pub topped_up_ns: u64,
}

impl RejectBudget {
    #[inline(always)]
    pub const fn full(now_ns: u64) -> Self {
        RejectBudget { credit_ns: MAX_CREDIT_NS, topped_up_ns: now_ns }
    }

    /// Whether one more reject may go out at `now_ns`; if so it is charged.
    #[inline(always)]
    pub fn allow(&mut self, now_ns: u64) -> bool {
        let earned = now_ns.saturating_sub(self.topped_up_ns);
        let credit = self.credit_ns.saturating_add(earned);
        self.credit_ns = if credit > MAX_CREDIT_NS { MAX_CREDIT_NS } else { credit };
        self.topped_up_ns = now_ns;
        if self.credit_ns < NS_PER_REJECT {
            return false;
        }
        self.credit_ns -= NS_PER_REJECT;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_then_the_sustained_rate() {
        let mut b = RejectBudget::full(0);
        let burst = (0..1000).take_while(|_| b.allow(0)).count() as u64;
        assert_eq!(burst, REJECT_BURST);
        assert!(!b.allow(0));
        // One second later: a second's worth, no more.
        let t = 1_000_000_000;
        let next = (0..1000).take_while(|_| b.allow(t)).count() as u64;
        assert_eq!(next, REJECTS_PER_SEC);
        // A long quiet spell refills the bucket only to the burst.
        let mut later = 0;
        while b.allow(3_600_000_000_000) {
            later += 1;
        }
        assert_eq!(later, REJECT_BURST);
    }

    #[test]
    fn a_clock_that_goes_back_earns_nothing() {
        let mut b = RejectBudget { credit_ns: 0, topped_up_ns: 5_000_000_000 };
        assert!(!b.allow(1_000_000_000));
    }
}
