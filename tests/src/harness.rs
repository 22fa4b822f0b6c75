//! The test runner of the test binaries whose tests need root: libtest's
//! own, with the tests marked `#[ignore = "needs root (...)"]` run when the
//! process is root. Without root they stay ignored and libtest prints the
//! reason ("ignored, needs root (...)"), so a run without root skips them
//! cleanly instead of failing.
//!
//! libtest decides "ignored" when the binary is compiled; test-with's
//! `#[root]` does too (in its proc macro), so a binary built as root and run
//! as another user, or the other way round, would get the wrong answer. Here
//! the decision is made when the binary starts. A test file opts in with
//!
//! ```text
//! #![feature(custom_test_frameworks)]
//! #![test_runner(proxy_tests::harness::run)]
//! ```

use std::process::ExitCode;

use test::{TestDescAndFn, TestFn};

/// What an `#[ignore = "..."]` message starts with to mean "runs as root only".
pub const NEEDS_ROOT: &str = "needs root";

/// Runs `tests` as libtest's generated main would, the root-only ones
/// un-ignored when we are root.
pub fn run(tests: &[&TestDescAndFn]) {
    let root = crate::is_root();
    let mut owned: Vec<TestDescAndFn> = tests.iter().map(|t| with_root(t, root)).collect();
    // libtest's own main hands them sorted by name; so does this one.
    owned.sort_by(|a, b| a.desc.name.as_slice().cmp(b.desc.name.as_slice()));
    let tests: Vec<&TestDescAndFn> = owned.iter().collect();
    let args: Vec<String> = std::env::args().collect();
    if test::test_main(&args, &tests) != ExitCode::SUCCESS {
        std::process::exit(test::ERROR_EXIT_CODE.into());
    }
}

fn with_root(t: &TestDescAndFn, root: bool) -> TestDescAndFn {
    let mut desc = t.desc.clone();
    if root && desc.ignore && desc.ignore_message.is_some_and(|m| m.starts_with(NEEDS_ROOT)) {
        desc.ignore = false;
        desc.ignore_message = None;
    }
    let testfn = match &t.testfn {
        TestFn::StaticTestFn(f) => TestFn::StaticTestFn(*f),
        TestFn::StaticBenchFn(f) => TestFn::StaticBenchFn(*f),
        TestFn::StaticBenchAsTestFn(f) => TestFn::StaticBenchAsTestFn(*f),
        TestFn::DynTestFn(f) => TestFn::DynTestFn(f.clone()),
        TestFn::DynBenchFn(f) => TestFn::DynBenchFn(f.clone()),
        TestFn::DynBenchAsTestFn(f) => TestFn::DynBenchAsTestFn(f.clone()),
    };
    TestDescAndFn { desc, testfn }
}

#[cfg(test)]
mod tests {
    /// Without the runner, libtest would ignore a root-only test even as root:
    /// every test file that marks one must name the runner.
    #[test]
    fn every_file_with_root_only_tests_runs_them_through_this_runner() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
        let mut missing = Vec::new();
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let text = std::fs::read_to_string(&path).unwrap();
            if text.contains(&format!("#[ignore = \"{}", super::NEEDS_ROOT))
                && !text.contains("#![test_runner(proxy_tests::harness::run)]")
            {
                missing.push(path.display().to_string());
            }
        }
        assert!(missing.is_empty(), "root-only tests that would never run, add the runner: {missing:?}");
    }
}
