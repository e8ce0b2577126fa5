//! Connecting like kubectl: `--kubeconfig`, `--context`, `-n`, the context's namespace.

use std::path::PathBuf;

use kube::config::{KubeConfigOptions, Kubeconfig};
use secrecy::ExposeSecret;

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

/// A connected client, the namespace to use and the user's bearer token (for the store).
#[derive(Clone)]
pub struct Cluster {
    /// The API client.
    pub client: kube::Client,
    /// The namespace commands act in.
    pub namespace: String,
    /// The kubeconfig user's bearer token, if it has one.
    pub token: Option<String>,
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
        let token = match (&config.auth_info.token, &config.auth_info.token_file) {
            (Some(t), _) => Some(t.expose_secret().to_string()),
            (None, Some(file)) => std::fs::read_to_string(file)
                .ok()
                .map(|t| t.trim().to_string()),
            _ => None,
        };
        let namespace = opts
            .namespace
            .clone()
            .unwrap_or_else(|| config.default_namespace.clone());
        let client = kube::Client::try_from(config).map_err(|e| Error::Kube {
            action: "building the API client".into(),
            source: e,
        })?;
        Ok(Self {
            client,
            namespace,
            token,
        })
    }
}
