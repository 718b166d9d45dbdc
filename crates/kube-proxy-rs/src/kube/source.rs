//! Starting the configured source: a manifest directory, or the API server
//! (with upstream's Starting Event on our Node).

use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::config::ProxyConfig;

/// The API client from --kubeconfig / --master, or in-cluster.
pub async fn kube_client(cfg: &ProxyConfig) -> Result<kube::Client> {
    let kc = if let Some(path) = &cfg.kubeconfig {
        let kubeconfig = kube::config::Kubeconfig::read_from(path)
            .with_context(|| format!("reading kubeconfig {}", path.display()))?;
        let mut c = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
            .await
            .with_context(|| format!("loading kubeconfig {}", path.display()))?;
        if let Some(m) = &cfg.master {
            c.cluster_url = m.parse().with_context(|| format!("--master {m:?}"))?;
        }
        c
    } else if let Some(m) = &cfg.master {
        kube::Config::new(m.parse().with_context(|| format!("--master {m:?}"))?)
    } else {
        kube::Config::infer().await.context(
            "no --kubeconfig, --master or --manifests given, and not running in a cluster",
        )?
    };
    crate::kube::client::client(kc)
}

/// Whether relists stream: client-go's WatchListClient gate, which
/// upstream's `--feature-gates` / `featureGates` also set.
pub fn streaming_lists(cfg: &ProxyConfig) -> bool {
    crate::metrics::component::feature_states(&cfg.feature_gates)
        .iter()
        .find(|(name, _, _)| *name == "WatchListClient")
        .is_none_or(|&(_, _, on)| on)
}

/// Starts the configured source, sending its events on `tx` (the sync
/// loop's queue). With the API server, refused address claims arriving on
/// `claim_events` are posted as Events on their Services, and the Node
/// watch starts from `node_listed` when the start already listed the Node.
pub async fn start_source(
    cfg: &ProxyConfig,
    node_listed: Option<kp_source::NodeListed>,
    claim_events: tokio::sync::mpsc::UnboundedReceiver<kp_model::RefusedClaim>,
    tx: kp_sync::EventSender,
) -> Result<()> {
    if let Some(dir) = cfg.manifests.clone() {
        if !dir.is_dir() {
            bail!("--manifests {}: not a directory", dir.display());
        }
        tracing::info!(dir = %dir.display(), "reading Services and EndpointSlices from manifests");
        tokio::spawn(async move {
            if let Err(e) =
                kp_source::manifest::run_manifest_source(dir, Duration::from_millis(250), tx).await
            {
                tracing::error!("manifest source stopped: {e}");
            }
        });
    } else {
        let client = kube_client(cfg).await?;
        if !cfg.dry_run {
            // Upstream's birth cry: a "Starting" Event on our Node (kube/events.rs).
            tokio::spawn(crate::kube::events::birth_cry(
                client.clone(),
                cfg.hostname.clone(),
            ));
            if cfg.mode == crate::config::ProxyMode::Ipvs {
                tokio::spawn(crate::kube::events::node_event(
                    client.clone(),
                    cfg.hostname.clone(),
                    kube::runtime::events::EventType::Warning,
                    crate::kube::events::IPVS_DEPRECATION_REASON,
                    crate::kube::events::IPVS_DEPRECATION_NOTE,
                ));
            }
            tokio::spawn(crate::kube::events::post_claim_events(
                client.clone(),
                cfg.hostname.clone(),
                claim_events,
            ));
        }
        let opts = kp_source::api::ApiSourceOptions {
            node_name: cfg.hostname.clone(),
            label_selector: Some(
                kp_source::label_selector(cfg.service_proxy_name.as_deref())
                    .context("--service-proxy-name")?,
            ),
            // As client-go builds its Accept header from these.
            encoding: kp_source::Encoding::new(
                &cfg.client.content_type,
                &cfg.client.accept_content_types,
            ),
            streaming_lists: streaming_lists(cfg),
        };
        tokio::spawn(async move {
            if let Err(e) = kp_source::api::run_api_source_from(client, opts, node_listed, tx).await
            {
                tracing::error!("API source stopped: {e}");
            }
        });
    }
    Ok(())
}
