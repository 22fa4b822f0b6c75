//! Command line, with kube-proxy's flag names where kube-proxy has the same idea.

use std::{net::SocketAddr, path::PathBuf};

use ipnet::IpNet;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::{dump::Output, model::LbAlgorithm};

pub const DEFAULT_BPFFS_ROOT: &str = "/sys/fs/bpf/ebpf-proxy";

#[derive(Parser, Debug)]
#[command(name = "ebpf-proxy", version, about = "A kube-proxy replacement: Kubernetes Services translated by eBPF")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run the agent: watch Services and EndpointSlices, program the dataplane.
    Run(RunArgs),
    /// Show what the dataplane holds (reads the pinned maps; works with the agent stopped).
    Dump {
        what: DumpWhat,
        #[arg(short = 'o', long, value_enum, default_value = "table")]
        output: Output,
        #[arg(long, default_value = DEFAULT_BPFFS_ROOT)]
        bpffs_root: PathBuf,
    },
    /// What the dataplane would do with one packet: runs the real program on a
    /// synthetic packet against the live maps, without changing conntrack.
    Trace {
        /// Client address, IP or IP:PORT (port default 40000).
        #[arg(long, value_name = "IP[:PORT]")]
        from: crate::trace::Source,
        /// Destination, e.g. 10.96.0.10:80/TCP.
        #[arg(long, value_name = "IP:PORT/PROTO")]
        to: crate::trace::Destination,
        #[arg(short = 'o', long, value_enum, default_value = "table")]
        output: Output,
        #[arg(long, default_value = DEFAULT_BPFFS_ROOT)]
        bpffs_root: PathBuf,
    },
    /// Remove every program link and pinned map the agent installed, and nothing else.
    Cleanup {
        #[arg(long, default_value = DEFAULT_BPFFS_ROOT)]
        bpffs_root: PathBuf,
    },
    /// Print a shell completion script, e.g. `ebpf-proxy completion bash > /etc/bash_completion.d/ebpf-proxy`.
    Completion { shell: clap_complete::Shell },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TcAttachMode {
    Auto,
    Tcx,
    Netlink,
}

/// `--xdp-mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum XdpAttachMode {
    /// Native where the driver has it, else generic.
    Auto,
    /// In the driver (veth, most 10G+ NICs); refused where it has none.
    Native,
    /// In the stack, after the skb is built: any device, less gain.
    Generic,
    /// No XDP, whatever --xdp-devices says.
    Off,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DumpWhat {
    Services,
    Backends,
    Conntrack,
}

