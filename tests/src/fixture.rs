//! A Katran-style packet fixture harness: the real compiled `tc_ingress` and
//! `tc_egress`, real maps on a private bpffs, and a table of cases (input
//! frame, program and skb mark, verdict, expected output frame and mark,
//! counters that must move) run through BPF_PROG_TEST_RUN, printed as a
//! table. Also single runs timed by the kernel, for benchmarks.
//!
//! The same tables run through `xdp_ingress` in front of `tc_ingress`
//! (`run_table_through_xdp`), as a node with `--xdp-devices` runs them: a
//! case's expectations are what the node must do either way, and each case
//! XDP can finish must have been decided in XDP.

use std::{fmt::Write as _, time::Duration};

use anyhow::{Context, Result};
use aya::{
    Ebpf,
    programs::{ProgramError, SchedClassifier, TestRun, TestRunOptions, Xdp},
};
use proxy_common::{Counter, XDP_HANDOFF_LEN, XDP_HANDOFF_MAGIC, XDP_HANDOFF_TRANSLATED};
use proxy_user::maps::{self, Maps, TC_EGRESS, TC_INGRESS, XDP_INGRESS};

use crate::{bpffs::Bpffs, frames, is_root};

pub const TC_ACT_OK: u32 = 0;
pub const TC_ACT_SHOT: u32 = 2;
/// TC_ACT_UNSPEC (-1): not ours, left to whatever runs next.
pub const TC_ACT_UNSPEC: u32 = u32::MAX;
/// bpf_redirect(): a REJECT goes back out the interface it came in on.
pub const TC_ACT_REDIRECT: u32 = 7;
pub const XDP_DROP: u32 = 1;
pub const XDP_PASS: u32 = 2;
pub const XDP_TX: u32 = 3;
pub const XDP_REDIRECT: u32 = 4;

pub struct Fixture {
    // Fields drop in order: the program and maps go before the bpffs unmounts.
    ebpf: Ebpf,
    pub maps: Maps,
    _bpffs: Bpffs,
}

impl Fixture {
    /// Loads the program (through the verifier) and lets `install` fill the maps.
    pub fn new(label: &str, install: impl FnOnce(&mut Maps) -> Result<()>) -> Result<Fixture> {
        anyhow::ensure!(is_root(), "needs root (BPF)");
        let bpffs = Bpffs::new(label).context("mounting a private bpffs")?;
        let (mut ebpf, mut maps) = maps::load(bpffs.path()).context("loading the BPF object")?;
        for name in [TC_INGRESS, TC_EGRESS] {
            maps::load_tc(&mut ebpf, name).with_context(|| format!("verifier accepts {name} and its IPv6 counterpart"))?;
        }
        install(&mut maps).context("filling the service maps")?;
        // Every source in-cluster, so the tables need internal frontends only.
        maps.write_node_config(&Default::default(), &["0.0.0.0/0".parse()?]).context("node settings")?;
        Ok(Fixture { ebpf, maps, _bpffs: bpffs })
    }

    /// As `new`, with `xdp_ingress` through the verifier too.
    pub fn with_xdp(label: &str, install: impl FnOnce(&mut Maps) -> Result<()>) -> Result<Fixture> {
        let mut fx = Fixture::new(label, install)?;
        proxy_user::xdp::load(&mut fx.ebpf).context("verifier accepts xdp_ingress")?;
        Ok(fx)
    }

    /// Lets `xdp_send_out` send frames out of `ifindex`, as the agent does
    /// for each interface XDP is on.
    pub fn allow_xdp_sending(&mut self, ifindex: u32) -> Result<()> {
        proxy_user::xdp::allow_sending(&mut self.ebpf, ifindex)
    }

    /// The frames `xdp_send_out` sent out of `ifindex`.
    pub fn xdp_sent(&self, ifindex: u32) -> Result<u64> {
        let sent = proxy_user::xdp::sent(self._bpffs.path())?;
        Ok(sent.iter().find(|(i, _)| *i == ifindex).map_or(0, |(_, n)| *n))
    }

