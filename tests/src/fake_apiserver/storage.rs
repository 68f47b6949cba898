//! PersistentVolumeClaims and PersistentVolumes in the fake API server: what
//! the agent's volume manager reads to resolve a pod's claim to its volume
//! (issue #14). Tests put them in with [`FakeApiServer::add_pvc`] /
//! [`FakeApiServer::add_pv`]; the agent reads them with
//! `GET /api/v1/namespaces/{ns}/persistentvolumeclaims/{name}` and
//! `GET /api/v1/persistentvolumes/{name}` (404 `NotFound` when absent, as the
//! API server).

use std::collections::HashMap;

use axum::Router;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::routing::get;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};

use super::{ApiError, AppState, FakeApiServer, json_response};

pub(super) fn routes() -> Router<AppState> {
    Router::new()
        .route(
            "/api/v1/namespaces/{ns}/persistentvolumeclaims/{name}",
            get(get_pvc),
        )
        .route("/api/v1/persistentvolumes/{name}", get(get_pv))
}

impl FakeApiServer {
    /// Stores the claim (its namespace defaulted to `default`), with a uid
    /// and resourceVersion as the API server sets them; returns it.
    pub fn add_pvc(&self, mut pvc: PersistentVolumeClaim) -> PersistentVolumeClaim {
        let mut inner = self.lock();
        let ns = pvc
            .metadata
            .namespace
            .get_or_insert_with(|| "default".into())
            .clone();
        let name = pvc.metadata.name.clone().unwrap_or_default();
        inner.revision += 1;
        pvc.metadata.resource_version = Some(inner.revision.to_string());
        if pvc.metadata.uid.is_none() {
            pvc.metadata.uid = Some(inner.next_uid());
        }
        inner.claims.insert((ns, name), pvc.clone());
        drop(inner);
        self.notify();
        pvc
    }

    /// Stores the volume; returns it.
    pub fn add_pv(&self, mut pv: PersistentVolume) -> PersistentVolume {
        let mut inner = self.lock();
        let name = pv.metadata.name.clone().unwrap_or_default();
        inner.revision += 1;
        pv.metadata.resource_version = Some(inner.revision.to_string());
        if pv.metadata.uid.is_none() {
            pv.metadata.uid = Some(inner.next_uid());
        }
        inner.persistent_volumes.insert(name, pv.clone());
        drop(inner);
        self.notify();
        pv
    }
}

async fn get_pvc(
    State(shared): State<AppState>,
    Path(path): Path<HashMap<String, String>>,
) -> Result<Response, ApiError> {
    let (ns, name) = (&path["ns"], &path["name"]);
    let inner = shared.lock();
    let pvc = inner
        .claims
        .get(&(ns.clone(), name.clone()))
        .ok_or_else(|| ApiError::not_found("persistentvolumeclaims", name))?;
    Ok(json_response(StatusCode::OK, pvc))
}

async fn get_pv(
    State(shared): State<AppState>,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    let inner = shared.lock();
    let pv = inner
        .persistent_volumes
        .get(&name)
        .ok_or_else(|| ApiError::not_found("persistentvolumes", &name))?;
    Ok(json_response(StatusCode::OK, pv))
}
