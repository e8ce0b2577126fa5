//! The built-in store's HTTP server.
//!
//! - `PUT /v1/artifacts/<key>?expires=&max=[&sha256=]&sig=`: upload with a signed URL.
//! - `GET /v1/artifacts/<key>?expires=&sig=`: download with a signed URL (the operator
//!   signs short-lived ones for a user's ProfileDownload).
//! - `DELETE /v1/artifacts/<namespace>/<request-name>-<uid>?expires=&sig=`: delete a request's
//!   artifacts with a signed URL (or one artifact, with its full key).
//! - `POST /v1/artifacts/<key>?expires=&max=[&sha256=]&sig=` (signed for `VERIFY`): the
//!   artifact's size and SHA-256, checked against the signed limit and checksum; an artifact
//!   that breaks them is deleted (the operator's `verify_upload` when the store runs apart).
//! - `GET /v1/requests/<namespace>/<request-name>-<uid>?expires=&sig=` (signed for `LIST`):
//!   the request's artifacts and their sizes.
//! - `GET /v1/usage/[<namespace>]?expires=&sig=` (signed for `USAGE`, key the namespace or
//!   `*` for all): every request with artifacts, its total size, artifact count and newest
//!   modification (the operator's garbage collector and per-namespace quota).
//! - `GET /healthz`.
//!
//! Errors are JSON `{"error": "..."}` with 400 (bad key), 401 (not a signed URL),
//! 403 (bad, expired or mismatched signature, or not allowed), 404, 413 (too large),
//! 422 (checksum mismatch), 507 (disk full).

use std::{sync::Arc, time::SystemTime};

use axum::{
    Json, Router,
    body::Body,
    extract::{DefaultBodyLimit, Query, State},
    http::{HeaderMap, HeaderValue, StatusCode, Uri, header},
    response::{IntoResponse, Response},
    routing::get,
};
use percent_encoding::percent_decode_str;
use serde_json::json;
use tokio_util::io::ReaderStream;

use super::{ARTIFACTS_PATH, BuiltinStore, REQUESTS_PATH, USAGE_PATH};
use crate::store::{
    ArtifactDigest, ArtifactKey, ArtifactStore, KeyError, RequestRef, SHA256_HEADER, Sha256Digest,
    StoreError,
    signing::{SignatureError, SignedQuery},
};

/// An HTTP error: a status and a message for the client.
#[derive(Debug)]
pub struct HttpError {
    status: StatusCode,
    message: String,
}

impl HttpError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }
}

impl IntoResponse for HttpError {
    fn into_response(self) -> Response {
        (self.status, Json(json!({ "error": self.message }))).into_response()
    }
}

impl From<KeyError> for HttpError {
    fn from(e: KeyError) -> Self {
        Self::new(StatusCode::BAD_REQUEST, e.to_string())
    }
}

impl From<SignatureError> for HttpError {
    fn from(e: SignatureError) -> Self {
        let status = match e {
            SignatureError::Missing(_) => StatusCode::UNAUTHORIZED,
            _ => StatusCode::FORBIDDEN,
        };
        Self::new(status, e.to_string())
    }
}

impl From<StoreError> for HttpError {
    fn from(e: StoreError) -> Self {
        let status = match &e {
            StoreError::Key(_) | StoreError::Interrupted { .. } => StatusCode::BAD_REQUEST,
            StoreError::NotFound { .. } => StatusCode::NOT_FOUND,
            StoreError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            StoreError::ChecksumMismatch { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            StoreError::StorageFull { .. } => StatusCode::INSUFFICIENT_STORAGE,
            StoreError::Io { .. }
            | StoreError::Metadata { .. }
            | StoreError::ObjectStore(_)
            | StoreError::Remote { .. }
            | StoreError::Unreachable { .. }
            | StoreError::Config(_) => {
                tracing::error!(error = %e, "artifact store failure");
                StatusCode::INTERNAL_SERVER_ERROR
            }
        };
        Self::new(status, e.to_string())
    }
}

#[derive(Clone)]
struct ServerState {
    store: Arc<BuiltinStore>,
}

/// The HTTP routes of the built-in store, ready to be served with `axum::serve`.
///
pub fn router(store: Arc<BuiltinStore>) -> Router {
    let artifacts = format!("/{ARTIFACTS_PATH}{{*key}}");
    Router::new()
        .route("/healthz", get(healthz))
        .route(
            &artifacts,
            get(get_artifact)
                .put(put_artifact)
                .delete(delete_request)
                .post(verify_artifact),
        )
        .route(&format!("/{REQUESTS_PATH}{{*prefix}}"), get(list_request))
        .route(&format!("/{USAGE_PATH}"), get(usage))
        .route(&format!("/{USAGE_PATH}{{namespace}}"), get(usage))
        // Uploads are bounded by the signed limit while streaming, not by a global cap.
        .layer(DefaultBodyLimit::disable())
        .with_state(ServerState { store })
}

async fn healthz() -> &'static str {
    "ok"
}