#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    /// Read Services and EndpointSlices from the YAML/JSON files under DIR, live.
    #[arg(long, value_name = "DIR", conflicts_with = "kubeconfig")]
    pub manifests: Option<PathBuf>,
    /// Watch the Kubernetes API with this kubeconfig. With neither this nor
    /// --manifests, the in-cluster configuration (service account) is used.
    #[arg(long, value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,
    /// This node's name (endpoints on it are local). Default: $NODE_NAME, then the hostname.
    #[arg(long, env = "NODE_NAME")]
    pub node_name: Option<String>,
    /// Attach only to these interfaces. Default: every non-loopback
    /// interface, including ones that appear later. Loopback's egress is
    /// always attached (the node's own packets to its own NodePorts).
    #[arg(long, value_delimiter = ',', value_name = "IFACE[,IFACE]")]
    pub devices: Option<Vec<String>>,
    /// Also run the translation in XDP on these interfaces, before TC: the
    /// external ones, where NodePort, ExternalIP and LoadBalancer traffic
    /// comes in. IPv4 TCP, UDP and SCTP; anything else goes on to TC.
    #[arg(long, value_delimiter = ',', value_name = "IFACE[,IFACE]")]
    pub xdp_devices: Vec<String>,
    /// How XDP is attached to --xdp-devices.
    #[arg(long, value_enum, default_value = "auto", env = "EBPF_PROXY_XDP_MODE")]
    pub xdp_mode: XdpAttachMode,
    /// Where maps and links are pinned. One agent per directory: a second
    /// one on it refuses to start.
    #[arg(long, default_value = DEFAULT_BPFFS_ROOT)]
    pub bpffs_root: PathBuf,
    /// /healthz and /livez, with kube-proxy's JSON body.
    #[arg(long, default_value = "0.0.0.0:10256")]
    pub healthz_bind_address: SocketAddr,
    /// /metrics, Prometheus text.
    #[arg(long, default_value = "127.0.0.1:10249")]
    pub metrics_bind_address: SocketAddr,
    /// Pod CIDRs: sources inside are in-cluster; others reaching a ClusterIP
    /// are masqueraded. Default: only the node's own processes are in-cluster.
    #[arg(long, value_delimiter = ',', value_name = "CIDR[,CIDR]")]
    pub cluster_cidr: Vec<IpNet>,
    /// Service CIDRs: traffic to an address here that no Service owns is
    /// dropped. The cluster's ServiceCIDR objects replace them where any exist.
    #[arg(long, value_delimiter = ',', value_name = "CIDR[,CIDR]")]
    pub service_cidr: Vec<IpNet>,
    /// NodePorts open only on node addresses inside these CIDRs. Default: every node address.
    #[arg(long, value_delimiter = ',', value_name = "CIDR[,CIDR]")]
    pub node_port_addresses: Vec<IpNet>,
    /// cgroup v2 directory whose processes get services at the socket (the
    /// node's own traffic). Default: the cgroup v2 root.
    #[arg(long, value_name = "DIR")]
    pub cgroup_root: Option<PathBuf>,
    /// Where the host's sysctls are (`net/ipv4/conf/lo/accept_local` is set
    /// there: see docs/operations.md). A container's /proc/sys is read-only:
    /// mount the host's /proc/sys/net under DIR/net.
    #[arg(long, default_value = "/proc/sys", value_name = "DIR")]
    pub sysctl_root: PathBuf,
    /// Masquerade every flow to a ClusterIP, whatever its source.
    #[arg(long)]
    pub masquerade_all: bool,
    /// NodePorts also on 127.0.0.1 for the node's own processes (kube-proxy's
    /// --iptables-localhost-nodeports), if --node-port-addresses admits it.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub localhost_nodeports: bool,
    /// How the TC programs are attached: `auto` probes for TCX links (Linux
    /// 6.6+, and backports) and falls back to clsact filters over netlink.
    #[arg(long, value_enum, default_value = "auto", env = "EBPF_PROXY_TC_ATTACH")]
    pub tc_attach: TcAttachMode,
    /// Conntrack entries per CPU, as kube-proxy's flag; the table holds this
    /// times the CPUs, at least --conntrack-min (0: --conntrack-min alone).
    /// Fixed when the maps are first pinned: see docs/operations.md.
    #[arg(long, default_value_t = crate::map_sizes::DEFAULT_MAX_PER_CORE, value_name = "N")]
    pub conntrack_max_per_core: u32,
    /// The least conntrack entries, whatever the CPUs.
    #[arg(long, default_value_t = crate::map_sizes::DEFAULT_MIN, value_name = "N")]
    pub conntrack_min: u32,
    /// Entries of the service maps FRONTENDS, BACKEND_SLOTS and BACKENDS
    /// (SERVICE_NAMES gets half, SOURCE_RANGES a sixteenth). A Service that
    /// does not fit is skipped, named and counted. Fixed when the maps are
    /// first pinned: see docs/operations.md.
    #[arg(long, default_value_t = crate::map_sizes::DEFAULT_SERVICE_MAP_ENTRIES, value_name = "N")]
    pub service_map_entries: u32,
    /// How a new flow picks its backend in Services without the
    /// `ebpf-proxy.io/lb-algorithm` annotation: `random`, or `maglev`
    /// (consistent hashing of the 5-tuple: every node picks the same backend).
    #[arg(long, value_enum, default_value = "random")]
    pub lb_algorithm: LbAlgorithm,
    /// Cells of each Maglev table (M): a prime, at most 16381. The same on every node.
    #[arg(long, default_value_t = proxy_common::DEFAULT_MAGLEV_TABLE_SIZE, value_parser = crate::maglev::parse_table_size, value_name = "PRIME")]
    pub maglev_table_size: u32,
    /// The seed of Maglev's hashes, decimal or 0x-hexadecimal (32 bits). The
    /// same on every node; secret, so clients cannot aim at a backend.
    #[arg(long, env = "EBPF_PROXY_MAGLEV_SEED", default_value = "0", value_parser = crate::maglev::parse_seed, value_name = "U32", hide_env_values = true)]
    pub maglev_seed: u32,
}
