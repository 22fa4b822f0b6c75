use which::which;

/// The BPF object depends on the bpf-linker binary, which cargo cannot see:
/// rebuild when it changes (a new toolchain brings a new linker).
fn main() {
    let bpf_linker = which("bpf-linker").expect("bpf-linker on PATH (./x installs it)");
    println!("cargo:rerun-if-changed={}", bpf_linker.display());
}
