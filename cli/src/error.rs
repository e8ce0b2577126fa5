//! The CLI's error type and the exit code of each failure (documented in docs/cli.md).

/// Everything `kubectl profile` can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The named ProfileRequest does not exist.
    #[error(
        "profilerequest {name:?} not found in namespace {namespace:?}; list them with `kubectl profile list -n {namespace}`"
    )]
    NotFound {
        /// The request's name.
        name: String,
        /// Its namespace.
        namespace: String,
    },
    /// The ProfileRequest finished as Failed.
    #[error("profilerequest {name:?} failed:\n{details}")]
    RequestFailed {
        /// The request's name.
        name: String,
        /// One line per node: its phase and message.
        details: String,
    },
    /// The request lists no artifact (yet).
    #[error(
        "profilerequest {name:?} has no artifacts yet (phase {phase}); wait until it finishes, e.g. `kubectl get preq {name} -n {namespace} -w`"
    )]
    NoArtifacts {
        /// The request's name.
        name: String,
        /// Its namespace.
        namespace: String,
        /// Its current phase.
        phase: String,
    },
    /// The request's per-node results (its ProfileResultSlices) are missing or unreadable.
    #[error(
        "profilerequest {name:?}: {reason}; its per-node results live in ProfileResultSlices (`kubectl get prslice -l flamefleet.dev/request-uid={uid} -n {namespace}`)"
    )]
    ResultsMissing {
        /// The request's name.
        name: String,
        /// Its UID.
        uid: String,
        /// Its namespace.
        namespace: String,
        /// What is wrong.
        reason: String,
    },
    /// The artifact store could not be reached or answered with an error.
    #[error("cannot download artifact {artifact} from {url}: {reason}")]
    StoreUnreachable {
        /// The artifact's name.
        artifact: String,
        /// The URL without its query (signatures stay out of logs).
        url: String,
        /// What went wrong.
        reason: String,
    },
    /// A downloaded artifact's SHA-256 differs from the status.
    #[error(
        "checksum mismatch for artifact {artifact}: the status says sha256 {expected}, the store sent {found}; nothing was written. Retry; if it persists the stored file is corrupt"
    )]
    ChecksumMismatch {
        /// The artifact's name.
        artifact: String,
        /// The SHA-256 in the status.
        expected: String,
        /// The SHA-256 of the downloaded bytes.
        found: String,
    },
    /// The API server refused the operation.
    #[error(
        "forbidden: {message}; ask your cluster admin for the RBAC permission (e.g. `kubectl auth can-i {verb} {resource}.flamefleet.dev -n {namespace}`)"
    )]
    Forbidden {
        /// The API server's message.
        message: String,
        /// The verb that was refused.
        verb: String,
        /// The resource (plural), e.g. `profilerequests`.
        resource: String,
        /// The namespace.
        namespace: String,
    },
    /// The API server refused the ProfileDownload (RBAC or the admission policy).
    #[error(
        "download forbidden: {message}; downloading needs `create` on profiledownloads.flamefleet.dev and `get` on the profilerequests (check with `kubectl auth can-i create profiledownloads.flamefleet.dev -n {namespace}`)"
    )]
    DownloadRefused {
        /// The API server's message.
        message: String,
        /// The namespace.
        namespace: String,
    },
    /// The operator answered the ProfileDownload with a failure.
    #[error("the operator cannot give download URLs: {message}")]
    DownloadFailed {
        /// The operator's message.
        message: String,
    },
    /// No operator answered the ProfileDownload in time.
    #[error(
        "no answer to profiledownload {name:?} within {seconds}s: is the Flamefleet operator running? (`kubectl get pods -l app.kubernetes.io/name=flamefleet-operator -A`)"
    )]
    DownloadUnanswered {
        /// The ProfileDownload's name.
        name: String,
        /// How long we waited.
        seconds: u64,
    },
    /// The named sampling policy does not exist.
    #[error(
        "{policy} not found (namespace {namespace:?} for sp/); list them with `kubectl get sp,csp -A`"
    )]
    PolicyNotFound {
        /// `sp/NAME` or `csp/NAME`.
        policy: String,
        /// The namespace looked in.
        namespace: String,
    },
    /// A policy has no finished run in the asked window.
    #[error(
        "{policy} has no finished run in the last {since} ({runs} runs in all, {unfinished} in the window not finished yet); widen --since or wait for the next run"
    )]
    NoRuns {
        /// `sp/NAME` or `csp/NAME`.
        policy: String,
        /// The window.
        since: String,
        /// How many runs exist.
        runs: usize,
        /// Runs in the window still running.
        unfinished: usize,
    },
    /// The ProfileRequest CRD is not installed.
    #[error(
        "Flamefleet is not installed on this cluster: the API server has no profilerequests.flamefleet.dev resource; install the CRDs with `kubectl apply -f crds/` (or `helm install flamefleet charts/flamefleet`)"
    )]
    NotInstalled,
    /// Waiting for the request timed out.
    #[error(
        "timed out after {seconds}s waiting for profilerequest {name:?} {} (phase {phase}); {}",
        timeout_goal(*.unaccepted),
        timeout_hint(.name, .namespace, *.unaccepted)
    )]
    Timeout {
        /// The request's name.
        name: String,
        /// Its namespace.
        namespace: String,
        /// How long we waited (since the capture started, when it did).
        seconds: u64,
        /// The last phase seen.
        phase: String,
        /// No operator had written any status.
        unaccepted: bool,
    },
    /// The user pressed Ctrl-C while the CLI waited or downloaded.
    #[error("interrupted: {}", interrupted(.name, .namespace, *.finished))]
    Interrupted {
        /// The request's name.
        name: String,
        /// Its namespace.
        namespace: String,
        /// Whether it had finished (the download was interrupted).
        finished: bool,
    },
    /// The API server refused an object as invalid (HTTP 422): one line of what it said.
    #[error("the API server refused the {kind}: {message}")]
    Invalid {
        /// What was being created, e.g. `profilerequest`.
        kind: String,
        /// The API server's message, on one line.
        message: String,
    },
    /// A file to write exists with other content.
    #[error(
        "{} exists and holds something else; nothing was written. Pass --force to overwrite it, or choose another directory with -o",
        path.display()
    )]
    WouldOverwrite {
        /// The file.
        path: std::path::PathBuf,
    },
    /// Profiles with different sample types cannot be merged.
    #[error(
        "cannot merge profiles of different sample types: {first_source} has [{first}] but {other_source} has [{other}]; merge profiles of one type only"
    )]
    MixedSampleTypes {
        /// The first input.
        first_source: String,
        /// Its sample types.
        first: String,
        /// The disagreeing input.
        other_source: String,
        /// Its sample types.
        other: String,
    },
    /// A profile could not be decoded.
    #[error("{source_name} is not a pprof profile: {reason}")]
    BadProfile {
        /// Where it came from.
        source_name: String,
        /// Why.
        reason: String,
    },
    /// Bad command-line input.
    #[error("{0}")]
    Usage(String),
    /// Kubeconfig could not be loaded.
    #[error("cannot load kubeconfig: {0}; pass --kubeconfig FILE or set KUBECONFIG")]
    Kubeconfig(String),
    /// Any other API error.
    #[error("{action}: {source}")]
    Kube {
        /// What was being done.
        action: String,
        /// kube's error.
        source: kube::Error,
    },
    /// A local file operation failed.
    #[error("{action}: {source}")]
    Io {
        /// What was being done.
        action: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// Rendering the flame graph failed.
    #[error("cannot render the flame graph of {artifact}: {reason}")]
    Render {
        /// The artifact.
        artifact: String,
        /// inferno's error.
        reason: String,
    },
}

