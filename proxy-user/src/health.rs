//! `/healthz` and `/livez` with kube-proxy's meaning and JSON body
//! (pkg/proxy/healthcheck/proxy_health.go). The proxy is healthy once the
//! first full sync is in the maps, and stays healthy while every change it
//! was given gets programmed within the health timeout; a change that waits
//! longer (syncs keep failing) makes it unhealthy until a sync succeeds.
//! `/healthz` also answers 503 when the node is not eligible for traffic
//! (being deleted, or tainted for deletion by the cluster autoscaler), so
//! load balancers drain it; `/livez` ignores eligibility.

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

use axum::{Json, Router, extract::State, http::StatusCode, routing::get};
use chrono::{DateTime, SecondsFormat, Utc};
use serde::Serialize;

use crate::http_server::{self, ConnectionLimit};

/// kube-proxy's default: twice its 30 s sync period.
pub const HEALTH_TIMEOUT: Duration = Duration::from_secs(60);


struct Status {
    /// The last sync that succeeded.
    last_updated: Option<SystemTime>,
    /// When the oldest change not yet programmed arrived.
    oldest_pending: Option<SystemTime>,
    node_eligible: bool,
    timeout: Duration,
    /// How the TC programs are attached (`tcx` or `netlink`), once known.
    tc_attach: Option<&'static str>,
}

#[derive(Clone)]
pub struct Health(Arc<Mutex<Status>>);

impl Default for Health {
    fn default() -> Self {
        Health::with_timeout(HEALTH_TIMEOUT)
    }
}

impl Health {
    pub fn with_timeout(timeout: Duration) -> Self {
        Health(Arc::new(Mutex::new(Status {
            last_updated: None,
            oldest_pending: None,
            node_eligible: true,
            timeout,
            tc_attach: None,
        })))
    }

    /// A change arrived that the next sync must program.
    pub fn queued_update(&self) {
        self.0.lock().unwrap().oldest_pending.get_or_insert_with(SystemTime::now);
    }

    pub fn sync_succeeded(&self) {
        let mut s = self.0.lock().unwrap();
        s.last_updated = Some(SystemTime::now());
        s.oldest_pending = None;
    }

    /// The pending change stays pending; the health timeout runs on.
    pub fn sync_failed(&self) {}

    pub fn set_node_eligible(&self, eligible: bool) {
        self.0.lock().unwrap().node_eligible = eligible;
    }

    pub fn set_tc_attach(&self, mode: &'static str) {
        self.0.lock().unwrap().tc_attach = Some(mode);
    }

    fn healthy_at(s: &Status, now: SystemTime) -> bool {
        let waiting_too_long = s.oldest_pending.is_some_and(|t| now.duration_since(t).unwrap_or_default() >= s.timeout);
        s.last_updated.is_some() && !waiting_too_long
    }

    pub fn is_healthy(&self) -> bool {
        Health::healthy_at(&self.0.lock().unwrap(), SystemTime::now())
    }

    fn answer_at(&self, now: SystemTime, check_eligible: bool) -> (StatusCode, Json<Body>) {
        let s = self.0.lock().unwrap();
        let ok = Health::healthy_at(&s, now) && (s.node_eligible || !check_eligible);
        let code = if ok { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
        let body = Body {
            last_updated: s.last_updated.map(rfc3339).unwrap_or_default(),
            current_time: rfc3339(now),
            node_eligible: s.node_eligible,
            tc_attach: s.tc_attach,
        };
        (code, Json(body))
    }
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Body {
    last_updated: String,
    current_time: String,
    node_eligible: bool,
    /// Ours, beside kube-proxy's fields: `tcx` or `netlink`.
    #[serde(skip_serializing_if = "Option::is_none")]
    tc_attach: Option<&'static str>,
}

fn rfc3339(t: SystemTime) -> String {
    DateTime::<Utc>::from(t).to_rfc3339_opts(SecondsFormat::Nanos, true)
}

async fn healthz(State(h): State<Health>) -> (StatusCode, Json<Body>) {
    h.answer_at(SystemTime::now(), true)
}

async fn livez(State(h): State<Health>) -> (StatusCode, Json<Body>) {
    h.answer_at(SystemTime::now(), false)
}

/// Binds now (so a taken port fails the start), serves in the background
/// with the limits of http_server.
pub async fn serve(addr: SocketAddr, health: Health) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let app = Router::new().route("/healthz", get(healthz)).route("/livez", get(livez)).with_state(health);
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("--healthz-bind-address {addr}: {e}"))?;
    Ok(tokio::spawn(http_server::serve(listener, app, ConnectionLimit::default())))
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_secs(60);

    #[test]
    fn unhealthy_until_first_sync_and_when_a_change_waits_past_the_timeout() {
        let h = Health::with_timeout(T);
        let now = SystemTime::now();
        h.queued_update();
        assert_eq!(h.answer_at(now, true).0, StatusCode::SERVICE_UNAVAILABLE, "before the first sync");
        h.sync_succeeded();
        let (code, Json(body)) = h.answer_at(now, true);
        assert_eq!(code, StatusCode::OK);
        assert!(body.last_updated.ends_with('Z') && body.node_eligible);
        assert_eq!(serde_json::to_value(&body).unwrap().get("tcAttach"), None, "unknown until attached");
        h.set_tc_attach("netlink");
        assert_eq!(serde_json::to_value(&h.answer_at(now, true).1.0).unwrap()["tcAttach"], "netlink");

        // A change whose syncs fail: still healthy within the timeout, not after.
        h.queued_update();
        h.sync_failed();
        assert_eq!(h.answer_at(now + T / 2, true).0, StatusCode::OK);
        assert_eq!(h.answer_at(now + T * 2, true).0, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(h.answer_at(now + T * 2, false).0, StatusCode::SERVICE_UNAVAILABLE, "livez too");
        // A later change does not restart the clock of the oldest one.
        h.queued_update();
        assert_eq!(h.answer_at(now + T * 2, true).0, StatusCode::SERVICE_UNAVAILABLE);
        h.sync_succeeded();
        assert_eq!(h.answer_at(now + T * 2, true).0, StatusCode::OK);
        // No pending change: healthy however long since the last sync.
        assert_eq!(h.answer_at(now + T * 100, true).0, StatusCode::OK);
    }

    #[test]
    fn a_node_being_deleted_fails_healthz_but_not_livez() {
        let h = Health::with_timeout(T);
        h.sync_succeeded();
        h.set_node_eligible(false);
        let now = SystemTime::now();
        let (code, Json(body)) = h.answer_at(now, true);
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
        assert!(!body.node_eligible);
        assert_eq!(h.answer_at(now, false).0, StatusCode::OK);
    }
}
