//! What the running kernel offers, found by probing, never by reading its
//! version: distributions backport (RHEL 9.4's 5.14 has TCX). Features the
//! datapath can do without get a fallback chosen at load; a missing feature
//! it needs stops the agent with one line naming it and the first Linux
//! release that has it.

use anyhow::{Result, bail};
use aya::{
    programs::{ProgramError, ProgramType},
    sys::{BpfHelper, is_helper_supported, is_program_supported},
};

/// The oldest kernel the programs are tested on (`./x vm-test`).
pub const MIN_KERNEL: &str = "5.10";

/// Optional kernel features the programs adapt to (loader-set globals).
#[derive(Debug, Clone, Copy)]
pub struct Features {
    /// `bpf_ktime_get_coarse_ns` (5.11): else conntrack reads the fine clock.
    pub coarse_clock: bool,
    /// `bpf_set_retval` in the socket hooks (5.18): else a refused
    /// connect() fails with EPERM instead of ECONNREFUSED.
    pub sock_set_retval: bool,
}

/// Checks that BPF is usable at all, then probes the optional helpers.
pub fn probe() -> Result<Features> {
    match is_program_supported(ProgramType::SchedClassifier) {
        Ok(true) => {}
        Ok(false) => bail!(
            "this kernel cannot load TC BPF programs (needs CONFIG_BPF_SYSCALL and CONFIG_NET_CLS_BPF, Linux {MIN_KERNEL} or newer)"
        ),
        Err(e) => bail!(
            "BPF is not usable by this process ({}): CAP_BPF, CAP_NET_ADMIN and CAP_PERFMON are needed, and a kernel with \
             CONFIG_BPF_SYSCALL (Linux {MIN_KERNEL} or newer)",
            probe_error(&e)
        ),
    }
    let helper = |ty, h| is_helper_supported(ty, h).unwrap_or(false);
    Ok(Features {
        coarse_clock: helper(ProgramType::SchedClassifier, BpfHelper::BPF_FUNC_ktime_get_coarse_ns),
        sock_set_retval: helper(ProgramType::CgroupSockAddr, BpfHelper::BPF_FUNC_set_retval),
    })
}

fn probe_error(e: &ProgramError) -> String {
    match e {
        ProgramError::SyscallError(s) => s.io_error.to_string(),
        e => e.to_string(),
    }
}

/// A program the kernel refused, in words an operator can act on: which
/// feature the program needs and where it arrived, then the verifier's
/// last lines (the whole log is at debug level).
pub fn rejected(program: &str, e: &ProgramError) -> anyhow::Error {
    let needs = match program {
        p if p.starts_with("sock_getpeername") => Some("getpeername socket hooks (Linux 5.8)"),
        p if p.starts_with("sock_") => Some("cgroup socket address hooks (Linux 5.8 for the full set)"),
        _ => None,
    };
    let detail = match e {
        ProgramError::LoadError { io_error, verifier_log } => {
            tracing::debug!(program, "verifier log:\n{verifier_log}");
            let log = verifier_log.to_string();
            // The complaint comes before the closing statistics lines.
            let stats = ["verification time", "stack depth", "processed "];
            let is_stat = |l: &&str| stats.iter().any(|s| l.trim_start().starts_with(s));
            let lines: Vec<&str> = log.lines().filter(|l| !l.trim().is_empty()).collect();
            let mut tail: Vec<&str> = lines.iter().rev().filter(|l| !is_stat(l)).take(3).copied().collect();
            tail.reverse();
            let stats: Vec<&str> = lines.iter().filter(|l| is_stat(l)).copied().collect();
            format!("{io_error}; verifier: {} ({})", tail.join(" | "), stats.join(" | "))
        }
        e => e.to_string(),
    };
    match needs {
        Some(needs) => anyhow::anyhow!(
            "the kernel rejected {program}, which needs {needs}; ebpf-proxy supports Linux {MIN_KERNEL} and newer ({detail})"
        ),
        None => anyhow::anyhow!("the kernel rejected {program} (ebpf-proxy supports Linux {MIN_KERNEL} and newer): {detail}"),
    }
}
