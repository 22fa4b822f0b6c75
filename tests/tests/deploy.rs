//! deploy/ as the cluster will read it: every file parses as typed Kubernetes
//! objects (no unknown field, no unexpected kind), the ClusterRole grants
//! exactly the API calls the agent makes (proxy_user::rbac::API_ACCESS), the
//! DaemonSet's command line parses with the real CLI and its probes, mounts
//! and ServiceAccount line up with it, and the capabilities it grants are
//! enough to run the agent (TC programs and socket hooks) and none of them
//! can be left out. The container is bounded: a memory limit above the
//! agent's measured use, a request to match, and the runtime's default
//! seccomp filter.

#![feature(custom_test_frameworks)]
#![test_runner(proxy_tests::harness::run)]

use std::{
    collections::BTreeSet,
    net::Ipv4Addr,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context, Result, bail, ensure};
use clap::{CommandFactory, Parser};
use k8s_openapi::{
    api::{
        apps::v1::DaemonSet,
        core::v1::{ConfigMap, Container, ServiceAccount},
        rbac::v1::{ClusterRole, ClusterRoleBinding},
    },
    apimachinery::pkg::util::intstr::IntOrString,
};
use proxy_tests::{
    agent::{Agent, tc_attached},
    bpffs::Bpffs,
    manifests::echo_service,
    topology::Node,
};
use proxy_user::{
    cli::{Cli, Command, RunArgs},
    rbac::API_ACCESS,
};
use serde::{Deserialize, Serialize, de::DeserializeOwned};

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// Everything deploy/ holds, typed.
#[derive(Default)]
struct Deploy {
    service_accounts: Vec<ServiceAccount>,
    cluster_roles: Vec<ClusterRole>,
    bindings: Vec<ClusterRoleBinding>,
    daemon_sets: Vec<DaemonSet>,
    config_maps: Vec<ConfigMap>,
}

/// Parses `doc` as `T` and fails if anything in it did not land in a typed
/// field: k8s-openapi ignores unknown fields, so compare the round trip.
fn typed<T: DeserializeOwned + Serialize>(doc: &serde_json::Value, at: &str) -> Result<T> {
    let obj: T = serde_path_to_error::deserialize(doc).with_context(|| at.to_string())?;
    let back = serde_json::to_value(&obj)?;
    if let Some(path) = first_difference(doc, &back, String::new()) {
        bail!("{at}: field {path} is not part of the typed object (misspelt or misplaced?)");
    }
    Ok(obj)
}

/// The path of the first value in `a` that `b` lacks or holds differently.
fn first_difference(a: &serde_json::Value, b: &serde_json::Value, path: String) -> Option<String> {
    use serde_json::Value::*;
    match (a, b) {
        (Object(x), Object(y)) => x.iter().find_map(|(k, v)| match y.get(k) {
            Some(w) => first_difference(v, w, format!("{path}.{k}")),
            None => Some(format!("{path}.{k}")),
        }),
        (Array(x), Array(y)) if x.len() == y.len() => {
            x.iter().zip(y).enumerate().find_map(|(i, (v, w))| first_difference(v, w, format!("{path}[{i}]")))
        }
        _ if a == b => None,
        _ => Some(if path.is_empty() { ".".into() } else { path }),
    }
}

fn load_deploy() -> Result<Deploy> {
    let mut d = Deploy::default();
    let mut files: Vec<PathBuf> = std::fs::read_dir(deploy_dir())?.map(|e| e.map(|e| e.path())).collect::<Result<_, _>>()?;
    files.sort();
    for path in files {
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        ensure!(matches!(ext, "yaml" | "yml" | "json"), "{}: deploy/ holds only manifests", path.display());
        let text = std::fs::read_to_string(&path)?;
        for (i, doc) in serde_yaml::Deserializer::from_str(&text).enumerate() {
            let at = format!("{} document {}", path.display(), i + 1);
            let value = serde_json::Value::deserialize(doc).with_context(|| at.clone())?;
            if value.is_null() {
                continue;
            }
            let kind = (value["apiVersion"].as_str().unwrap_or(""), value["kind"].as_str().unwrap_or(""));
            match kind {
                ("v1", "ServiceAccount") => d.service_accounts.push(typed(&value, &at)?),
                ("v1", "ConfigMap") => d.config_maps.push(typed(&value, &at)?),
                ("rbac.authorization.k8s.io/v1", "ClusterRole") => d.cluster_roles.push(typed(&value, &at)?),
                ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding") => d.bindings.push(typed(&value, &at)?),
                ("apps/v1", "DaemonSet") => d.daemon_sets.push(typed(&value, &at)?),
                (api, kind) => bail!("{at}: unexpected object {api} {kind}"),
            }
        }
    }
    Ok(d)
}