fn timeout_goal(unaccepted: bool) -> &'static str {
    if unaccepted {
        "to be accepted"
    } else {
        "to finish"
    }
}

fn timeout_hint(name: &str, namespace: &str, unaccepted: bool) -> String {
    if unaccepted {
        format!(
            "no Flamefleet operator has picked it up: is one running? (`kubectl get pods -A -l app.kubernetes.io/name=flamefleet-operator`); delete it with `kubectl profile delete {name} -n {namespace}`"
        )
    } else {
        format!(
            "it keeps running: fetch it later with `kubectl profile get {name} -n {namespace}`, or delete it with `kubectl profile delete {name} -n {namespace}`"
        )
    }
}

fn interrupted(name: &str, namespace: &str, finished: bool) -> String {
    if finished {
        format!(
            "profilerequest {name:?} has finished; download it with `kubectl profile get {name} -n {namespace}`"
        )
    } else {
        format!(
            "profilerequest {name:?} keeps running; follow it with `kubectl get preq {name} -n {namespace} -w`, download it once it finishes with `kubectl profile get {name} -n {namespace}`, or stop it with `kubectl profile delete {name} -n {namespace}`"
        )
    }
}

/// The result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// The process exit code for this error (see docs/cli.md).
    pub fn exit_code(&self) -> i32 {
        match self {
            Self::Usage(_) | Self::Invalid { .. } => 2,
            Self::NotFound { .. } | Self::PolicyNotFound { .. } => 3,
            Self::RequestFailed { .. } => 4,
            Self::NoArtifacts { .. }
            | Self::ResultsMissing { .. }
            | Self::DownloadFailed { .. }
            | Self::NoRuns { .. } => 5,
            Self::StoreUnreachable { .. } | Self::DownloadUnanswered { .. } => 6,
            Self::ChecksumMismatch { .. } => 7,
            Self::Forbidden { .. } | Self::DownloadRefused { .. } => 8,
            Self::NotInstalled => 9,
            Self::Timeout { .. } => 10,
            Self::MixedSampleTypes { .. } | Self::BadProfile { .. } => 11,
            Self::WouldOverwrite { .. } => 12,
            Self::Interrupted { .. } => 130,
            Self::Kubeconfig(_) | Self::Kube { .. } | Self::Io { .. } | Self::Render { .. } => 1,
        }
    }

    /// Wraps an io::Error with what was being done.
    pub fn io(action: impl Into<String>) -> impl FnOnce(std::io::Error) -> Self {
        let action = action.into();
        move |source| Self::Io { action, source }
    }
}
