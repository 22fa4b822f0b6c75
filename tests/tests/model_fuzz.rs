//! Property tests of the manifests parser and the model (issue 17):
//! arbitrary Services and EndpointSlices, as JSON documents with random,
//! missing and wrong-typed fields, invalid IPs and CIDRs, out-of-range and
//! huge port lists, through `manifest::parse` and then `model::build`.
//!
//! The properties: nothing panics; a document with a wrong-typed field fails
//! the file with an error naming that field; every `ObjectError` of the
//! model names an object of the snapshot ("service ns/name", "endpointslice
//! ns/name"); and the bad objects the generator made on purpose (no spec, an
//! invalid ClusterIP, a slice without its service label or for no service)
//! each get an error naming them.
//!
//! `PROPTEST_CASES=N` runs N cases instead of 1000.

use std::{collections::BTreeSet, path::Path};

use proptest::{
    prelude::*,
    test_runner::{Config, RngSeed, TestCaseError, TestError, TestRunner},
};
use proxy_user::{
    manifest,
    model::{self, ModelConfig},
    source::Snapshot,
};
use serde_json::{Value, json};

const INVALID_IPS: [&str; 6] = ["10.96.0.300", "not-an-ip", "", "1.2.3", "fd00::g", "10.96.0.1/32"];

fn ip() -> impl Strategy<Value = String> + Clone {
    prop_oneof![
        4 => (0u8..4, any::<u8>()).prop_map(|(a, b)| format!("10.96.{a}.{b}")),
        2 => any::<u16>().prop_map(|h| format!("fd00:10:96::{h:x}")),
        1 => Just(" 10.96.0.7 ".to_string()),
        1 => Just("None".to_string()),
        2 => prop::sample::select(INVALID_IPS.to_vec()).prop_map(str::to_string),
        1 => any::<[u8; 4]>().prop_map(|a| std::net::Ipv4Addr::from(a).to_string()),
    ]
}

fn endpoint_ip() -> impl Strategy<Value = String> + Clone {
    prop_oneof![
        4 => (0u8..4, any::<u8>()).prop_map(|(a, b)| format!("10.244.{a}.{b}")),
        2 => any::<u16>().prop_map(|h| format!("fd00:10:244::{h:x}")),
        1 => Just("10.96.0.10".to_string()), // inside the service CIDR: refused
        1 => Just("127.0.0.1".to_string()),
        2 => prop::sample::select(INVALID_IPS.to_vec()).prop_map(str::to_string),
    ]
}

