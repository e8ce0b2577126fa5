//! The OTLP/gRPC client of the export sink: one lazily connected channel to the cluster
//! admin's endpoint, with their CA and headers, and how its answers are judged (retry or
//! give up), as the OTLP specification's retry rules say.

use std::path::Path;
use std::time::Duration;

use flamefleet_pprof::otlp::collector::ExportProfilesServiceRequest;
use flamefleet_pprof::otlp::collector::profiles_service_client::ProfilesServiceClient;
use tonic::codec::CompressionEncoding;
use tonic::metadata::{AsciiMetadataKey, AsciiMetadataValue, MetadataMap};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

/// How long a connection attempt to the endpoint may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Most headers read from the headers directory, and their largest value, bytes.
const MAX_HEADERS: usize = 32;
const MAX_HEADER_BYTES: u64 = 8 << 10;

/// Where and how to send.
#[derive(Clone)]
pub struct SinkConfig {
    /// `http://host:port` (plaintext) or `https://host:port`.
    pub endpoint: String,
    /// CA bundle (PEM) for an https endpoint; the public web roots when `None`.
    pub ca_pem: Option<String>,
    /// Headers sent with every export (credentials, tenant IDs).
    pub headers: Vec<(String, String)>,
    /// Deadline of one export call.
    pub timeout: Duration,
    /// Compress requests with gzip.
    pub gzip: bool,
}

impl std::fmt::Debug for SinkConfig {
    // Header values are credentials: never shown.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SinkConfig")
            .field("endpoint", &self.endpoint)
            .field("ca_pem", &self.ca_pem.is_some())
            .field(
                "headers",
                &self.headers.iter().map(|(k, _)| k).collect::<Vec<_>>(),
            )
            .field("timeout", &self.timeout)
            .field("gzip", &self.gzip)
            .finish()
    }
}

/// Reads export headers from a directory with one file per header (a mounted Secret: each
/// key a header name, its value the header's value; a trailing newline is dropped). Entries
/// starting with `.` (the Secret volume's own `..data` links) are skipped.
///
/// # Errors
/// An unreadable directory or file, too many or too large headers (the message names the
/// file, never its value).
pub fn read_headers(dir: &Path) -> Result<Vec<(String, String)>, String> {
    use std::io::Read as _;
    let entries = std::fs::read_dir(dir).map_err(|e| {
        format!(
            "reading the export headers directory {}: {e}",
            dir.display()
        )
    })?;
    let mut headers = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| format!("reading {}: {e}", dir.display()))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') {
            continue;
        }
        let path = entry.path();
        if !path.is_file() {
            continue;
        }
        if headers.len() == MAX_HEADERS {
            return Err(format!(
                "{} holds more than {MAX_HEADERS} headers; keep only the export's",
                dir.display()
            ));
        }
        let mut value = String::new();
        std::fs::File::open(&path)
            .and_then(|f| f.take(MAX_HEADER_BYTES + 1).read_to_string(&mut value))
            .map_err(|e| format!("reading export header {}: {e}", path.display()))?;
        if value.len() as u64 > MAX_HEADER_BYTES {
            return Err(format!(
                "export header {} is larger than {MAX_HEADER_BYTES} bytes",
                path.display()
            ));
        }
        let value = value.strip_suffix('\n').unwrap_or(&value);
        let value = value.strip_suffix('\r').unwrap_or(value);
        headers.push((name, value.to_owned()));
    }
    headers.sort();
    Ok(headers)
}

/// Adds the configured headers to every call.
#[derive(Clone)]
pub struct Headers(MetadataMap);

impl Interceptor for Headers {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        for kv in self.0.iter() {
            if let tonic::metadata::KeyAndValueRef::Ascii(k, v) = kv {
                request.metadata_mut().insert(k.clone(), v.clone());
            }
        }
        Ok(request)
    }
}

/// What a failed export means for the export.
#[derive(Debug)]
pub enum SendError {
    /// Worth trying again later (the endpoint is down, overloaded or timed out); not before
    /// the delay the endpoint asked for, if it did.
    Retryable(String, Option<Duration>),
    /// Trying again would fail the same way (refused, malformed, unauthenticated).
    Permanent(String),
}

/// A connected (lazily, and reconnecting by itself) OTLP profiles client.
#[derive(Clone)]
pub struct Sink {
    client: ProfilesServiceClient<InterceptedService<Channel, Headers>>,
    endpoint: String,
}

impl std::fmt::Debug for Sink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sink")
            .field("endpoint", &self.endpoint)
            .finish_non_exhaustive()
    }
}

