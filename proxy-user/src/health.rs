//! `/healthz` and `/livez` with kube-proxy's meaning and JSON body: 200 once
//! the first full sync is in the maps and while syncs keep succeeding.

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::SystemTime,
};

use axum::{Json, Router, extract::State, http::StatusCode, routing::get};
use chrono::{DateTime, SecondsFormat, Utc};
use serde::Serialize;

#[derive(Default)]
struct Status {
    /// The last sync that succeeded.
    last_updated: Option<SystemTime>,
    /// Whether the most recent sync failed.
    failing: bool,
}

#[derive(Clone, Default)]
pub struct Health(Arc<Mutex<Status>>);

impl Health {
    pub fn sync_succeeded(&self) {
        let mut s = self.0.lock().unwrap();
        s.last_updated = Some(SystemTime::now());
        s.failing = false;
    }

    pub fn sync_failed(&self) {
        self.0.lock().unwrap().failing = true;
    }

    fn answer(&self) -> (StatusCode, Json<Body>) {
        let s = self.0.lock().unwrap();
        let healthy = s.last_updated.is_some() && !s.failing;
        let code = if healthy { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
        let body = Body {
            last_updated: s.last_updated.map(rfc3339).unwrap_or_default(),
            current_time: rfc3339(SystemTime::now()),
            node_eligible: true,
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
}

fn rfc3339(t: SystemTime) -> String {
    DateTime::<Utc>::from(t).to_rfc3339_opts(SecondsFormat::Nanos, true)
}

async fn healthz(State(h): State<Health>) -> (StatusCode, Json<Body>) {
    h.answer()
}

/// Binds now (so a taken port fails the start), serves in the background.
pub async fn serve(addr: SocketAddr, health: Health) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let app = Router::new().route("/healthz", get(healthz)).route("/livez", get(healthz)).with_state(health);
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("--healthz-bind-address {addr}: {e}"))?;
    Ok(tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!("healthz server stopped: {e}");
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unhealthy_until_first_sync_and_after_a_failure() {
        let h = Health::default();
        assert_eq!(h.answer().0, StatusCode::SERVICE_UNAVAILABLE);
        h.sync_succeeded();
        let (code, Json(body)) = h.answer();
        assert_eq!(code, StatusCode::OK);
        assert!(body.last_updated.ends_with('Z') && body.node_eligible);
        h.sync_failed();
        assert_eq!(h.answer().0, StatusCode::SERVICE_UNAVAILABLE);
        h.sync_succeeded();
        assert_eq!(h.answer().0, StatusCode::OK);
    }
}