/// The decoded path components after `/v1/artifacts/` (or `/v1/requests/`); an empty
/// trailing one is dropped.
fn key_segments(uri: &Uri) -> Result<Vec<String>, HttpError> {
    let raw = uri.path();
    let rest = raw
        .strip_prefix('/')
        .and_then(|p| {
            p.strip_prefix(ARTIFACTS_PATH)
                .or_else(|| p.strip_prefix(REQUESTS_PATH))
        })
        .unwrap_or(raw);
    let mut segments = Vec::new();
    for part in rest.split('/') {
        let decoded = percent_decode_str(part).decode_utf8().map_err(|_| {
            HttpError::new(
                StatusCode::BAD_REQUEST,
                format!("invalid artifact key {rest:?}: percent-encoding is not UTF-8"),
            )
        })?;
        // An encoded slash would smuggle an extra path component past the split.
        if decoded.contains('/') {
            return Err(KeyError::Shape {
                found: rest.to_owned(),
            }
            .into());
        }
        segments.push(decoded.into_owned());
    }
    if segments.len() > 1 && segments.last().is_some_and(String::is_empty) {
        segments.pop();
    }
    Ok(segments)
}

fn artifact_key(uri: &Uri) -> Result<ArtifactKey, HttpError> {
    Ok(ArtifactKey::parse(&key_segments(uri)?.join("/"))?)
}

fn now() -> SystemTime {
    SystemTime::now()
}

fn header_sha256(headers: &HeaderMap) -> Result<Option<Sha256Digest>, HttpError> {
    let Some(value) = headers.get(SHA256_HEADER) else {
        return Ok(None);
    };
    let text = value.to_str().unwrap_or_default();
    text.parse().map(Some).map_err(|_| {
        HttpError::new(
            StatusCode::BAD_REQUEST,
            format!("header {SHA256_HEADER} is {text:?}; expected 64 hexadecimal characters"),
        )
    })
}

async fn put_artifact(
    State(state): State<ServerState>,
    uri: Uri,
    Query(query): Query<SignedQuery>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, HttpError> {
    let key = artifact_key(&uri)?;
    let grant = state
        .store
        .signer()
        .verify("PUT", &key.to_string(), &query, now())?;
    let limit = grant
        .max_bytes
        .unwrap_or(0)
        .min(state.store.max_upload_bytes());
    let announced = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(len) = announced.filter(|len| *len > limit) {
        // Refused before reading a byte.
        return Err(StoreError::TooLarge {
            key: key.to_string(),
            max: limit,
            found: len,
        }
        .into());
    }
    let expected: Vec<Sha256Digest> = grant
        .sha256
        .into_iter()
        .chain(header_sha256(&headers)?)
        .collect();
    let digest = state
        .store
        .write_artifact(&key, body.into_data_stream(), limit, &expected)
        .await?;
    tracing::info!(%key, size = digest.size_bytes, sha256 = %digest.sha256, "artifact stored");
    Ok((StatusCode::CREATED, digest_json(&key, &digest)).into_response())
}

/// The body that answers an upload and a verification: what the store holds at `key`.
fn digest_json(key: &ArtifactKey, digest: &ArtifactDigest) -> Json<serde_json::Value> {
    Json(json!({
        "key": key.to_string(),
        "sizeBytes": digest.size_bytes,
        "sha256": digest.sha256,
    }))
}

async fn get_artifact(
    State(state): State<ServerState>,
    uri: Uri,
    Query(query): Query<SignedQuery>,
) -> Result<Response, HttpError> {
    let key = artifact_key(&uri)?;
    // Only signed URLs: the operator signs short-lived ones for users who asked with a
    // ProfileDownload (authorized by the API server), so the store never sees, and never
    // has to judge, a user's credentials.
    state
        .store
        .signer()
        .verify("GET", &key.to_string(), &query, now())?;
    let (file, digest) = state.store.open_artifact(&key).await?;
    let mut response = Body::from_stream(ReaderStream::new(file)).into_response();
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    h.insert(header::CONTENT_LENGTH, HeaderValue::from(digest.size_bytes));
    h.insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("private, no-store"),
    );
    if let Ok(v) = HeaderValue::from_str(&digest.sha256.to_string()) {
        h.insert(SHA256_HEADER, v);
    }
    Ok(response)
}