impl Sink {
    /// A client of `config.endpoint`; connects at the first export.
    ///
    /// # Errors
    /// A malformed endpoint, CA or header (the message never shows a header's value).
    pub fn new(config: &SinkConfig) -> Result<Self, String> {
        let url: url::Url = config.endpoint.parse().map_err(|e| {
            format!(
                "the export endpoint {:?} is not a URL ({e}); expected e.g. http://otel-collector.observability:4317",
                config.endpoint
            )
        })?;
        let tls = match url.scheme() {
            "http" => {
                if config.ca_pem.is_some() {
                    return Err(format!(
                        "an export CA was given for the plaintext endpoint {}; use https://",
                        config.endpoint
                    ));
                }
                false
            }
            "https" => true,
            other => {
                return Err(format!(
                    "the export endpoint {} has scheme {other}; expected http or https",
                    config.endpoint
                ));
            }
        };
        let mut endpoint = Endpoint::from_shared(config.endpoint.clone())
            .map_err(|e| format!("the export endpoint {}: {e}", config.endpoint))?
            .connect_timeout(CONNECT_TIMEOUT)
            .timeout(config.timeout)
            .tcp_keepalive(Some(Duration::from_secs(60)));
        if tls {
            let mut tls = ClientTlsConfig::new();
            tls = match &config.ca_pem {
                Some(pem) => tls.ca_certificate(Certificate::from_pem(pem)),
                None => tls.with_webpki_roots(),
            };
            endpoint = endpoint
                .tls_config(tls)
                .map_err(|e| format!("the export endpoint's TLS settings: {e}"))?;
        }
        let mut metadata = MetadataMap::new();
        for (name, value) in &config.headers {
            let key = AsciiMetadataKey::from_bytes(name.to_ascii_lowercase().as_bytes()).map_err(
                |_| format!("export header name {name:?} is not a valid gRPC metadata key"),
            )?;
            let value = AsciiMetadataValue::try_from(value.as_str()).map_err(|_| {
                format!("the value of export header {name:?} is not printable ASCII")
            })?;
            metadata.insert(key, value);
        }
        let mut client =
            ProfilesServiceClient::with_interceptor(endpoint.connect_lazy(), Headers(metadata));
        if config.gzip {
            // The endpoint answers in the encoding of the request (grpc-go does): a client
            // that sends gzip must read it too.
            client = client
                .send_compressed(CompressionEncoding::Gzip)
                .accept_compressed(CompressionEncoding::Gzip);
        }
        Ok(Self {
            client,
            endpoint: config.endpoint.clone(),
        })
    }

    /// Sends one export request; returns the profiles the endpoint says it rejected (a
    /// partial success) with its message.
    ///
    /// # Errors
    /// [`SendError`], judged by the gRPC status as OTLP's retry rules say.
    pub async fn send(
        &self,
        request: ExportProfilesServiceRequest,
    ) -> Result<Option<(i64, String)>, SendError> {
        let mut client = self.client.clone();
        match client.export(request).await {
            Ok(response) => Ok(response
                .into_inner()
                .partial_success
                .filter(|p| p.rejected_profiles > 0 || !p.error_message.is_empty())
                .map(|p| (p.rejected_profiles, p.error_message))),
            Err(status) => Err(judge(&status)),
        }
    }
}

/// The `google.rpc.Status` of a gRPC error's `grpc-status-details-bin` (only the fields read).
#[derive(Clone, PartialEq, prost::Message)]
struct RpcStatus {
    #[prost(message, repeated, tag = "3")]
    details: Vec<RpcAny>,
}

/// `google.protobuf.Any`.
#[derive(Clone, PartialEq, prost::Message)]
struct RpcAny {
    #[prost(string, tag = "1")]
    type_url: String,
    #[prost(bytes = "vec", tag = "2")]
    value: Vec<u8>,
}

/// `google.rpc.RetryInfo`.
#[derive(Clone, PartialEq, prost::Message)]
struct RetryInfo {
    #[prost(message, optional, tag = "1")]
    retry_delay: Option<RpcDuration>,
}

/// `google.protobuf.Duration`.
#[derive(Clone, PartialEq, prost::Message)]
struct RpcDuration {
    #[prost(int64, tag = "1")]
    seconds: i64,
    #[prost(int32, tag = "2")]
    nanos: i32,
}

/// Longest retry delay taken from an endpoint (it is the endpoint's word, not ours).
const MAX_ASKED_DELAY: Duration = Duration::from_secs(300);

/// The delay of the `google.rpc.RetryInfo` in `status`'s details, if it carries one.
fn retry_info(status: &tonic::Status) -> Option<Duration> {
    use prost::Message as _;
    let details = RpcStatus::decode(status.details()).ok()?;
    let info = details
        .details
        .iter()
        .find(|a| a.type_url.ends_with("/google.rpc.RetryInfo"))?;
    let delay = RetryInfo::decode(&info.value[..]).ok()?.retry_delay?;
    let seconds = u64::try_from(delay.seconds).ok()?;
    let nanos = u32::try_from(delay.nanos).ok()?;
    Some(Duration::new(seconds, nanos.min(999_999_999)).min(MAX_ASKED_DELAY))
}

