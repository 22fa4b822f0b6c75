//! Per-packet cost of SCTP translation in the real `tc_ingress`, measured
//! with BPF_PROG_TEST_RUN: a packet whose port is rewritten (CRC32c update)
//! against one whose address only is rewritten (CRC untouched), on an
//! established association. A benchmark, not a test: `cargo bench -p
//! proxy-tests --bench sctp_test_run` prints the table (the sctp_fixtures
//! test runs [`measure`] briefly, for its checks, not its times).

use std::{fmt, time::Duration};

use anyhow::{Context, Result};
use proxy_common::*;
use proxy_user::maps::{MapWriter, Maps};

use crate::{
    fixture::{Fixture, TC_ACT_OK},
    sctp::{self, chunk},
};

const CLIENT: [u8; 4] = [10, 244, 0, 2];
const BACKEND: [u8; 4] = [10, 244, 0, 11];
/// 2905 -> 3905: address and port.
const VIP_PORT: [u8; 4] = [10, 96, 0, 10];
/// 3905 -> 3905: address only.
const VIP_ADDR: [u8; 4] = [10, 96, 0, 12];
const TARGET: u16 = 3905;
const MAC: [u8; 6] = [2, 0, 0, 0, 0, 1];

/// One measured case.
pub struct Row {
    pub case: String,
    pub median: Duration,
    pub mean: Duration,
    pub samples: usize,
}

impl fmt::Display for Row {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:<58} median {:>6} ns/packet  mean {:>6} ns/packet  ({} runs)",
            self.case,
            self.median.as_nanos(),
            self.mean.as_nanos(),
            self.samples
        )
    }
}

/// Instructions the verifier processed for `tc_ingress` (limit 1,000,000):
/// each path through an SCTP port rewrite walks the CRC update's loops.
pub fn verified_insns() -> Result<Option<u32>> {
    Ok(Fixture::new("sctp-verifier", install)?.verified_insns())
}

/// Times `samples` single runs of each case, on an association opened and
/// answered first, so every timed run takes the established path.
pub fn measure(samples: usize) -> Result<Vec<Row>> {
    let fx = Fixture::new("sctp-bench", install)?;
    let cases = [
        ("SCTP DATA 64 B, port + address rewritten (CRC32c update)", VIP_PORT, 2905, 40000, 64),
        ("SCTP DATA 64 B, address only (CRC untouched)", VIP_ADDR, TARGET, 40001, 64),
        ("SCTP DATA 1400 B, port + address rewritten (CRC32c update)", VIP_PORT, 2905, 40002, 1400),
        ("SCTP DATA 1400 B, address only (CRC untouched)", VIP_ADDR, TARGET, 40003, 1400),
    ];
    let mut rows = Vec::new();
    for (case, vip, port, sport, payload) in cases {
        open_association(&fx, vip, port, sport).with_context(|| format!("{case}: opening the association"))?;
        let sctp = sctp::packet(sport, port, TAG, &[chunk::data(1, &vec![0x42; payload])]);
        let frame = sctp::frame(CLIENT, vip, &sctp, MAC, MAC);
        let established = || fx.counters()[Counter::Established as usize];
        let before = established();
        let mut times = Vec::with_capacity(samples);
        for _ in 0..samples {
            let (verdict, took) = fx.time_one(&frame)?;
            anyhow::ensure!(verdict == TC_ACT_OK, "{case}: verdict {verdict}, want OK (translated)");
            times.push(took);
        }
        let took_established = established() - before;
        anyhow::ensure!(
            took_established == samples as u64,
            "{case}: {took_established} of {samples} runs took the established path"
        );
        times.sort();
        let mean = times.iter().sum::<Duration>() / samples.max(1) as u32;
        rows.push(Row { case: case.to_string(), median: times[samples / 2], mean, samples });
    }
    Ok(rows)
}

/// The verification tag of the benchmark's associations (both ends).
const TAG: u32 = 0x1122_3344;

/// The client's INIT to `vip:port` from `sport`, then the backend's
/// INIT-ACK: only an INIT starts an SCTP flow, and the first answer
/// confirms it (docs/semantics.md).
fn open_association(fx: &Fixture, vip: [u8; 4], port: u16, sport: u16) -> Result<()> {
    let init = sctp::frame(CLIENT, vip, &sctp::packet(sport, port, 0, &[chunk::init(TAG)]), MAC, MAC);
    let (verdict, _) = fx.time_one(&init)?;
    anyhow::ensure!(verdict == TC_ACT_OK, "INIT: verdict {verdict}, want OK (translated)");
    let ack = sctp::packet(TARGET, sport, TAG, &[chunk::init_ack(TAG, &[0; 8])]);
    let (verdict, _) = fx.time_one(&sctp::frame(BACKEND, CLIENT, &ack, MAC, MAC))?;
    anyhow::ensure!(verdict == TC_ACT_OK, "INIT-ACK: verdict {verdict}, want OK (reverse-translated)");
    Ok(())
}

fn install(m: &mut Maps) -> Result<()> {
    let backend =
        Backend { addr: Addr::from_v4_octets(BACKEND), port: TARGET.to_be(), proto: IPPROTO_SCTP, flags: BACKEND_READY };
    m.put_backend(1, &backend)?;
    for (service_id, vip, port) in [(1, VIP_PORT, 2905u16), (2, VIP_ADDR, TARGET)] {
        m.put_slot(&SlotKey { service_id, slot: 0 }, 1)?;
        let key = FrontendKey { addr: Addr::from_v4_octets(vip), port: port.to_be(), proto: IPPROTO_SCTP, scope: SCOPE_INTERNAL };
        m.put_frontend(&key, &ServiceEntry { service_id, backend_count: 1, ..Default::default() })?;
    }
    Ok(())
}