fn one_of(values: &[&'static str]) -> impl Strategy<Value = Value> + Clone {
    prop_oneof![
        4 => prop::sample::select(values.to_vec()).prop_map(Value::from),
        1 => Just(Value::Null),
        1 => "[a-zA-Z]{0,8}".prop_map(Value::from),
    ]
}

fn port_number() -> impl Strategy<Value = Value> + Clone {
    prop_oneof![
        6 => (1i64..=65535).prop_map(Value::from),
        1 => prop::sample::select(vec![0i64, -1, 65536, i32::MAX as i64, i32::MIN as i64]).prop_map(Value::from),
    ]
}

fn service_port() -> impl Strategy<Value = Value> + Clone {
    (
        prop_oneof![Just(Value::Null), prop::sample::select(vec!["http", "dns", "", "x"]).prop_map(Value::from)],
        port_number(),
        one_of(&["TCP", "UDP", "SCTP"]),
        prop_oneof![Just(Value::Null), port_number(), prop::sample::select(vec!["http", "dns", "nope"]).prop_map(Value::from)],
        prop_oneof![2 => Just(Value::Null), 1 => port_number()],
    )
        .prop_map(|(name, port, protocol, target, node_port)| {
            json!({"name": name, "port": port, "protocol": protocol, "targetPort": target, "nodePort": node_port})
        })
}

fn list<T: Strategy<Value = Value> + Clone>(item: T) -> impl Strategy<Value = Value> {
    prop_oneof![
        1 => Just(Value::Null),
        6 => prop::collection::vec(item.clone(), 0..5).prop_map(Value::from),
        // Huge lists.
        1 => prop::collection::vec(item, 100..300).prop_map(Value::from),
    ]
}

/// A Service without its name (filled in by index).
fn service() -> impl Strategy<Value = Value> {
    let spec = (
        one_of(&["ClusterIP", "NodePort", "LoadBalancer", "ExternalName"]),
        prop_oneof![Just(Value::Null), ip().prop_map(Value::from)],
        prop_oneof![Just(Value::Null), prop::collection::vec(ip(), 0..3).prop_map(Value::from)],
        list(ip().prop_map(Value::from)),
        list(service_port()),
        one_of(&["Cluster", "Local"]),
        one_of(&["Cluster", "Local"]),
        one_of(&["None", "ClientIP"]),
        prop_oneof![Just(Value::Null), prop::collection::vec(prop::sample::select(vec!["203.0.113.0/25", "::/0", "bad", "10.0.0.1"]), 0..3).prop_map(Value::from)],
    )
        .prop_map(|(ty, cip, cips, eips, ports, etp, itp, aff, ranges)| {
            json!({"type": ty, "clusterIP": cip, "clusterIPs": cips, "externalIPs": eips, "ports": ports,
                   "externalTrafficPolicy": etp, "internalTrafficPolicy": itp, "sessionAffinity": aff,
                   "loadBalancerSourceRanges": ranges})
        });
    let ingress = (ip(), one_of(&["VIP", "Proxy"])).prop_map(|(ip, mode)| json!({"ip": ip, "ipMode": mode}));
    let status = prop_oneof![Just(Value::Null), prop::collection::vec(ingress, 0..3).prop_map(|i| json!({"loadBalancer": {"ingress": i}}))];
    (prop_oneof![1 => Just(Value::Null), 6 => spec], status, one_of(&["default", "kube-system"]))
        .prop_map(|(spec, status, ns)| json!({"apiVersion": "v1", "kind": "Service", "metadata": {"namespace": ns}, "spec": spec, "status": status}))
}

/// An EndpointSlice without its name; its label picks a Service by index.
fn slice() -> impl Strategy<Value = (Value, Option<usize>)> {
    let endpoint = (
        prop::collection::vec(endpoint_ip(), 0..3),
        prop_oneof![Just(Value::Null), (any::<Option<bool>>(), any::<Option<bool>>(), any::<Option<bool>>()).prop_map(|(r, s, t)| json!({"ready": r, "serving": s, "terminating": t}))],
        one_of(&["node-a", "node-b"]),
    )
        .prop_map(|(addrs, conditions, node)| json!({"addresses": addrs, "conditions": conditions, "nodeName": node}));
    let port = (
        prop_oneof![Just(Value::Null), prop::sample::select(vec!["http", "dns", ""]).prop_map(Value::from)],
        prop_oneof![Just(Value::Null), port_number()],
        one_of(&["TCP", "UDP", "SCTP"]),
    )
        .prop_map(|(name, port, protocol)| json!({"name": name, "port": port, "protocol": protocol}));
    (
        prop::sample::select(vec!["IPv4", "IPv6", "FQDN", "bogus"]),
        prop_oneof![6 => prop::collection::vec(endpoint.clone(), 0..4), 1 => prop::collection::vec(endpoint, 30..80)],
        list(port),
        one_of(&["default", "kube-system"]),
        prop_oneof![1 => Just(None), 6 => (0usize..8).prop_map(Some)],
    )
        .prop_map(|(address_type, endpoints, ports, ns, owner)| {
            let v = json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "metadata": {"namespace": ns},
                           "addressType": address_type, "endpoints": endpoints, "ports": ports});
            (v, owner)
        })
}

/// A field made the wrong type: where, as `serde_path_to_error` names it.
fn wrong_type(doc: &mut Value, pick: usize) -> Option<String> {
    let mut candidates: Vec<(String, Vec<Value>, Value)> = Vec::new();
    let at = |path: &[&str]| -> Vec<Value> { path.iter().map(|p| p.parse::<usize>().map_or_else(|_| Value::from(*p), Value::from)).collect() };
    let has = |doc: &Value, path: &[Value]| doc_get(doc, path).is_some_and(|v| !v.is_null());
    let kind = doc["kind"].as_str().unwrap_or_default().to_string();
    let options: Vec<(&str, Vec<&str>, Value)> = if kind == "Service" {
        vec![
            ("spec.ports[0].port", vec!["spec", "ports", "0", "port"], json!("eighty")),
            ("spec.ports", vec!["spec", "ports"], json!({"port": 80})),
            ("spec.clusterIPs", vec!["spec", "clusterIPs"], json!("10.96.0.1")),
            ("spec.type", vec!["spec", "type"], json!(["ClusterIP"])),
            ("metadata.name", vec!["metadata", "name"], json!({"n": 1})),
            ("spec.ports[0].protocol", vec!["spec", "ports", "0", "protocol"], json!([6])),
            ("spec", vec!["spec"], json!([1, 2])),
        ]
    } else {
        vec![
            ("endpoints[0].addresses", vec!["endpoints", "0", "addresses"], json!("10.244.0.1")),
            ("ports[0].port", vec!["ports", "0", "port"], json!("8080")),
            ("endpoints[0].conditions.ready", vec!["endpoints", "0", "conditions", "ready"], json!("yes")),
            ("endpoints", vec!["endpoints"], json!(7)),
            ("metadata.labels", vec!["metadata", "labels"], json!(["x"])),
        ]
    };
    for (name, path, value) in options {
        let path = at(&path);
        // Fields that exist, or direct children of an existing object.
        let parent_ok = path.len() == 1 || doc_get(doc, &path[..path.len() - 1]).is_some_and(Value::is_object);
        if has(doc, &path) || parent_ok {
            candidates.push((name.to_string(), path, value));
        }
    }
    let (name, path, value) = candidates.into_iter().nth(pick % 8)?;
    let mut v = doc;
    for k in &path[..path.len() - 1] {
        v = match k {
            Value::String(s) => &mut v[s.as_str()],
            Value::Number(n) => &mut v[n.as_u64().unwrap() as usize],
            _ => unreachable!(),
        };
    }
    match path.last().unwrap() {
        Value::String(s) => v[s.as_str()] = value,
        Value::Number(n) => v[n.as_u64().unwrap() as usize] = value,
        _ => unreachable!(),
    }
    Some(name)
}

