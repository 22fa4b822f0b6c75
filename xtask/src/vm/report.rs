//! What a kernel's run came to: libtest's totals (the same [`Summary`] as
//! `xtask test`), whether the VM finished, and where to look when not.

use std::{
    fs,
    path::{Path, PathBuf},
};

use super::boot::{Accel, Outcome, Run};
use crate::test::Summary;

pub struct KernelResult {
    pub series: String,
    /// `uname -r` of the kernel, when it was resolved.
    pub release: Option<String>,
    pub accel: Option<Accel>,
    pub run: Option<Run>,
    pub summary: Summary,
    /// One line per distinct verifier log (see [`keep_verifier_output`]).
    pub verifier: Vec<String>,
    /// target/vm-test/<series>/
    pub out: PathBuf,
    /// Why there was no run (the kernel or the initrd could not be had).
    pub error: Option<String>,
}

impl KernelResult {
    pub fn ok(&self) -> bool {
        self.error.is_none()
            && self.summary.failed == 0
            && self.summary.binaries > 0
            && matches!(&self.run, Some(Run { outcome: Outcome::Finished { rc }, .. }) if rc == "0")
    }

    /// The closing line for this kernel: `vm-test <release>: N passed, ...`.
    pub fn line(&self) -> String {
        let s = &self.summary;
        let mut line = format!(
            "vm-test {}: {} passed, {} failed, {} skipped",
            self.release.as_deref().unwrap_or(&self.series),
            s.passed,
            s.failed,
            s.ignored
        );
        let why = match (&self.error, self.run.as_ref().map(|r| &r.outcome)) {
            (Some(e), _) => Some(format!("not run: {e}")),
            (None, Some(Outcome::NoBoot { after })) => Some(format!("VM did not boot within {}s", after.as_secs())),
            (None, Some(Outcome::Timeout { after })) => Some(format!(
                "VM did not finish within {}s (timeout{})",
                after.as_secs(),
                self.last_running().map_or(String::new(), |t| format!(" in {t}"))
            )),
            (None, Some(Outcome::Exited { status })) => Some(format!("VM stopped before the tests were done ({status})")),
            (None, Some(Outcome::Finished { rc })) if rc != "0" && s.failed == 0 => Some(format!("run ended with {rc}")),
            _ => None,
        };
        if let Some(why) = why {
            line += &format!(" ({why})");
        }
        line
    }

    /// The test binary the console last said was running.
    fn last_running(&self) -> Option<String> {
        let console = fs::read_to_string(self.out.join("console.log")).ok()?;
        let line = console.lines().rev().find_map(|l| l.trim_start().strip_prefix("Running "))?;
        Some(line.split_whitespace().next()?.to_string())
    }

    /// On failure: where the console, the test output, the agents' logs
    /// and the verifier's complaints are kept.
    pub fn print_where(&self) {
        if self.ok() || self.error.is_some() {
            return;
        }
        let rel = |p: &Path| p.display().to_string();
        eprintln!("==> vm-test {}: kept for the post-mortem:", self.series);
        for (what, file) in [
            ("console", "console.log"),
            ("test output", "tests.log"),
            ("kernel log", "dmesg.log"),
            ("verifier output", "verifier.log"),
        ] {
            let p = self.out.join(file);
            if p.exists() {
                eprintln!("    {what:16} {}", rel(&p));
            }
        }
        let logs = self.out.join("agent-logs");
        let n = fs::read_dir(&logs).map(|d| d.count()).unwrap_or(0);
        if n > 0 {
            eprintln!("    {:16} {} ({n} files)", "agent logs", rel(&logs));
        }
        for g in &self.verifier {
            eprintln!("    verifier: {g}");
        }
    }
}

/// libtest's totals from the VM's test output.
pub fn summarize(out: &Path) -> Summary {
    let mut summary = Summary::default();
    let text = fs::read_to_string(out.join("tests.log"))
        .or_else(|_| fs::read_to_string(out.join("console.log")))
        .unwrap_or_default();
    for line in text.lines() {
        summary.add(line);
    }
    summary
}

/// Copies what the BPF verifier said (from the test output and the agents'
/// logs) into `verifier.log`, each distinct rejection once, so a load failure on
/// an old kernel is found without reading the whole console. Returns one
/// short line per distinct log: what was rejected, and the verifier's last
/// complaint.
pub fn keep_verifier_output(out: &Path) -> Vec<String> {
    let mut sources = vec![out.join("tests.log")];
    if let Ok(dir) = fs::read_dir(out.join("agent-logs")) {
        let mut logs: Vec<PathBuf> = dir.filter_map(|e| Some(e.ok()?.path())).collect();
        logs.sort();
        sources.extend(logs);
    }
    let (mut kept, mut gist) = (String::new(), Vec::new());
    for src in sources {
        let Ok(text) = fs::read_to_string(&src) else { continue };
        let lines: Vec<&str> = text.lines().collect();
        let mut i = 0;
        while i < lines.len() {
            if !lines[i].contains("Verifier output") && !lines[i].contains("verifier log") {
                i += 1;
                continue;
            }
            // The verifier's log runs until the test harness speaks again.
            let end = (i + 1..lines.len())
                .find(|&j| {
                    let l = lines[j];
                    l.starts_with("test ") || l.starts_with("---- ") || l.starts_with("Stack backtrace:") || l == "failures:"
                })
                .unwrap_or(lines.len());
            // The complaint is the line before the verifier's statistics.
            let block = &lines[i..end];
            let last = block
                .iter()
                .position(|l| l.trim_start().starts_with("verification time") || l.trim_start().starts_with("processed "))
                .and_then(|k| k.checked_sub(1))
                .map_or("", |k| block[k].trim());
            let head = lines[i].split(". Verifier output").next().unwrap_or("").trim();
            let head = head.trim_start_matches("ebpf-proxy: error: ");
            let line = format!("{} -> {last}", head.chars().take(160).collect::<String>());
            // Every test that starts an agent hits the same rejection: keep it once.
            if !gist.contains(&line) {
                kept += &format!("==> {}:{}\n{}\n\n", src.display(), i + 1, block.join("\n"));
                gist.push(line);
            }
            i = end;
        }
    }
    if !kept.is_empty() {
        let _ = fs::write(out.join("verifier.log"), kept);
    }
    gist
}