fn one<'a, T>(list: &'a [T], what: &str) -> Result<&'a T> {
    ensure!(list.len() == 1, "deploy/ should hold exactly one {what}, found {}", list.len());
    Ok(&list[0])
}

fn container(ds: &DaemonSet) -> Result<&Container> {
    let pod = ds.spec.as_ref().and_then(|s| s.template.spec.as_ref()).context("DaemonSet without a pod spec")?;
    ensure!(pod.containers.len() == 1, "one container expected");
    Ok(&pod.containers[0])
}

/// The container's command line, parsed by the agent's own CLI.
fn run_args(c: &Container) -> Result<RunArgs> {
    let argv: Vec<String> = c.command.iter().flatten().chain(c.args.iter().flatten()).cloned().collect();
    // Where `cargo xtask image` and the Containerfile put the binary.
    ensure!(argv.first().map(String::as_str) == Some("/usr/local/bin/ebpf-proxy"), "the container runs {argv:?}");
    match Cli::try_parse_from(&argv).map_err(|e| anyhow::anyhow!("DaemonSet args {argv:?}: {e}"))?.command {
        Command::Run(args) => Ok(args),
        other => bail!("the DaemonSet runs {other:?}, not `run`"),
    }
}

/// The capabilities the container adds, as setpriv names them.
fn added_caps(c: &Container) -> Result<Vec<String>> {
    let caps = c.security_context.as_ref().and_then(|s| s.capabilities.as_ref()).context("no capabilities in securityContext")?;
    ensure!(caps.drop.as_deref() == Some(&["ALL".to_string()][..]), "capabilities must start from drop: [ALL]");
    Ok(caps.add.iter().flatten().map(|c| c.to_lowercase()).collect())
}

#[test]
fn cluster_role_grants_exactly_the_api_calls_the_agent_makes() -> Result<()> {
    let d = load_deploy()?;
    let role = one(&d.cluster_roles, "ClusterRole")?;
    let mut granted = BTreeSet::new();
    for rule in role.rules.iter().flatten() {
        ensure!(rule.resource_names.is_none() && rule.non_resource_urls.is_none(), "rule {rule:?}: only whole resources");
        for group in rule.api_groups.iter().flatten() {
            for resource in rule.resources.iter().flatten() {
                for verb in &rule.verbs {
                    ensure!(verb != "*" && resource != "*" && group != "*", "wildcard in {rule:?}");
                    granted.insert((group.clone(), resource.clone(), verb.clone()));
                }
            }
        }
    }
    let used: BTreeSet<(String, String, String)> = API_ACCESS
        .iter()
        .flat_map(|a| a.verbs.iter().map(|v| (a.group.to_string(), a.resource.to_string(), v.to_string())))
        .collect();
    let missing: Vec<_> = used.difference(&granted).collect();
    let extra: Vec<_> = granted.difference(&used).collect();
    assert!(missing.is_empty(), "the ClusterRole lacks calls the agent makes: {missing:?}");
    assert!(extra.is_empty(), "the ClusterRole grants calls the agent never makes: {extra:?}");

    // The binding ties that role to the DaemonSet's ServiceAccount.
    let sa = one(&d.service_accounts, "ServiceAccount")?;
    let binding = one(&d.bindings, "ClusterRoleBinding")?;
    assert_eq!((binding.role_ref.kind.as_str(), binding.role_ref.name.as_str()), ("ClusterRole", role.metadata.name.as_deref().unwrap()));
    let subjects = binding.subjects.as_deref().unwrap_or_default();
    assert!(
        subjects.iter().any(|s| s.kind == "ServiceAccount" && Some(&s.name) == sa.metadata.name.as_ref() && s.namespace == sa.metadata.namespace),
        "binding subjects {subjects:?} do not name ServiceAccount {:?}",
        sa.metadata.name
    );
    let ds = one(&d.daemon_sets, "DaemonSet")?;
    let pod = ds.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    assert_eq!(pod.service_account_name, sa.metadata.name);
    assert_eq!(ds.metadata.namespace, sa.metadata.namespace);
    Ok(())
}