fn doc_get<'v>(doc: &'v Value, path: &[Value]) -> Option<&'v Value> {
    path.iter().try_fold(doc, |v, k| match k {
        Value::String(s) => v.get(s.as_str()),
        Value::Number(n) => v.get(n.as_u64()? as usize),
        _ => None,
    })
}

#[derive(Debug, Clone)]
struct Case {
    services: Vec<Value>,
    slices: Vec<(Value, Option<usize>)>,
    /// Per document (services then slices): make a field the wrong type
    /// (`Some(pick)`), with this probability in the strategy.
    wrong: Vec<Option<usize>>,
    /// Documents per file.
    per_file: usize,
    detect_local: bool,
    masquerade_all: bool,
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop::collection::vec(service(), 0..8),
        prop::collection::vec(slice(), 0..8),
        prop::collection::vec(prop_oneof![8 => Just(None), 1 => any::<usize>().prop_map(Some)], 16),
        1usize..4,
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(services, slices, wrong, per_file, detect_local, masquerade_all)| Case {
            services,
            slices,
            wrong,
            per_file,
            detect_local,
            masquerade_all,
        })
}

fn svc_name(i: usize) -> String {
    format!("svc{i}")
}

#[derive(Debug, Default)]
struct Tally {
    files: u64,
    /// Files refused for a wrong-typed field, each error naming it.
    refused: u64,
    services: u64,
    slices: u64,
    /// ObjectErrors of the model, all naming an object.
    object_errors: u64,
}

