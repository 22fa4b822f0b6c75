use clap::Parser;
use proxy_user::{
    agent, cleanup,
    cli::{Cli, Command},
    dump, trace,
};
use tracing_subscriber::EnvFilter;

fn main() {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let result = match cli.command {
        Command::Run(args) => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .map_err(anyhow::Error::from)
            .and_then(|rt| rt.block_on(agent::run(args))),
        Command::Dump { what, output, bpffs_root } => dump::print(what, output, &bpffs_root),
        Command::Cleanup { bpffs_root } => cleanup::cleanup(&bpffs_root),
        Command::Trace { from, to, output, bpffs_root } => trace::print(from, to, output, &bpffs_root),
        Command::Completion { shell } => {
            let mut cmd = <Cli as clap::CommandFactory>::command();
            clap_complete::generate(shell, &mut cmd, "ebpf-proxy", &mut std::io::stdout());
            Ok(())
        }
    };
    if let Err(e) = result {
        // One line: what failed and why.
        eprintln!("ebpf-proxy: error: {e:#}");
        std::process::exit(1);
    }
}
