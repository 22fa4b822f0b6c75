//! `xtask bench`

use std::process::ExitCode;

pub fn run() -> ExitCode {
    eprintln!("not implemented yet (issue 7)");
    ExitCode::from(2)
}
