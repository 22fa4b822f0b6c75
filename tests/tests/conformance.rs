//! kube-proxy conformance suite: every packet-flow case of kube-proxy's
//! nftables and iptables proxier tests (tests/conformance/*/*.yaml), each
//! setup on its own two-node cluster in network namespaces, with real
//! traffic. Prints one line per case and a summary counting them.
//!
//! Cases the datapath does not handle yet are listed, with the reason, in
//! tests/conformance/known-failures.txt. The test fails on any other failing
//! case, and on a listed case that now passes (so the list only shrinks).
//! A line `~text<TAB>reason` there names a known intermittent symptom: a
//! failure whose detail contains `text` (pieces joined by ` && ` must all
//! appear) is reported (FAIL~) and counted, but does not fail the test.
//!
//! The setups with an external client run a second time with XDP on each
//! node's LAN interface (`--xdp-devices`, native on the veth), in front of
//! TC: the same outcomes, and each IPv4 external case that reaches an
//! endpoint decided in XDP.
//!
//! CONFORMANCE_FILTER=substring runs the setups whose id contains it;
//! CONFORMANCE_THREADS=n sets how many setups run at once (default 3);
//! CONFORMANCE_AGENT_LOGS=1 prints the agents' logs after each setup.

#![feature(custom_test_frameworks)]
#![test_runner(proxy_tests::harness::run)]

use std::{
    collections::{BTreeMap, VecDeque},
    io::Write,
    path::Path,
    sync::Mutex,
};

use anyhow::{Context, Result};
use proxy_tests::{
    conformance::{
        data::{Setup, load_dir},
        run::{CaseResult, Check, Datapath, Status, plan, run_setup},
    },
};

/// Written to stderr directly: libtest captures print!/eprint!, and the
/// per-case lines are the point of this suite.
fn say(line: &str) {
    let mut err = std::io::stderr().lock();
    let _ = writeln!(err, "{line}");
}

/// The known-failures file: case ids, and intermittent symptoms.
struct Known {
    ids: BTreeMap<String, String>,
    symptoms: Vec<(String, String)>,
}

impl Known {
    fn symptom(&self, r: &CaseResult) -> Option<&str> {
        // `text` may be several pieces joined by " && ", all of which must appear.
        self.symptoms
            .iter()
            .find(|(text, _)| text.split(" && ").all(|part| r.detail.contains(part)))
            .map(|(_, why)| why.as_str())
    }
}

fn known_failures(path: &Path) -> Result<Known> {
    let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    let mut known = BTreeMap::new();
    let mut symptoms = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim_end();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (id, why) = line.split_once('\t').with_context(|| format!("{}:{}: expected `id<TAB>reason`", path.display(), n + 1))?;
        if let Some(text) = id.strip_prefix('~') {
            symptoms.push((text.to_string(), why.to_string()));
            continue;
        }
        anyhow::ensure!(known.insert(id.to_string(), why.to_string()).is_none(), "{}:{}: {id} listed twice", path.display(), n + 1);
    }
    Ok(Known { ids: known, symptoms })
}

#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn kube_proxy_packet_flow_tables() -> Result<()> {
    packet_flow_tables(Datapath::Tc)
}

#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn kube_proxy_packet_flow_tables_through_xdp() -> Result<()> {
    packet_flow_tables(Datapath::Xdp)
}

