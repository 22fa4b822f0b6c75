//! How the API source waits before trying the API again after an error:
//! kube-rs's exponential backoff, jittered, from `RETRY_MIN` doubling to
//! `RETRY_MAX` (jitter adds up to as much again, so no wait reaches
//! 2 × `RETRY_MAX` = 1 s), started over as soon as a call succeeds.
//!
//! kube-rs's default (client-go's 0.8 s doubling to 30 s, reset after
//! 2 min) is kind to a struggling API server, but an outage of a few
//! seconds leaves the agent waiting up to a minute after the API answers
//! again, serving stale endpoints all that time. The price: while the API
//! is down, each agent tries each watch about once a second, the jitter
//! spreading the agents' tries. kube-rs's stream backoff resets on a watcher event only, and a watch
//! that starts again produces none until something changes: the
//! successful calls are counted on the client instead (`answering`).

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use kube::{
    Client,
    runtime::{utils::Backoff, watcher::ExponentialBackoff},
};

/// The first wait after a success (before jitter).
pub const RETRY_MIN: Duration = Duration::from_millis(250);
/// The longest wait before jitter; with it, every wait is below twice this.
pub const RETRY_MAX: Duration = Duration::from_millis(500);

/// kube-rs's exponential backoff with the waits above, never giving up.
pub fn backoff() -> ExponentialBackoff {
    backon::ExponentialBuilder::default()
        .with_min_delay(RETRY_MIN)
        .with_max_delay(RETRY_MAX)
        .with_factor(2.0)
        .with_jitter()
        .without_max_times()
        .into()
}

/// How many calls made through an `answering` client succeeded.
#[derive(Clone, Default)]
pub struct Answers(Arc<AtomicU64>);

impl Answers {
    fn count(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// `client`, with each of its calls that the API answers with success (2xx:
/// a list, or a watch that starts) counted in the returned `Answers`.
pub fn answering(client: Client) -> (Client, Answers) {
    let answers = Answers::default();
    let counted = answers.clone();
    let namespace = client.default_namespace().to_string();
    let service = tower::service_fn(move |request| {
        let (client, counted) = (client.clone(), counted.clone());
        async move {
            let response = client.send(request).await;
            if response.as_ref().is_ok_and(|r| r.status().is_success()) {
                counted.0.fetch_add(1, Ordering::Relaxed);
            }
            response
        }
    });
    (Client::new(service, namespace), answers)
}

/// One watcher's backoff: `backoff()`, started over at the first error
/// after a call of its own client succeeded.
pub struct Retry {
    backoff: ExponentialBackoff,
    answers: Answers,
    seen: u64,
}

impl Retry {
    pub fn new(answers: Answers) -> Self {
        let seen = answers.count();
        Retry { backoff: backoff(), answers, seen }
    }
}

impl Iterator for Retry {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let answered = self.answers.count();
        if answered != self.seen {
            self.seen = answered;
            self.backoff.reset();
        }
        self.backoff.next()
    }
}

impl Backoff for Retry {
    fn reset(&mut self) {
        self.backoff.reset();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_grow_to_the_cap_and_start_over_after_a_success() {
        let answers = Answers::default();
        let mut retry = Retry::new(answers.clone());
        for round in 0..3 {
            let waits: Vec<Duration> = (0..20).map(|_| retry.next().expect("never gives up")).collect();
            assert!((RETRY_MIN..2 * RETRY_MIN).contains(&waits[0]), "round {round}: {waits:?}");
            assert!(waits[1..].iter().all(|w| (RETRY_MAX..2 * RETRY_MAX).contains(w)), "round {round}: {waits:?}");
            // A call answered: the next error waits the least again.
            answers.0.fetch_add(1, Ordering::Relaxed);
        }
        // An event (kube-rs's own reset) does the same.
        retry.next();
        retry.reset();
        assert!(retry.next().unwrap() < 2 * RETRY_MIN);
    }
}
