//! `cargo bench -p proxy-tests --bench sctp_test_run [-- SAMPLES]` (root):
//! ns per packet of the real `tc_ingress` for SCTP with and without a port
//! rewrite, from BPF_PROG_TEST_RUN. See proxy_tests::sctp_bench.

fn main() -> anyhow::Result<()> {
    // `cargo bench` passes `--bench`; the first number, if any, is the sample count.
    let samples = std::env::args().skip(1).find_map(|a| a.parse().ok()).unwrap_or(20_000);
    if let Some(n) = proxy_tests::sctp_bench::verified_insns()? {
        println!("verifier: tc_ingress accepted after {n} processed instructions (limit 1000000)");
    }
    for row in proxy_tests::sctp_bench::measure(samples)? {
        println!("{row}");
    }
    Ok(())
}