/// OTLP/gRPC: these codes are transient; every other one is not. RESOURCE_EXHAUSTED is
/// transient when the server says when to come back (a `RetryInfo` in the status details:
/// the spec's throttling, e.g. a Collector's memory limiter), and not without one (a message
/// over the server's size limit would fail again).
fn judge(status: &tonic::Status) -> SendError {
    use tonic::Code;
    let text = format!("{:?}: {}", status.code(), status.message());
    match status.code() {
        Code::Cancelled
        | Code::DeadlineExceeded
        | Code::Aborted
        | Code::OutOfRange
        | Code::Unavailable
        | Code::DataLoss => SendError::Retryable(text, retry_info(status)),
        Code::ResourceExhausted => match retry_info(status) {
            Some(delay) => SendError::Retryable(text, Some(delay)),
            None => SendError::Permanent(text),
        },
        _ => SendError::Permanent(text),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(endpoint: &str) -> SinkConfig {
        SinkConfig {
            endpoint: endpoint.into(),
            ca_pem: None,
            headers: vec![("Authorization".into(), "Bearer s3cret".into())],
            timeout: Duration::from_secs(10),
            gzip: true,
        }
    }

    #[tokio::test]
    async fn endpoints_and_headers_are_checked_up_front() {
        assert!(Sink::new(&config("http://collector:4317")).is_ok());
        assert!(Sink::new(&config("https://collector:4317")).is_ok());
        let e = Sink::new(&config("ftp://collector")).unwrap_err();
        assert!(e.contains("expected http or https"), "{e}");
        let e = Sink::new(&config("collector:4317")).unwrap_err();
        assert!(
            e.contains("expected http or https") || e.contains("not a URL"),
            "{e}"
        );
        let mut c = config("http://collector:4317");
        c.headers = vec![("x-token".into(), "line\nbreak".into())];
        let e = Sink::new(&c).unwrap_err();
        assert!(e.contains("x-token") && !e.contains("line"), "{e}");
        // Credentials never show in debug output.
        assert!(!format!("{:?}", config("http://c:1")).contains("s3cret"));
    }

    #[test]
    fn headers_come_from_a_secret_volume() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("authorization"), "Bearer abc\n").unwrap();
        std::fs::write(dir.path().join("x-scope-orgid"), "tenant-1").unwrap();
        std::fs::create_dir(dir.path().join("..2026_11_29")).unwrap();
        std::fs::write(dir.path().join("..data"), "").unwrap();
        assert_eq!(
            read_headers(dir.path()).unwrap(),
            [
                ("authorization".to_owned(), "Bearer abc".to_owned()),
                ("x-scope-orgid".to_owned(), "tenant-1".to_owned())
            ]
        );
        std::fs::write(dir.path().join("huge"), vec![b'a'; 9000]).unwrap();
        assert!(read_headers(dir.path()).unwrap_err().contains("huge"));
    }

    /// A status whose details carry a RetryInfo of `delay`.
    fn throttled(delay: Duration) -> tonic::Status {
        use prost::Message as _;
        let info = RetryInfo {
            retry_delay: Some(RpcDuration {
                seconds: i64::try_from(delay.as_secs()).unwrap(),
                nanos: i32::try_from(delay.subsec_nanos()).unwrap(),
            }),
        };
        let details = RpcStatus {
            details: vec![RpcAny {
                type_url: "type.googleapis.com/google.rpc.RetryInfo".into(),
                value: info.encode_to_vec(),
            }],
        };
        tonic::Status::with_details(
            tonic::Code::ResourceExhausted,
            "memory limiter",
            details.encode_to_vec().into(),
        )
    }

    #[test]
    fn resource_exhausted_is_retried_when_the_endpoint_says_when() {
        match judge(&throttled(Duration::from_millis(2500))) {
            SendError::Retryable(text, delay) => {
                assert_eq!(delay, Some(Duration::from_millis(2500)));
                assert!(text.contains("ResourceExhausted"), "{text}");
            }
            other => panic!("{other:?}"),
        }
        // An endpoint cannot hold the worker for long.
        assert!(matches!(
            judge(&throttled(Duration::from_secs(86_400))),
            SendError::Retryable(_, Some(d)) if d == MAX_ASKED_DELAY
        ));
        // Without RetryInfo (e.g. a message over the server's size limit): dropped.
        assert!(matches!(
            judge(&tonic::Status::resource_exhausted("message too large")),
            SendError::Permanent(_)
        ));
    }

    #[test]
    fn only_transient_codes_are_retried() {
        assert!(matches!(
            judge(&tonic::Status::unavailable("down")),
            SendError::Retryable(_, None)
        ));
        assert!(matches!(
            judge(&tonic::Status::invalid_argument("bad")),
            SendError::Permanent(_)
        ));
        assert!(matches!(
            judge(&tonic::Status::unauthenticated("who")),
            SendError::Permanent(_)
        ));
    }
}
