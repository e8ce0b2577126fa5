//! Connecting like kubectl: `--kubeconfig`, `--context`, `-n`, the context's namespace.

use std::path::PathBuf;

use kube::config::{KubeConfigOptions, Kubeconfig};

use crate::error::{Error, Result};

/// Where and how to connect, from the global flags.
#[derive(Debug, Clone, Default)]
pub struct ConnectOptions {
    /// `--kubeconfig`; else `KUBECONFIG` / `~/.kube/config`.
    pub kubeconfig: Option<PathBuf>,
    /// `--context`; else the current context.
    pub context: Option<String>,
    /// `-n/--namespace`; else the context's namespace, else `default`.
    pub namespace: Option<String>,
}

/// A connected client and the namespace to use. (The user's credentials go to the API
/// server only: downloads use URLs the operator signs.)
#[derive(Clone)]
pub struct Cluster {
    /// The API client.
    pub client: kube::Client,
    /// The namespace commands act in.
    pub namespace: String,
}

impl Cluster {
    /// Loads the kubeconfig and builds a client.
    pub async fn connect(opts: &ConnectOptions) -> Result<Self> {
        let kubeconfig = match &opts.kubeconfig {
            Some(path) => Kubeconfig::read_from(path)
                .map_err(|e| Error::Kubeconfig(format!("{}: {e}", path.display())))?,
            None => Kubeconfig::read().map_err(|e| Error::Kubeconfig(e.to_string()))?,
        };
        let options = KubeConfigOptions {
            context: opts.context.clone(),
            ..Default::default()
        };
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &options)
            .await
            .map_err(|e| Error::Kubeconfig(e.to_string()))?;
        let namespace = opts
            .namespace
            .clone()
            .unwrap_or_else(|| config.default_namespace.clone());
        let client = kube::Client::try_from(config).map_err(|e| Error::Kube {
            action: "building the API client".into(),
            source: e,
        })?;
        Ok(Self { client, namespace })
    }
}
