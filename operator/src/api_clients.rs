//! The operator's API server clients, one per kind of work, so that the calls of one never
//! wait behind another's: each has its own connections and its own queue of calls (a kube
//! client sends every call through one queue). How many ad hoc requests are reconciled at
//! once is bounded by the ProfileRequest controller (`--max-concurrent-reconciles`).

use crate::Error;

/// The operator's clients.
#[derive(Clone)]
pub struct ApiClients {
    /// Leader election, the policies (their schedules and caches), signing, setup: calls
    /// that must not wait (a Lease renewed late is lost; a run created late is missed).
    pub control: kube::Client,
    /// The ProfileRequest controller's calls for ad hoc requests, the ProfileDownload
    /// controller and the store's GC: a new leader resumes every Running request (1,000
    /// measured), and their calls made every other call of the operator wait
    /// (docs/failure-modes.md).
    pub requests: kube::Client,
    /// The ProfileRequest controller's calls for the policies' runs.
    pub runs: kube::Client,
}

impl std::fmt::Debug for ApiClients {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiClients").finish_non_exhaustive()
    }
}

impl ApiClients {
    /// Clients of `config`.
    ///
    /// # Errors
    /// [`Error::Kube`] when the configuration cannot make a client.
    pub fn new(config: &kube::Config) -> crate::Result<Self> {
        let client = || {
            kube::Client::try_from(config.clone())
                .map_err(Error::kube("building the Kubernetes client"))
        };
        Ok(Self {
            control: client()?,
            requests: client()?,
            runs: client()?,
        })
    }
}