fn run(case: Case, tally: &std::cell::RefCell<Tally>) -> Result<(), TestCaseError> {
    // Named documents, and the wrong-typed field of each (if any).
    let mut docs: Vec<(Value, Option<String>)> = Vec::new();
    for (i, s) in case.services.iter().enumerate() {
        let mut s = s.clone();
        s["metadata"]["name"] = Value::from(svc_name(i));
        docs.push((s, None));
    }
    for (j, (s, owner)) in case.slices.iter().enumerate() {
        let mut s = s.clone();
        s["metadata"]["name"] = Value::from(format!("slice{j}"));
        if let Some(k) = owner {
            // Owners beyond the services are orphans.
            s["metadata"]["labels"] = json!({"kubernetes.io/service-name": svc_name(*k)});
        }
        docs.push((s, None));
    }
    for ((doc, wrong), pick) in docs.iter_mut().zip(&case.wrong) {
        if let Some(pick) = pick {
            *wrong = wrong_type(doc, *pick);
        }
    }

    let mut snapshot = Snapshot::default();
    for (f, chunk) in docs.chunks(case.per_file).enumerate() {
        let text: String = chunk.iter().map(|(d, _)| format!("---\n{}\n", serde_json::to_string_pretty(d).unwrap())).collect();
        let path = format!("/m/file{f}.yaml");
        let first_wrong = chunk.iter().find_map(|(_, w)| w.clone());
        tally.borrow_mut().files += 1;
        match (manifest::parse(Path::new(&path), &text), first_wrong) {
            (Ok(objects), None) => objects.iter().for_each(|o| snapshot.add(o)),
            (Ok(_), Some(field)) => return Err(TestCaseError::fail(format!("{path}: {field} of the wrong type accepted:\n{text}"))),
            (Err(e), None) => return Err(TestCaseError::fail(format!("{path}: well-typed documents refused: {e}\n{text}"))),
            (Err(e), Some(field)) => {
                prop_assert_eq!(&e.path, &path);
                tally.borrow_mut().refused += 1;
                prop_assert!(e.reason.starts_with(&field), "{}: error {:?} does not name the field {}\n{}", path, e.reason, field, text);
            }
        }
    }

    let config = ModelConfig {
        node_name: "node-a".into(),
        node_addresses: vec!["192.168.0.2".parse().unwrap(), "fd00::2".parse().unwrap()],
        detect_local: case.detect_local,
        masquerade_all: case.masquerade_all,
        service_cidrs: vec!["10.96.0.0/16".parse().unwrap()],
        ..Default::default()
    };
    let (_state, errors) = model::build(&snapshot, &config);
    {
        let mut t = tally.borrow_mut();
        t.services += snapshot.services.len() as u64;
        t.slices += snapshot.slices.len() as u64;
        t.object_errors += errors.len() as u64;
    }

    let key = |ns: Option<&String>, name: Option<&str>| format!("{}/{}", ns.map_or("default", |s| s.as_str()), name.unwrap_or("?"));
    let services: BTreeSet<String> =
        snapshot.services.iter().map(|s| format!("service {}", key(s.metadata.namespace.as_ref(), s.metadata.name.as_deref()))).collect();
    let slices: BTreeSet<String> = snapshot
        .slices
        .iter()
        .map(|s| format!("endpointslice {}", key(s.metadata.namespace.as_ref(), s.metadata.name.as_deref())))
        .collect();
    for e in &errors {
        prop_assert!(services.contains(&e.object) || slices.contains(&e.object), "error names no object of the snapshot: {}", e);
        prop_assert!(!e.reason.is_empty(), "error without a reason: {}", e);
    }
    let has_error = |object: &str, needle: &str| errors.iter().any(|e| e.object == object && e.reason.contains(needle));

    // The bad objects made on purpose each have their error.
    for svc in &snapshot.services {
        let object = format!("service {}", key(svc.metadata.namespace.as_ref(), svc.metadata.name.as_deref()));
        let Some(spec) = &svc.spec else {
            prop_assert!(has_error(&object, "no spec"), "{} has no spec and no error says so: {:?}", object, errors);
            continue;
        };
        if spec.type_.as_deref() == Some("ExternalName") {
            continue;
        }
        let ips: Vec<&String> = match (&spec.cluster_ips, &spec.cluster_ip) {
            (Some(ips), _) if !ips.is_empty() => ips.iter().collect(),
            (_, Some(ip)) => vec![ip],
            _ => vec![],
        };
        if ips.iter().any(|ip| ip.as_str() == "None") {
            continue;
        }
        if ips.iter().any(|ip| ip.trim().parse::<std::net::IpAddr>().is_err()) {
            prop_assert!(has_error(&object, "spec.clusterIPs"), "{} has an invalid ClusterIP and no error says so: {:?}", object, errors);
        }
    }
    let service_keys: BTreeSet<String> = services.iter().map(|s| s.trim_start_matches("service ").to_string()).collect();
    for slice in &snapshot.slices {
        let object = format!("endpointslice {}", key(slice.metadata.namespace.as_ref(), slice.metadata.name.as_deref()));
        // The label as the agent keeps it (endpoint_slice.rs reads it out of the metadata).
        match slice.service_name.as_deref() {
            None => prop_assert!(has_error(&object, "label"), "{} has no service label and no error says so", object),
            Some(owner) => {
                if !service_keys.contains(&key(slice.metadata.namespace.as_ref(), Some(owner))) {
                    prop_assert!(has_error(&object, "no such service"), "{} is for no service and no error says so", object);
                }
            }
        }
    }
    Ok(())
}

/// PROPTEST_RNG_SEED, else a random seed, printed so a failure can be replayed.
fn seed() -> u64 {
    std::env::var("PROPTEST_RNG_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(rand::random)
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(1000)
}

#[test]
fn manifests_and_model_name_every_bad_object() {
    let seed = seed();
    let config = Config { cases: cases(), failure_persistence: None, rng_seed: RngSeed::Fixed(seed), ..Config::default() };
    let started = std::time::Instant::now();
    let tally = std::cell::RefCell::new(Tally::default());
    let result = TestRunner::new(config).run(&case(), |c| run(c, &tally));
    let t = tally.into_inner();
    println!("manifest/model fuzz (PROPTEST_RNG_SEED={seed}): {} cases in {:.1}s: {t:?}", cases(), started.elapsed().as_secs_f64());
    match result {
        Ok(()) => {}
        Err(TestError::Fail(why, case)) => panic!("{why}\nminimal case (PROPTEST_RNG_SEED={seed}): {case:#?}"),
        Err(e) => panic!("{e}"),
    }
    assert!(cases() < 100 || (t.refused > 0 && t.object_errors > 0 && t.services > 0), "the generator reaches too little: {t:?}");
}