    /// One BPF_PROG_TEST_RUN of `xdp_ingress`.
    pub fn run_xdp(&self, input: &[u8]) -> Result<XdpRun, ProgramError> {
        self.run_xdp_with_metadata(&[], input)
    }

    /// As `run_xdp`, the frame arriving with `metadata` in front of it
    /// (Linux 5.13 on: earlier test runs refuse an XDP context, EINVAL).
    pub fn run_xdp_with_metadata(&self, metadata: &[u8], input: &[u8]) -> Result<XdpRun, ProgramError> {
        let prog: &Xdp = self.ebpf.program(XDP_INGRESS).unwrap().try_into().unwrap();
        let mut frame = vec![0u8; input.len() + 256];
        let before = self.counters()[Counter::XdpFinished as usize];
        let data_in = [metadata, input].concat();
        // struct xdp_md: `data` is where the frame starts after the metadata.
        let mut md = [0u8; 24];
        md[0..4].copy_from_slice(&(metadata.len() as u32).to_ne_bytes());
        md[4..8].copy_from_slice(&(data_in.len() as u32).to_ne_bytes());
        let ctx_in = (!metadata.is_empty()).then_some(&md[..]);
        let res = prog.test_run(TestRunOptions { data_in: Some(&data_in), ctx_in, data_out: Some(&mut frame), ..TestRunOptions::new() })?;
        let finished = self.counters()[Counter::XdpFinished as usize] > before;
        frame.truncate(res.data_size_out as usize);
        // Newer kernels hand back the metadata in front of the frame; 5.10's
        // test run leaves it out.
        let marks = (frame.len() == input.len() + XDP_HANDOFF_LEN).then(|| {
            let word = |i: usize| u32::from_ne_bytes(frame[i..i + 4].try_into().unwrap());
            let (magic, marks) = (word(0), word(4));
            frame.drain(..XDP_HANDOFF_LEN);
            if magic == XDP_HANDOFF_MAGIC { marks & !XDP_HANDOFF_TRANSLATED } else { 0 }
        });
        Ok(XdpRun { verdict: res.return_value, frame, finished, marks })
    }

    fn program(&self, name: &str) -> &SchedClassifier {
        self.ebpf.program(name).unwrap().try_into().unwrap()
    }

    /// One BPF_PROG_TEST_RUN of `program`: the verdict, the frame as the
    /// program left it, and the skb mark (given in, read back).
    pub fn run(&self, program: &str, input: &[u8], mark: u32) -> Result<(u32, Vec<u8>, u32), ProgramError> {
        let mut out = vec![0u8; input.len() + 256];
        // The head of struct __sk_buff: len, pkt_type (both 0 on input), mark.
        let mut ctx_in = [0u8; 12];
        ctx_in[8..12].copy_from_slice(&mark.to_ne_bytes());
        // The kernel writes back the whole struct (ENOSPC if it does not fit).
        let mut ctx_out = [0u8; 512];
        let res = self.program(program).test_run(TestRunOptions {
            data_in: Some(input),
            data_out: Some(&mut out),
            ctx_in: Some(&ctx_in),
            ctx_out: Some(&mut ctx_out),
            ..TestRunOptions::new()
        })?;
        out.truncate(res.data_size_out as usize);
        Ok((res.return_value, out, u32::from_ne_bytes(ctx_out[8..12].try_into().unwrap())))
    }

    /// One run of `tc_ingress` as timed by the kernel. A single run, not
    /// `repeat`: repeats reuse the same skb, so the second pass would see the
    /// rewritten frame.
    pub fn time_one(&self, input: &[u8]) -> Result<(u32, Duration), ProgramError> {
        let res = self.program(TC_INGRESS).test_run(TestRunOptions { data_in: Some(input), ..TestRunOptions::new() })?;
        Ok((res.return_value, res.duration))
    }

    /// Instructions the verifier processed to accept the program: its
    /// headroom under the kernel's 1,000,000 limit.
    pub fn verified_insns(&self) -> Option<u32> {
        self.program(TC_INGRESS).info().ok()?.verified_instruction_count()
    }

    pub fn counters(&self) -> Vec<u64> {
        self.maps.read_counters().expect("reading counters")
    }
}

