//! The operator's API server clients, one per kind of work, so that the calls of one never
//! wait behind another's: each has its own connections and its own queue of calls (a kube
//! client sends every call through one queue), and the busy ones a bound on their calls in
//! flight ([`CallLimitLayer`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::Request;
use tokio::sync::Semaphore;
use tower::buffer::Buffer;
use tower::{Layer, Service};

use crate::Error;

/// The operator's clients.
#[derive(Clone)]
pub struct ApiClients {
    /// Leader election, the policies (their schedules and caches), signing, setup, and
    /// every controller's watches: calls that must not wait (a Lease renewed late is lost;
    /// a run created late is missed).
    pub control: kube::Client,
    /// The ProfileRequest controller's calls for ad hoc requests, the ProfileDownload
    /// controller and the store's GC, at most `max_concurrent` at once: a new leader
    /// resumes every Running request at once (1,000 measured), and their calls, unbounded,
    /// made every other call of the operator wait at the API server
    /// (docs/failure-modes.md).
    pub requests: kube::Client,
    /// The ProfileRequest controller's calls for the policies' runs, bounded the same way
    /// and apart from the ad hoc requests'.
    pub runs: kube::Client,
}

impl std::fmt::Debug for ApiClients {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiClients").finish_non_exhaustive()
    }
}

impl ApiClients {
    /// Clients of `config`; `max_concurrent` bounds the calls in flight of `requests` and of
    /// `runs` each (0: unbounded). Must be called within a tokio runtime.
    ///
    /// # Errors
    /// [`Error::Kube`] when the configuration cannot make a client.
    pub fn new(config: &kube::Config, max_concurrent: usize) -> crate::Result<Self> {
        let error = Error::kube("building the Kubernetes client");
        let control = kube::Client::try_from(config.clone()).map_err(error)?;
        let bounded = |config: kube::Config| -> crate::Result<kube::Client> {
            let builder = kube::client::ClientBuilder::try_from(config)
                .map_err(Error::kube("building the Kubernetes client"))?;
            Ok(match max_concurrent {
                0 => builder.build(),
                n => builder.with_layer(&CallLimitLayer::new(n)).build(),
            })
        };
        Ok(Self {
            control,
            requests: bounded(config.clone())?,
            runs: bounded(config.clone())?,
        })
    }
}

/// Bounds the calls in flight through a client, watches excepted: a watch stays open for
/// minutes, and one held slot per watching controller starved the calls (measured: with 8
/// slots, no ad hoc request started in 3 minutes). A call holds its slot until its
/// response's headers arrive, as tower's `ConcurrencyLimit` does; it waits for one without
/// holding up the client's other calls.
#[derive(Debug, Clone)]
pub struct CallLimitLayer {
    permits: Arc<Semaphore>,
}

impl CallLimitLayer {
    /// At most `max` calls at once.
    pub fn new(max: usize) -> Self {
        Self {
            permits: Arc::new(Semaphore::new(max.clamp(1, Semaphore::MAX_PERMITS))),
        }
    }
}

impl<S> Layer<S> for CallLimitLayer
where
    S: Service<Request<kube::client::Body>> + Send + 'static,
    S::Future: Send,
    S::Error: Into<tower::BoxError> + Send + Sync,
    S::Response: Send,
{
    type Service = CallLimit<S>;

    fn layer(&self, inner: S) -> Self::Service {
        CallLimit {
            // A queue in front of `inner` makes it cloneable: each call is sent on a clone
            // made ready when it holds its slot.
            inner: Buffer::new(inner, 1024),
            permits: self.permits.clone(),
        }
    }
}

/// See [`CallLimitLayer`].
pub struct CallLimit<S>
where
    S: Service<Request<kube::client::Body>>,
{
    inner: Buffer<Request<kube::client::Body>, S::Future>,
    permits: Arc<Semaphore>,
}

/// Whether `request` opens a watch (`?watch=true`, as kube's watcher sends it).
fn is_watch<B>(request: &Request<B>) -> bool {
    request
        .uri()
        .query()
        .is_some_and(|q| q.split('&').any(|p| p == "watch=true" || p == "watch=1"))
}

impl<S> Service<Request<kube::client::Body>> for CallLimit<S>
where
    S: Service<Request<kube::client::Body>> + Send + 'static,
    S::Future: Send,
    S::Error: Into<tower::BoxError> + Send + Sync,
    S::Response: Send + 'static,
{
    type Response = S::Response;
    type Error = tower::BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, tower::BoxError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Readiness is awaited per call, once it holds its slot.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<kube::client::Body>) -> Self::Future {
        let mut inner = self.inner.clone();
        let permits = (!is_watch(&request)).then(|| self.permits.clone());
        Box::pin(async move {
            let _slot = match permits {
                // The semaphore is never closed.
                Some(permits) => Some(permits.acquire_owned().await?),
                None => None,
            };
            std::future::poll_fn(|cx| inner.poll_ready(cx)).await?;
            inner.call(request).await
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watches_are_told_from_other_calls() {
        let watch = Request::get(
            "/apis/flamefleet.dev/v1alpha1/profilerequests?watch=true&resourceVersion=5",
        )
        .body(())
        .unwrap();
        let list = Request::get(
            "/apis/flamefleet.dev/v1alpha1/profilerequests?labelSelector=watch%3Dtrue",
        )
        .body(())
        .unwrap();
        let get = Request::get("/api/v1/namespaces/a/pods/b")
            .body(())
            .unwrap();
        assert!(is_watch(&watch));
        assert!(!is_watch(&list));
        assert!(!is_watch(&get));
    }
}