async fn delete_request(
    State(state): State<ServerState>,
    uri: Uri,
    Query(query): Query<SignedQuery>,
) -> Result<Response, HttpError> {
    let segments = key_segments(&uri)?;
    // One artifact, with a URL signed to delete exactly it (the operator refusing an
    // artifact past its namespace's quota); anything else must name a request prefix.
    if let Ok(key) = ArtifactKey::parse(&segments.join("/"))
        && state
            .store
            .signer()
            .verify("DELETE", &key.to_string(), &query, now())
            .is_ok()
    {
        state.store.delete_artifact(&key).await?;
        tracing::info!(%key, "artifact deleted");
        return Ok((StatusCode::OK, Json(json!({ "deleted": 1 }))).into_response());
    }
    let prefix = segments.join("/");
    let request = RequestRef::parse_prefix(&prefix)?;
    state
        .store
        .signer()
        .verify("DELETE", &request.prefix(), &query, now())?;
    let deleted = state.store.delete_request(&request).await?;
    tracing::info!(%request, deleted, "artifacts deleted");
    Ok((StatusCode::OK, Json(json!({ "deleted": deleted }))).into_response())
}

async fn verify_artifact(
    State(state): State<ServerState>,
    uri: Uri,
    Query(query): Query<SignedQuery>,
) -> Result<Response, HttpError> {
    let key = artifact_key(&uri)?;
    let grant = state
        .store
        .signer()
        .verify("VERIFY", &key.to_string(), &query, now())?;
    let max = grant
        .max_bytes
        .unwrap_or(u64::MAX)
        .min(state.store.max_upload_bytes());
    let digest = state.store.verify_upload(&key, max, grant.sha256).await?;
    Ok(digest_json(&key, &digest).into_response())
}

async fn list_request(
    State(state): State<ServerState>,
    uri: Uri,
    Query(query): Query<SignedQuery>,
) -> Result<Response, HttpError> {
    let prefix = key_segments(&uri)?.join("/");
    let request = RequestRef::parse_prefix(&prefix)?;
    state
        .store
        .signer()
        .verify("LIST", &request.prefix(), &query, now())?;
    let artifacts: Vec<_> = state
        .store
        .list(&request)
        .await?
        .into_iter()
        .map(|a| json!({"artifact": a.key.artifact(), "sizeBytes": a.size_bytes}))
        .collect();
    Ok(Json(json!({ "artifacts": artifacts })).into_response())
}

/// The key a `USAGE` grant is signed for: the namespace, or `*` for every namespace.
pub fn usage_key(namespace: Option<&str>) -> &str {
    namespace.unwrap_or("*")
}

async fn usage(
    State(state): State<ServerState>,
    uri: Uri,
    Query(query): Query<SignedQuery>,
) -> Result<Response, HttpError> {
    let namespace = uri
        .path()
        .trim_start_matches('/')
        .strip_prefix(USAGE_PATH)
        .filter(|ns| !ns.is_empty())
        .map(str::to_owned);
    if let Some(ns) = &namespace {
        // A namespace is a DNS label; anything else would name no directory of ours.
        RequestRef::new(ns.as_str(), "x", "00000000-0000-0000-0000-000000000000")?;
    }
    state
        .store
        .signer()
        .verify("USAGE", usage_key(namespace.as_deref()), &query, now())?;
    let requests: Vec<_> = state
        .store
        .stored_requests(namespace.as_deref())
        .await?
        .into_iter()
        .map(|r| {
            json!({
                "request": r.request.prefix(),
                "bytes": r.bytes,
                "artifacts": r.artifacts,
                "modified": r.modified
                    .and_then(|m| m.duration_since(SystemTime::UNIX_EPOCH).ok())
                    .map(|d| d.as_secs()),
            })
        })
        .collect();
    Ok(Json(json!({ "requests": requests })).into_response())
}