/// What `xdp_ingress` did with a frame.
pub struct XdpRun {
    pub verdict: u32,
    pub frame: Vec<u8>,
    /// It decided the frame itself (its `xdp_finished` counter moved): a
    /// drop, or a translation handed to TC.
    pub finished: bool,
    /// The marks it handed to TC; None when the kernel's test run does not
    /// give back the metadata (Linux 5.10).
    pub marks: Option<u32>,
}

pub enum Expect {
    /// Output byte for byte equal to the input.
    Unchanged,
    /// Output equal to this frame, and passing the table's own checks.
    Translated(Vec<u8>),
    /// As `Translated`, for a field the program draws at random: the function
    /// checks that field in the output and builds the frame expected with it.
    TranslatedWith(fn(&[u8]) -> Result<Vec<u8>, String>),
}

pub struct Case {
    pub what: String,
    pub input: Vec<u8>,
    pub verdict: u32,
    pub output: Expect,
    /// Counters that must each move by exactly one; all others must not move.
    pub counters: Vec<Counter>,
    /// A check of the map state after the case ran.
    pub after: Option<fn(&Maps) -> Result<(), String>>,
    /// Run tc_egress with this skb mark instead of tc_ingress.
    pub egress_mark: Option<u32>,
    /// The skb mark the program must leave (`None`: any).
    pub mark: Option<u32>,
}

impl Case {
    pub fn new(what: &str, input: Vec<u8>, verdict: u32, output: Expect, counters: &[Counter]) -> Self {
        Case {
            what: what.to_string(),
            input,
            verdict,
            output,
            counters: counters.to_vec(),
            after: None,
            egress_mark: None,
            mark: None,
        }
    }

    pub fn at_egress(mut self, mark: u32) -> Self {
        self.egress_mark = Some(mark);
        self
    }

    pub fn leaves_mark(mut self, mark: u32) -> Self {
        self.mark = Some(mark);
        self
    }

    pub fn translated(what: &str, input: Vec<u8>, want: Vec<u8>, counter: Counter) -> Self {
        Case::new(what, input, TC_ACT_OK, Expect::Translated(want), &[counter])
    }

    pub fn untouched(what: &str, input: Vec<u8>, counter: Counter) -> Self {
        Case::new(what, input, TC_ACT_UNSPEC, Expect::Unchanged, &[counter])
    }

    pub fn then(mut self, check: fn(&Maps) -> Result<(), String>) -> Self {
        self.after = Some(check);
        self
    }
}

struct Row {
    what: String,
    want: u32,
    got: Option<u32>,
    problems: Vec<String>,
}

/// Runs the cases in order and fails with the whole table if any failed.
/// A translated frame is also verified independently of the program: its
/// checksums recomputed by `frames::recheck`.
pub fn run_table(fx: &Fixture, title: &str, cases: Vec<Case>) {
    run_cases(fx, title, cases, |fx, case| {
        let program = if case.egress_mark.is_some() { TC_EGRESS } else { TC_INGRESS };
        fx.run(program, &case.input, case.egress_mark.unwrap_or(0)).map(|(verdict, frame, mark)| Outcome::tc(verdict, frame, mark))
    })
}

/// The cases `xdp_ingress` must finish itself: an IPv4 TCP, UDP or SCTP
/// packet, not a fragment, that TC translates into a new flow, an
/// established one or a reply, or drops by a frontend's rule. (Rejects,
/// fragments, ICMP, IPv6 and node sockets' replies are TC's.)
fn xdp_finishes(case: &Case) -> bool {
    use Counter::*;
    let ipv4_l4 = frames::is_ipv4_l4_unfragmented(&case.input);
    let translated = case.verdict == TC_ACT_OK
        && case.counters.iter().any(|c| matches!(c, NewFlow | Established | Reply | Rebalanced))
        && !case.counters.iter().any(|c| matches!(c, IcmpErrorTranslated | Fragment | NodeEgress));
    let dropped = case.verdict == TC_ACT_SHOT
        && !case.counters.is_empty()
        && case.counters.iter().all(|c| matches!(c, DropUnallocated | DropSourceRange | DropNoLocal | CtOutOfState));
    case.egress_mark.is_none() && ipv4_l4 && (translated || dropped)
}

