//! Programs through the kernel's verifier: most of the agent's start. The
//! kernel verifies privileged loads concurrently, so the programs go through
//! on one thread per CPU, longest first; a refusal is an error in an
//! operator's words (`kernel::rejected`).

use std::{collections::HashMap, sync::Mutex, time::Instant};

use anyhow::{Context, Result};
use aya::{Ebpf, programs::Program};
use tracing::debug;

use crate::{kernel::rejected, maps::BPF_OBJECT};

/// Verifies the programs `names` of `ebpf` (each one once, in any order);
/// the first refusal is the error, and the others still finish first.
pub fn verify_all(ebpf: &mut Ebpf, names: &[&str]) -> Result<()> {
    let mut queue: Vec<(&str, &mut Program)> = ebpf.programs_mut().filter(|(name, _)| names.contains(name)).collect();
    if let Some(missing) = names.iter().find(|n| !queue.iter().any(|(name, _)| name == *n)) {
        anyhow::bail!("program {missing} missing from the BPF object");
    }
    // Longest last in the queue, so first off it: roughly the ones the
    // verifier takes longest on (a small program with a long loop, as
    // tc_masquerade6, can take longer than its size says).
    let size = instruction_counts();
    queue.sort_by_key(|(name, _)| size.get(*name).copied().unwrap_or(0));
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(queue.len());
    let queue = Mutex::new(queue);
    let take = || queue.lock().unwrap_or_else(|e| e.into_inner()).pop();
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| -> Result<()> {
                    while let Some((name, program)) = take() {
                        verify(name, program)?;
                    }
                    Ok(())
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap_or_else(|_| Err(anyhow::anyhow!("a verifier thread panicked")))).collect()
    })
}

/// One program through the verifier, its time and work at debug level.
fn verify(name: &str, program: &mut Program) -> Result<()> {
    let started = Instant::now();
    let loaded = match program {
        Program::SchedClassifier(p) => p.load(),
        Program::Xdp(p) => p.load(),
        Program::CgroupSockAddr(p) => p.load(),
        other => anyhow::bail!("{name}: a {:?} program, which the agent does not load", other.prog_type()),
    };
    loaded.map_err(|e| rejected(name, &e))?;
    let ms = started.elapsed().as_millis() as u64;
    // Linux 5.16 reports the instructions the verifier walked.
    let walked = program.info().ok().and_then(|i| i.verified_instruction_count());
    debug!(program = name, ms, verified_insns = walked, "program loaded");
    Ok(())
}

/// Each program's instruction count in the BPF object (its own function,
/// without the subprograms it calls).
fn instruction_counts() -> HashMap<String, usize> {
    let Ok(object) = aya_obj::Object::parse(BPF_OBJECT).context("parsing the BPF object") else { return HashMap::new() };
    object
        .programs
        .iter()
        .filter_map(|(name, p)| Some((name.clone(), object.functions.get(&p.function_key())?.instructions.len())))
        .collect()
}
