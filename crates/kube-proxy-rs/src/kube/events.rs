//! Kubernetes Events: the start-up "birth cry" upstream kube-proxy posts on
//! its Node, so `kubectl describe node` shows when the proxy (re)started.
//!
//! Posted as events.k8s.io/v1 through kube's event recorder, which creates an
//! Event and patches it (a series) when the same one repeats: the RBAC rules
//! in deploy/ grant exactly `create` and `patch` on `events.k8s.io` events.

use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};

/// Refused address claims from the sync loop, queued for the API source side,
/// which posts each as a Warning Event on its Service (manifest mode has no
/// receiver: they are dropped there).
pub struct ClaimEventQueue(pub tokio::sync::mpsc::UnboundedSender<kp_model::RefusedClaim>);

impl kp_sync::ClaimEvents for ClaimEventQueue {
    fn refused(&self, _family: kp_model::IpFamily, claim: &kp_model::RefusedClaim) {
        // The receiver is gone only while the process shuts down, or in
        // manifest mode.
        let _ = self.0.send(claim.clone());
    }
}

/// reportingController of our Events.
pub const CONTROLLER: &str = "kube-proxy-rs";
/// Upstream's reason and action for the start event.
pub const START_REASON: &str = "Starting";
pub const START_ACTION: &str = "StartKubeProxy";
pub const START_NOTE: &str = "Starting kube-proxy-rs";

/// The reference upstream uses for its node events: kind Node, the node's
/// name (also as UID, as upstream does, since the Node may not exist yet).
pub fn node_ref(node: &str) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Node".into()),
        name: Some(node.into()),
        uid: Some(node.into()),
        ..Default::default()
    }
}

/// Upstream's warning that IPVS mode is deprecated (KEP-5495), logged as an
/// error and posted as a Warning Event on the Node at every start.
pub const IPVS_DEPRECATION_REASON: &str = "IPVSDeprecation";
pub const IPVS_DEPRECATION_NOTE: &str =
    "The ipvs proxier is now deprecated and may be removed in a future release. Please use 'nftables' instead.";

/// Posts the start Event for `node` (events with retries: [`node_event`]).
pub async fn birth_cry(client: kube::Client, node: String) {
    node_event(client, node, EventType::Normal, START_REASON, START_NOTE).await
}

/// Posts an Event about the proxy's start on `node` (action
/// [`START_ACTION`], as upstream's), retrying a few times (the API server
/// may be briefly unreachable while the node starts). Failure is logged,
/// never fatal: the proxy works without it.
pub async fn node_event(
    client: kube::Client,
    node: String,
    type_: EventType,
    reason: &'static str,
    note: &'static str,
) {
    let recorder = Recorder::new(
        client,
        Reporter {
            controller: CONTROLLER.into(),
            instance: Some(node.clone()),
        },
    );
    let ev = Event {
        type_,
        reason: reason.into(),
        note: Some(note.into()),
        action: START_ACTION.into(),
        secondary: None,
    };
    let reference = node_ref(&node);
    let mut delay = Duration::from_millis(500);
    for attempt in 1..=6 {
        match recorder.publish(&ev, &reference).await {
            Ok(()) => {
                tracing::info!(node = %node, "posted the {reason} event");
                return;
            }
            Err(e) if attempt < 6 => {
                tracing::debug!(error = %e, attempt, reason, "posting an event failed; retrying");
                tokio::time::sleep(delay).await;
                delay *= 2;
            }
            Err(e) => tracing::warn!(error = %e, reason, "could not post the event"),
        }
    }
}

/// Reason of the Warning Event posted on a Service whose address claim was
/// refused (an externalIP or LoadBalancer IP that another Service owns, or a
/// node address and port a host process listens on).
pub const CLAIM_REFUSED_REASON: &str = "AddressClaimRefused";
pub const CLAIM_REFUSED_ACTION: &str = "ProgramAddress";

/// Posts each refused claim as a Warning Event on its Service (the sync loop
/// already logged it and counted kubeproxy_rs_refused_claims_total). Runs
/// until the sender is dropped; a failed post is logged, never fatal.
pub async fn post_claim_events(
    client: kube::Client,
    node: String,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<kp_model::RefusedClaim>,
) {
    let recorder = Recorder::new(
        client,
        Reporter {
            controller: CONTROLLER.into(),
            instance: Some(node),
        },
    );
    while let Some(claim) = rx.recv().await {
        let reference = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Service".into()),
            namespace: Some(claim.service.service.namespace.to_string()),
            name: Some(claim.service.service.name.to_string()),
            ..Default::default()
        };
        // The API server caps an Event's note at 1 kB.
        let mut note = format!("{claim}: the address is not programmed for this Service");
        note.truncate(1000);
        let ev = Event {
            type_: EventType::Warning,
            reason: CLAIM_REFUSED_REASON.into(),
            note: Some(note),
            action: CLAIM_REFUSED_ACTION.into(),
            secondary: None,
        };
        if let Err(e) = recorder.publish(&ev, &reference).await {
            tracing::warn!(error = %e, claim = %claim, "could not post the refused-claim event");
        }
    }
}