fn packet_flow_tables(datapath: Datapath) -> Result<()> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("conformance");
    let files = load_dir(&dir)?;
    let known = known_failures(&dir.join("known-failures.txt"))?;
    let filter = std::env::var("CONFORMANCE_FILTER").unwrap_or_default();
    let threads: usize = std::env::var("CONFORMANCE_THREADS").ok().and_then(|s| s.parse().ok()).unwrap_or(3);

    let mut jobs: VecDeque<(usize, String, Setup)> = VecDeque::new();
    for (kind, _, file) in files {
        for setup in file.setups {
            let from_outside = !plan(&setup).external_clients.is_empty();
            if format!("{kind}/{}", setup.name).contains(&filter) && (datapath == Datapath::Tc || from_outside) {
                jobs.push_back((jobs.len(), kind.clone(), setup));
            }
        }
    }
    anyhow::ensure!(!jobs.is_empty(), "no setup matches CONFORMANCE_FILTER={filter:?}");
    let total_setups = jobs.len();
    let queue = Mutex::new(jobs);
    let done: Mutex<Vec<(usize, Vec<CaseResult>)>> = Mutex::new(Vec::new());
    let report = |r: &CaseResult| {
        let tag = match (r.status, known.ids.contains_key(&r.id)) {
            (Status::Pass, false) => "PASS ",
            (Status::Pass, true) => "PASS!",
            (Status::Fail, true) => "FAIL*",
            (Status::Fail, false) if known.symptom(r).is_some() => "FAIL~",
            (Status::Fail, false) => "FAIL ",
            (Status::Skip, _) => "SKIP ",
        };
        say(&format!("{tag} {}  ({}): {}", r.id, r.packet, r.detail));
    };
    say(&format!("conformance ({datapath:?}): {total_setups} setups from {}, {threads} at a time", dir.display()));
    std::thread::scope(|s| {
        for _ in 0..threads.max(1) {
            s.spawn(|| {
                loop {
                    let Some((order, kind, setup)) = queue.lock().unwrap().pop_front() else { break };
                    let netprobe = Path::new(env!("CARGO_BIN_EXE_netprobe"));
                    let results = run_setup(&kind, &setup, netprobe, datapath, &report);
                    done.lock().unwrap().push((order, results));
                }
            });
        }
    });
    let mut done = done.into_inner().unwrap();
    done.sort_by_key(|(order, _)| *order);
    let results: Vec<CaseResult> = done.into_iter().flat_map(|(_, r)| r).collect();

    let packets: Vec<&CaseResult> = results.iter().filter(|r| r.check == Check::Packet).collect();
    let count = |st: Status| packets.iter().filter(|r| r.status == st).count();
    let (passed, failed, skipped) = (count(Status::Pass), count(Status::Fail), count(Status::Skip));
    let dumps: Vec<&CaseResult> = results.iter().filter(|r| r.check == Check::Dump).collect();
    let dumps_ok = dumps.iter().filter(|r| r.status == Status::Pass).count();
    let dumps_run = dumps.iter().filter(|r| r.status != Status::Skip).count();
    let failing = |r: &&CaseResult| r.status == Status::Fail && !known.ids.contains_key(&r.id);
    let intermittent: Vec<&CaseResult> = results.iter().filter(failing).filter(|r| known.symptom(r).is_some()).collect();
    let new_failures: Vec<&CaseResult> = results.iter().filter(failing).filter(|r| known.symptom(r).is_none()).collect();
    let now_passing: Vec<&CaseResult> = results.iter().filter(|r| r.status == Status::Pass && known.ids.contains_key(&r.id)).collect();

    let known_failed = packets.iter().filter(|r| r.status == Status::Fail && known.ids.contains_key(&r.id)).count();
    say(&format!("conformance: {passed} passed, {failed} failed, {skipped} skipped (of {} cases)", packets.len()));
    say(&format!("conformance: {known_failed} failures are known (FAIL*, tests/conformance/known-failures.txt)"));
    say(&format!("conformance: dump services lists every frontend kind with a scope in {dumps_ok} of {dumps_run} setup phases"));
    say(&format!(
        "conformance: {} new failures (FAIL), {} known failures now pass (PASS!), {} failures show a known intermittent symptom (FAIL~)",
        new_failures.len(),
        now_passing.len(),
        intermittent.len()
    ));
    for r in &intermittent {
        say(&format!("conformance: intermittent: {}: {}", r.id, known.symptom(r).unwrap_or_default()));
    }
    let mut problems = Vec::new();
    for r in &new_failures {
        problems.push(format!("new failure: {}: {}", r.id, r.detail));
    }
    for r in &now_passing {
        problems.push(format!("now passes, remove it from known-failures.txt: {}", r.id));
    }
    anyhow::ensure!(problems.is_empty(), "{} conformance problems:\n{}", problems.len(), problems.join("\n"));
    Ok(())
}