/// `run_table` as a node with `--xdp-devices` runs each ingress case:
/// `xdp_ingress` first; a frame it leaves to TC goes through `tc_ingress`
/// unchanged, and one it translated gets only the marks it handed over.
/// The outcome must be what the case wants of TC alone, and each case XDP
/// can finish (`xdp_finishes`) must have been finished there. Egress cases
/// run through `tc_egress` as before (XDP has no egress).
pub fn run_table_through_xdp(fx: &Fixture, title: &str, cases: Vec<Case>) {
    let marks_unseen = std::cell::Cell::new(false);
    run_cases(fx, &format!("{title} (XDP, then TC)"), cases, |fx, case| {
        if let Some(mark) = case.egress_mark {
            return fx.run(TC_EGRESS, &case.input, mark).map(|(verdict, frame, mark)| Outcome::tc(verdict, frame, mark));
        }
        let xdp = fx.run_xdp(&case.input)?;
        marks_unseen.set(marks_unseen.get() || (xdp.finished && xdp.marks.is_none()));
        let must = xdp_finishes(case);
        let in_xdp_problem = |done: bool| match (done, must) {
            (true, false) => Some("XDP decided a case that is TC's"),
            (false, true) => Some("left to TC a case XDP must finish"),
            _ => None,
        };
        let decided = |verdict, mark| Outcome {
            verdict,
            frame: xdp.frame.clone(),
            mark,
            in_xdp: true,
            problem: in_xdp_problem(true),
        };
        Ok(match (xdp.verdict, xdp.finished) {
            (XDP_DROP, true) => decided(TC_ACT_SHOT, Some(0)),
            (XDP_PASS, true) => decided(TC_ACT_OK, xdp.marks),
            (XDP_PASS, false) if xdp.frame == case.input => {
                let (verdict, frame, mark) = fx.run(TC_INGRESS, &case.input, 0)?;
                Outcome { problem: in_xdp_problem(false), ..Outcome::tc(verdict, frame, mark) }
            }
            (verdict, _) => Outcome {
                problem: Some("XDP changed a frame it did not count as decided, or gave another verdict"),
                ..Outcome::tc(verdict, xdp.frame.clone(), 0)
            },
        })
    });
    if marks_unseen.get() {
        println!("(this kernel's test run gives back no XDP metadata: the marks XDP handed to TC were not checked)");
    }
}

/// What one case's run gave: the verdict (as TC's), frame and mark (None:
/// not known, see `XdpRun::marks`); whether XDP decided it (its own counter
/// moves then); a problem with which hook decided it.
struct Outcome {
    verdict: u32,
    frame: Vec<u8>,
    mark: Option<u32>,
    in_xdp: bool,
    problem: Option<&'static str>,
}

impl Outcome {
    fn tc(verdict: u32, frame: Vec<u8>, mark: u32) -> Self {
        Outcome { verdict, frame, mark: Some(mark), in_xdp: false, problem: None }
    }
}

fn run_cases(fx: &Fixture, title: &str, cases: Vec<Case>, run: impl Fn(&Fixture, &Case) -> Result<Outcome, ProgramError>) {
    let mut rows = Vec::new();
    for case in cases {
        let before = fx.counters();
        let mut row = Row { what: case.what.clone(), want: case.verdict, got: None, problems: Vec::new() };
        let mut counters = case.counters.clone();
        match run(fx, &case) {
            Err(e) => row.problems.push(format!("BPF_PROG_TEST_RUN failed: {}", error_chain(&e))),
            Ok(Outcome { verdict, frame: out, mark, in_xdp, problem }) => {
                row.problems.extend(problem.map(str::to_string));
                if in_xdp {
                    counters.push(Counter::XdpFinished);
                }
                if let (Some(want), Some(mark)) = (case.mark, mark)
                    && mark != want
                {
                    row.problems.push(format!("skb mark {mark:#x}, want {want:#x}"));
                }
                row.got = Some(verdict);
                if verdict != case.verdict {
                    row.problems.push(format!("verdict {}, want {}", verdict_name(verdict), verdict_name(case.verdict)));
                }
                match &case.output {
                    Expect::Unchanged => {
                        if out != case.input {
                            row.problems.push(format!("frame changed: {}", diff(&case.input, &out)));
                        }
                    }
                    Expect::Translated(want) => {
                        if &out != want {
                            row.problems.push(format!("frame differs from expected: {}", diff(want, &out)));
                        }
                        row.problems.extend(frames::recheck(&out, want).err());
                    }
                    Expect::TranslatedWith(expected) => match expected(&out) {
                        Err(e) => row.problems.push(e),
                        Ok(want) => {
                            if out != want {
                                row.problems.push(format!("frame differs from expected: {}", diff(&want, &out)));
                            }
                            row.problems.extend(frames::recheck(&out, &want).err());
                        }
                    },
                }
            }
        }
        let after = fx.counters();
        row.problems.extend(check_counters(&before, &after, &counters).err());
        if let Some(check) = case.after {
            row.problems.extend(check(&fx.maps).err());
        }
        rows.push(row);
    }

    let report = render(title, &rows);
    println!("{report}");
    let failed = rows.iter().filter(|r| !r.problems.is_empty()).count();
    assert_eq!(failed, 0, "{failed} of {} {title} fixtures failed\n{report}", rows.len());
}

