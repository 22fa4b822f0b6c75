//! Whether what a client observed matches what a kube-proxy case expects.
//! Pure: the requests are made by the `send` closure, so the rules are unit
//! tested below on made-up outcomes.

use std::{collections::BTreeSet, net::SocketAddr};

use super::{
    data::{Case, Expect},
    probe::Outcome,
};

/// Requests when endpoints should answer. Also when one endpoint is
/// expected: a datapath that wrongly picks among two would hide behind a few
/// lucky tries; 20 tries all landing on one of two happens 2 in a million.
pub const TRIES_ENDPOINTS: usize = 20;
/// Requests when REJECT is expected.
pub const TRIES_REJECT: usize = 3;

/// Ok(what was seen) or Err(why it does not match). Stops at the first
/// request that contradicts the expectation.
pub fn judge(expect: &Expect, case: &Case, masq_observable: bool, mut send: impl FnMut() -> Outcome) -> Result<String, String> {
    match expect {
        Expect::Endpoints(allowed) => {
            let list = allowed.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ");
            let tries = TRIES_ENDPOINTS;
            let mut answered = BTreeSet::new();
            let mut masq_seen = None;
            for i in 1..=tries {
                let (server, seen_client) = match send() {
                    Outcome::Answer { server, seen_client } => (server, seen_client),
                    other => return Err(format!("request {i}: {other}; expected an answer from {list}")),
                };
                let endpoint: SocketAddr = server.parse().map_err(|_| {
                    format!("request {i}: answered by {server} (the packet was not translated); expected {list}")
                })?;
                if !allowed.contains(&endpoint) {
                    return Err(format!("request {i}: answered by {endpoint}; expected one of {list}"));
                }
                if masq_observable {
                    let seen: SocketAddr =
                        seen_client.parse().map_err(|_| format!("request {i}: endpoint reported client {seen_client:?}"))?;
                    let masqueraded = seen.ip() != case.source_ip;
                    if masqueraded != case.masq {
                        return Err(format!(
                            "request {i}: {endpoint} saw the client as {}; expected {}",
                            seen.ip(),
                            if case.masq { "a masqueraded (node) address" } else { "the client's own address" }
                        ));
                    }
                    masq_seen = Some(seen.ip());
                }
                answered.insert(endpoint);
            }
            if allowed.len() > 1 && answered.len() < 2 {
                return Err(format!("only {answered:?} answered {tries} requests; expected several of {list}"));
            }
            let who = answered.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ");
            Ok(match masq_seen {
                Some(ip) => format!("answered by {who}; client seen as {ip}"),
                None => format!("answered by {who}"),
            })
        }
        Expect::Reject => {
            for i in 1..=TRIES_REJECT {
                match send() {
                    Outcome::Refused => {}
                    other => return Err(format!("request {i}: {other}; expected REJECT (connection refused)")),
                }
            }
            Ok("refused".into())
        }
        Expect::Drop => match send() {
            Outcome::Silence => Ok("no answer".into()),
            other => Err(format!("{other}; expected DROP (no answer, no refusal)")),
        },
        Expect::Accept => match send() {
            Outcome::Answer { server, .. } if server.starts_with("host:") => Ok(format!("delivered to the node ({server})")),
            Outcome::Other(line) => Ok(format!("delivered to the node, whose server answered {line:?}")),
            other => Err(format!("{other}; expected delivery to the node itself")),
        },
        Expect::Untouched => match send() {
            Outcome::Answer { server, .. } if server.parse::<SocketAddr>().is_ok() => {
                Err(format!("answered by endpoint {server}; expected the proxy to leave the packet alone"))
            }
            other => Ok(format!("not translated ({other})")),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conformance::data::Protocol;

    fn case(output: &str, masq: bool) -> Case {
        Case {
            name: "t".into(),
            source_ip: "10.0.0.2".parse().unwrap(),
            protocol: Protocol::TCP,
            dest_ip: "172.30.0.41".parse().unwrap(),
            dest_port: 80,
            output: output.into(),
            masq,
        }
    }

    fn answer(server: &str, client: &str) -> Outcome {
        Outcome::Answer { server: server.into(), seen_client: client.into() }
    }

    fn judge_seq(c: &Case, outcomes: Vec<Outcome>) -> Result<String, String> {
        let mut it = outcomes.into_iter().cycle();
        judge(&c.expect().unwrap(), c, true, || it.next().unwrap())
    }

    #[test]
    fn several_endpoints_must_all_be_allowed_and_more_than_one_must_answer() {
        let c = case("10.180.0.1:80, 10.180.2.1:80", false);
        let both = vec![answer("10.180.0.1:80", "10.0.0.2:4000"), answer("10.180.2.1:80", "10.0.0.2:4001")];
        assert!(judge_seq(&c, both).is_ok());
        assert!(judge_seq(&c, vec![answer("10.180.0.1:80", "10.0.0.2:4000")]).unwrap_err().contains("several"));
        let stray = vec![answer("10.180.0.1:80", "10.0.0.2:1"), answer("10.180.9.9:80", "10.0.0.2:2")];
        assert!(judge_seq(&c, stray).unwrap_err().contains("10.180.9.9:80"));
        assert!(judge_seq(&c, vec![Outcome::Silence]).is_err());
    }

    #[test]
    fn masquerade_is_checked_both_ways() {
        let unmasq = case("10.180.0.1:80", false);
        assert!(judge_seq(&unmasq, vec![answer("10.180.0.1:80", "10.0.0.2:5")]).is_ok());
        assert!(judge_seq(&unmasq, vec![answer("10.180.0.1:80", "192.168.0.2:5")]).is_err());
        let masq = case("10.180.0.1:80", true);
        assert!(judge_seq(&masq, vec![answer("10.180.0.1:80", "192.168.0.2:5")]).is_ok());
        assert!(judge_seq(&masq, vec![answer("10.180.0.1:80", "10.0.0.2:5")]).is_err());
    }

    #[test]
    fn reject_drop_accept_and_untouched() {
        assert!(judge_seq(&case("REJECT", false), vec![Outcome::Refused]).is_ok());
        assert!(judge_seq(&case("REJECT", false), vec![Outcome::Silence]).is_err());
        assert!(judge_seq(&case("DROP", false), vec![Outcome::Silence]).is_ok());
        assert!(judge_seq(&case("DROP", false), vec![Outcome::Refused]).is_err());
        assert!(judge_seq(&case("ACCEPT", false), vec![answer("host:30000", "1.2.3.4:9")]).is_ok());
        assert!(judge_seq(&case("ACCEPT", false), vec![Outcome::Other("HTTP/1.1 503".into())]).is_ok());
        assert!(judge_seq(&case("ACCEPT", false), vec![Outcome::Refused]).is_err());
        assert!(judge_seq(&case("REJECT", false), vec![answer("upstream:80", "10.0.0.2:9")]).is_err());
        assert!(judge_seq(&case("DROP", false), vec![answer("host:80", "10.0.0.2:9")]).is_err());
        assert!(judge_seq(&case("", false), vec![Outcome::Refused]).is_ok());
        assert!(judge_seq(&case("", false), vec![answer("upstream:80", "10.0.0.2:9")]).is_ok());
        assert!(judge_seq(&case("10.180.0.1:80", false), vec![answer("upstream:80", "10.0.0.2:9")]).unwrap_err().contains("not translated"));
        assert!(judge_seq(&case("", false), vec![answer("10.180.0.1:80", "x")]).is_err());
    }
}