#[test]
fn daemon_set_runs_the_real_cli_like_kube_proxy() -> Result<()> {
    let d = load_deploy()?;
    let ds = one(&d.daemon_sets, "DaemonSet")?;
    let spec = ds.spec.as_ref().unwrap();
    let pod = spec.template.spec.as_ref().unwrap();
    assert_eq!(pod.priority_class_name.as_deref(), Some("system-node-critical"));
    assert_eq!(pod.host_network, Some(true));
    assert!(pod.tolerations.iter().flatten().any(|t| t.operator.as_deref() == Some("Exists") && t.key.is_none() && t.effect.is_none()), "tolerates every taint");
    assert_eq!(spec.update_strategy.as_ref().and_then(|u| u.type_.as_deref()), Some("RollingUpdate"));

    let c = container(ds)?;
    let args = run_args(c)?;
    // NODE_NAME from the downward API (--node-name falls back to it).
    let env = c.env.iter().flatten().find(|e| e.name == "NODE_NAME").context("no NODE_NAME env")?;
    let field = env.value_from.as_ref().and_then(|v| v.field_ref.as_ref()).map(|f| f.field_path.as_str());
    assert_eq!(field, Some("spec.nodeName"));
    assert!(args.node_name.is_none(), "--node-name must come from NODE_NAME, not be fixed");

    // Maglev's seed from an optional Secret, through the variable --maglev-seed reads.
    let seed_env = proxy_user::cli::Cli::command()
        .find_subcommand("run")
        .and_then(|run| run.get_arguments().find(|a| a.get_long() == Some("maglev-seed")).and_then(|a| a.get_env()))
        .map(|e| e.to_string_lossy().into_owned())
        .context("--maglev-seed reads no environment variable")?;
    let env = c.env.iter().flatten().find(|e| e.name == seed_env).with_context(|| format!("no {seed_env} env"))?;
    let secret = env.value_from.as_ref().and_then(|v| v.secret_key_ref.as_ref()).context("the Maglev seed is not from a Secret")?;
    assert_eq!((secret.name.as_str(), secret.key.as_str(), secret.optional), ("ebpf-proxy-maglev", "seed", Some(true)));

    // Probes on the port the agent serves health on.
    let port = args.healthz_bind_address.port();
    for (probe, path) in [(&c.readiness_probe, "/healthz"), (&c.liveness_probe, "/livez")] {
        let get = probe.as_ref().and_then(|p| p.http_get.as_ref()).with_context(|| format!("no HTTP probe on {path}"))?;
        assert_eq!(get.path.as_deref(), Some(path));
        assert_eq!(get.port, IntOrString::Int(port.into()), "probe on {path}");
    }

    // --bpffs-root and --kubeconfig lie on the volumes mounted for them.
    let mounts = c.volume_mounts.as_deref().unwrap_or_default();
    let volumes = pod.volumes.as_deref().unwrap_or_default();
    let mount_of = |path: &Path| {
        mounts.iter().filter(|m| path.starts_with(&m.mount_path)).max_by_key(|m| m.mount_path.len()).with_context(|| format!("{} is on no volume", path.display()))
    };
    let bpffs = mount_of(&args.bpffs_root)?;
    let host = volumes.iter().find(|v| v.name == bpffs.name).and_then(|v| v.host_path.as_ref()).context("bpffs is not a hostPath")?;
    assert_eq!(host.path, "/sys/fs/bpf", "pins must land on the host's bpffs to outlive the container");
    assert_ne!(bpffs.read_only, Some(true));

    // The socket hooks go on the host's cgroup v2 hierarchy, not the container's.
    let cgroup_root = args.cgroup_root.as_ref().context("the DaemonSet must pass --cgroup-root (its own /sys/fs/cgroup is the container's)")?;
    let cg = mount_of(cgroup_root)?;
    let host = volumes.iter().find(|v| v.name == cg.name).and_then(|v| v.host_path.as_ref()).context("--cgroup-root is not on a hostPath")?;
    assert_eq!((host.path.as_str(), cgroup_root.as_path()), ("/sys/fs/cgroup", Path::new(&cg.mount_path)));

    // The one sysctl the agent sets goes to the host's /proc/sys/net.
    let net = args.sysctl_root.join("net");
    let m = mount_of(&net)?;
    let host = volumes.iter().find(|v| v.name == m.name).and_then(|v| v.host_path.as_ref()).context("--sysctl-root/net is not on a hostPath")?;
    assert_eq!((host.path.as_str(), net.as_path()), ("/proc/sys/net", Path::new(&m.mount_path)));
    assert_ne!(m.read_only, Some(true), "the agent writes net/ipv4/conf/lo/accept_local");

    let kubeconfig = args.kubeconfig.as_ref().context("the DaemonSet must pass --kubeconfig (the in-cluster address is ours to translate)")?;
    let m = mount_of(kubeconfig)?;
    let cm_name = volumes.iter().find(|v| v.name == m.name).and_then(|v| v.config_map.as_ref()).map(|c| c.name.clone()).context("kubeconfig is not from a ConfigMap")?;
    let cm = d.config_maps.iter().find(|c| c.metadata.name.as_deref() == Some(cm_name.as_str())).with_context(|| format!("no ConfigMap {cm_name} in deploy/"))?;
    let key = kubeconfig.strip_prefix(&m.mount_path)?.to_str().unwrap();
    let text = cm.data.as_ref().and_then(|d| d.get(key)).with_context(|| format!("ConfigMap {cm_name} has no key {key}"))?;
    let kc: serde_yaml::Value = serde_yaml::from_str(text).with_context(|| format!("ConfigMap {cm_name} key {key}"))?;
    assert!(kc["clusters"][0]["cluster"]["server"].as_str().is_some_and(|s| s.starts_with("https://")), "{text}");
    assert_eq!(kc["users"][0]["user"]["tokenFile"].as_str(), Some("/var/run/secrets/kubernetes.io/serviceaccount/token"));
    assert_eq!(kc["clusters"][0]["cluster"]["certificate-authority"].as_str(), Some("/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"));

    let sc = c.security_context.as_ref().unwrap();
    assert_ne!(sc.privileged, Some(true), "no blanket privileged");
    assert!(!added_caps(c)?.iter().any(|c| c == "sys_admin"), "CAP_SYS_ADMIN is not needed");
    Ok(())
}

