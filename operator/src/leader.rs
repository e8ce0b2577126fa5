//! Leader election on a `coordination.k8s.io/v1` Lease, with the `kube-lease-manager` crate
//! (it supports kube 5, renews with server-side apply and tolerates clock skew).
//!
//! Only the leader runs the controller. A replica that loses the Lease stops its controller
//! and exits, so that two replicas never act at the same time; a new leader resumes Running
//! requests through the idempotent `Capture`.

use kube_lease_manager::{LeaseCreateMode, LeaseManagerBuilder};
use tokio::sync::watch;

use crate::{Error, Result};

/// Where and how to hold the Lease.
#[derive(Debug, Clone)]
pub struct LeaseConfig {
    /// Namespace of the Lease.
    pub namespace: String,
    /// Lease name.
    pub name: String,
    /// This replica's identity (its pod name in a cluster).
    pub identity: String,
    /// Seconds a lock stays valid without renewal; a killed leader is replaced after this.
    pub duration_seconds: u64,
    /// Seconds before expiry at which the holder renews.
    pub grace_seconds: u64,
}

/// A running election: `is_leader` flips as the Lease is won or lost.
#[derive(Debug)]
pub struct Election {
    /// True while this replica holds the Lease.
    pub is_leader: watch::Receiver<bool>,
    _task: tokio::task::JoinHandle<
        Result<kube_lease_manager::LeaseManager, kube_lease_manager::LeaseManagerError>,
    >,
}

impl Election {
    /// Starts competing for the Lease (creating it if missing).
    pub async fn start(client: kube::Client, config: &LeaseConfig) -> Result<Self> {
        let manager = LeaseManagerBuilder::new(client, &config.name)
            .with_namespace(&config.namespace)
            .with_identity(&config.identity)
            .with_duration(config.duration_seconds)
            .with_grace(config.grace_seconds)
            .with_create_mode(LeaseCreateMode::AutoCreate)
            .with_field_manager("flamefleet-operator-leader")
            .build()
            .await
            .map_err(|e| Error::Leader {
                lease: format!("{}/{}", config.namespace, config.name),
                reason: e.to_string(),
            })?;
        let (is_leader, task) = manager.watch().await;
        Ok(Self {
            is_leader,
            _task: task,
        })
    }

    /// Waits until this replica leads.
    pub async fn acquired(&mut self) -> Result<()> {
        self.is_leader
            .wait_for(|leading| *leading)
            .await
            .map(|_| ())
            .map_err(|_| Error::Leader {
                lease: String::new(),
                reason: "the election task stopped".into(),
            })
    }

    /// Resolves when this replica stops leading (or the election task stops).
    pub fn lost(&self) -> impl std::future::Future<Output = ()> + Send + Sync + 'static {
        let mut rx = self.is_leader.clone();
        async move {
            let _ = rx.wait_for(|leading| !*leading).await;
        }
    }
}
