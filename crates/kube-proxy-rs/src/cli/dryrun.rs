//! `--dry-run`: read the source until it is synced, then print per family
//! the transaction a first full sync would send. Nothing touches the kernel.

use kp_model::Dataplane;
use kp_source::SourceEvent;
use tokio::sync::mpsc::Receiver;

use crate::config::ProxyConfig;

pub async fn dry_run(
    cfg: &ProxyConfig,
    mut rx: Receiver<SourceEvent>,
    dataplanes: &[Box<dyn Dataplane>],
) {
    let mut trackers = crate::modes::trackers(cfg);
    let now = std::time::SystemTime::now();
    while let Some(ev) = rx.recv().await {
        match ev {
            SourceEvent::Synced => break,
            SourceEvent::ServiceApplied(s) => trackers.iter_mut().for_each(|t| {
                if let Err(e) = t.update_service(&s, now) {
                    tracing::warn!("skipping invalid Service: {}", e.0);
                }
            }),
            SourceEvent::SliceApplied(s) => trackers.iter_mut().for_each(|t| {
                if let Err(e) = t.update_endpoint_slice(&s, now) {
                    tracing::warn!("skipping invalid EndpointSlice: {}", e.0);
                }
            }),
            SourceEvent::NodeApplied(n) => trackers.iter_mut().for_each(|t| t.update_node(&n)),
            SourceEvent::ServiceCidrApplied(c) => trackers.iter_mut().for_each(|t| {
                for w in t.update_service_cidr(&c).1 {
                    tracing::warn!("{w}");
                }
            }),
            SourceEvent::ServiceCidrDeleted { name } => trackers.iter_mut().for_each(|t| {
                t.delete_service_cidr(&name);
            }),
            SourceEvent::Invalid(m) => tracing::warn!("skipping invalid object: {m}"),
            _ => {}
        }
    }
    for (t, dp) in trackers.iter_mut().zip(dataplanes.iter()) {
        t.take_changes();
        if t.state().services.is_empty() {
            continue;
        }
        print!("{}", dp.render(t.state()));
    }
}