/// Peak RSS (171.6 MiB) plus BPF map memory (129.1 MiB) at 10 000 Services,
/// as docs/benchmarks.md measured them: the limit must leave room above it.
const MEASURED_AT_10K_SERVICES_MIB: f64 = 171.6 + 129.1;

/// A memory quantity in MiB (the suffixes a manifest writer uses).
fn mebibytes(q: &str) -> Result<f64> {
    let units = [("Ki", 1.0 / 1024.0), ("Mi", 1.0), ("Gi", 1024.0), ("k", 1e3 / 1048576.0), ("M", 1e6 / 1048576.0), ("G", 1e9 / 1048576.0)];
    let (number, scale) = units
        .iter()
        .find_map(|(suffix, scale)| q.strip_suffix(suffix).map(|n| (n, *scale)))
        .unwrap_or((q, 1.0 / 1048576.0));
    Ok(number.parse::<f64>().with_context(|| format!("memory quantity {q:?}"))? * scale)
}

#[test]
fn daemon_set_bounds_memory_and_filters_syscalls() -> Result<()> {
    let d = load_deploy()?;
    let c = container(one(&d.daemon_sets, "DaemonSet")?)?;
    let resources = c.resources.as_ref().context("no resources")?;
    let memory = |what: &str, map: &Option<std::collections::BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>>| {
        map.as_ref().and_then(|m| m.get("memory")).map(|q| q.0.clone()).with_context(|| format!("no memory {what}"))
    };
    let limit = memory("limit", &resources.limits)?;
    assert_eq!(memory("request", &resources.requests)?, limit, "the memory request matches the limit");
    let mib = mebibytes(&limit)?;
    assert!(
        mib >= MEASURED_AT_10K_SERVICES_MIB * 1.5,
        "memory limit {limit} leaves less than half again above the {MEASURED_AT_10K_SERVICES_MIB} MiB measured at 10 000 Services"
    );

    let seccomp = c.security_context.as_ref().and_then(|s| s.seccomp_profile.as_ref()).context("no seccompProfile on the container")?;
    assert_eq!(seccomp.type_, "RuntimeDefault");
    Ok(())
}