/// The differing bytes (the first 12), each named by the field of `want` it is in.
pub fn diff(want: &[u8], got: &[u8]) -> String {
    let mut parts = Vec::new();
    if want.len() != got.len() {
        parts.push(format!("length {} (want {})", got.len(), want.len()));
    }
    let offs: Vec<usize> = (0..want.len().min(got.len())).filter(|&i| want[i] != got[i]).collect();
    for &i in offs.iter().take(12) {
        parts.push(format!("byte {i} [{}] {:#04x} (want {:#04x})", frames::field(want, i), got[i], want[i]));
    }
    if offs.len() > 12 {
        parts.push(format!("... {} bytes differ", offs.len()));
    }
    parts.join(", ")
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(inner) = source {
        let _ = write!(s, ": {inner}");
        source = inner.source();
    }
    s
}

pub fn verdict_name(v: u32) -> String {
    match v {
        TC_ACT_OK => "OK".into(),
        TC_ACT_SHOT => "SHOT".into(),
        TC_ACT_UNSPEC => "UNSPEC".into(),
        TC_ACT_REDIRECT => "REDIRECT".into(),
        v => format!("{v:#x}"),
    }
}

pub fn xdp_verdict_name(v: u32) -> String {
    match v {
        0 => "XDP_ABORTED".into(),
        XDP_DROP => "XDP_DROP".into(),
        XDP_PASS => "XDP_PASS".into(),
        XDP_TX => "XDP_TX".into(),
        XDP_REDIRECT => "XDP_REDIRECT".into(),
        v => format!("{v:#x}"),
    }
}

fn render(title: &str, rows: &[Row]) -> String {
    let mut s = format!("\n{title} fixtures\n  #  result  want    got     case\n");
    for (i, r) in rows.iter().enumerate() {
        let result = if r.problems.is_empty() { "pass" } else { "FAIL" };
        let got = r.got.map(verdict_name).unwrap_or_else(|| "-".into());
        let _ = writeln!(s, "{:>3}  {result:<6}  {:<6}  {got:<6}  {}", i + 1, verdict_name(r.want), r.what);
        for p in &r.problems {
            let _ = writeln!(s, "{:>18}- {p}", "");
        }
    }
    let passed = rows.iter().filter(|r| r.problems.is_empty()).count();
    let _ = write!(s, "{passed}/{} passed", rows.len());
    s
}

/// Every counter moved exactly as listed.
pub fn check_counters(before: &[u64], after: &[u64], want: &[Counter]) -> Result<(), String> {
    let mut bad = Vec::new();
    for (i, counter) in Counter::ALL.iter().enumerate() {
        let name = counter.name();
        let expected = want.iter().filter(|c| *c == counter).count() as u64;
        let moved = after[i] - before[i];
        if moved != expected {
            bad.push(format!("{name} +{moved} (want +{expected})"));
        }
    }
    if bad.is_empty() { Ok(()) } else { Err(format!("counters: {}", bad.join(", "))) }
}