#[test]
fn memory_quantities() -> Result<()> {
    assert_eq!(mebibytes("512Mi")?, 512.0);
    assert_eq!(mebibytes("2Gi")?, 2048.0);
    assert_eq!(mebibytes("1048576")?, 1.0);
    assert!((mebibytes("500M")? - 476.837).abs() < 0.001);
    assert!(mebibytes("lots").is_err());
    Ok(())
}

#[test]
fn a_misspelt_field_or_unknown_kind_is_caught() {
    let misspelt: serde_json::Value = serde_json::json!({
        "apiVersion": "v1", "kind": "ServiceAccount",
        "metadata": {"name": "x", "namespce": "kube-system"}
    });
    let err = typed::<ServiceAccount>(&misspelt, "sample").unwrap_err().to_string();
    assert!(err.contains(".metadata.namespce"), "{err}");
    let wrong_kind = serde_json::json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}});
    assert!(typed::<ServiceAccount>(&wrong_kind, "sample").is_err(), "a ConfigMap is not a ServiceAccount");
}

const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);

/// Runs the agent with exactly `caps` (bounding set; root keeps no other
/// capability) and says whether it got healthy and attached.
fn agent_works_with(caps: &[String]) -> Result<()> {
    let mut node = Node::new("caps")?;
    let pod = node.add_pod("p", Ipv4Addr::new(10, 244, 0, 2))?;
    let bpffs = Bpffs::new("caps")?;
    let root = bpffs.path().join("agent");
    let manifests = tempfile::tempdir()?;
    std::fs::write(manifests.path().join("echo.yaml"), echo_service("demo", "echo", CLUSTER_IP, &[pod.ip]))?;
    let set = format!("--bounding-set=-all{}", caps.iter().map(|c| format!(",+{c}")).collect::<String>());
    let wrapper = ["setpriv", set.as_str(), "--inh-caps=-all", "--ambient-caps=-all", "--"];
    // The hooked root the agent itself runs under (Agent's default).
    let cgroup_root = proxy_tests::cgroup::TestRoot::get()?.path.display().to_string();
    let mut agent = Agent::start_wrapped(&node.ns, &wrapper, manifests.path(), &root, &[])?;
    agent.wait_healthy(&node.ns, Duration::from_secs(10))?;
    ensure!(tc_attached(&node.ns, &pod.host_if)?, "healthy but not attached:\n{}", agent.logs());
    let socket_hooks = std::fs::read_dir(root.join("links"))?.flatten().filter(|e| e.file_name().to_string_lossy().starts_with("cgroup-")).count();
    ensure!(socket_hooks > 0, "healthy but no socket hook on {cgroup_root}:\n{}", agent.logs());
    agent.stop()?;
    proxy_tests::run(proxy_tests::agent::agent_bin().to_str().unwrap(), &["cleanup", "--bpffs-root", root.to_str().unwrap()])?;
    Ok(())
}

#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn daemon_set_capabilities_are_enough_and_each_is_needed() -> Result<()> {
    let d = load_deploy()?;
    let caps = added_caps(container(one(&d.daemon_sets, "DaemonSet")?)?)?;
    agent_works_with(&caps).context("the agent with the DaemonSet's capabilities")?;
    for left_out in &caps {
        let fewer: Vec<String> = caps.iter().filter(|c| *c != left_out).cloned().collect();
        let works = agent_works_with(&fewer).is_ok();
        if left_out == "sys_resource" && !charges_bpf_to_memlock()? {
            // Needed only where maps count against RLIMIT_MEMLOCK.
            assert!(works, "CAP_SYS_RESOURCE is needed on a kernel that charges BPF memory to its cgroup");
            continue;
        }
        assert!(!works, "CAP_{} is granted but the agent works without it", left_out.to_uppercase());
    }
    Ok(())
}

/// Whether this kernel charges BPF maps to RLIMIT_MEMLOCK (before Linux
/// 5.11; since, to the memory cgroup).
fn charges_bpf_to_memlock() -> Result<bool> {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease")?;
    let mut parts = release.split(|c: char| !c.is_ascii_digit()).filter_map(|p| p.parse::<u32>().ok());
    let version = (parts.next().context("kernel version")?, parts.next().context("kernel patch level")?);
    Ok(version < (5, 11))
}
