//! The debug endpoints of the metrics server: `/debug/services` (the
//! programmed state per Service port and family, JSON or a table) and
//! `/debug/explain` (the decision path of one packet, with the chains of the
//! installed ruleset it traverses read back from the kernel). Both answer
//! from [`ProgrammedState`], what the last successful sync programmed.
//!
//! The decisions are kp-model's ([`kp_model::explain`],
//! [`kp_model::status`]); the chain names are the dataplanes'
//! (`kp_nftables::packet_chains`, `kp_iptables::packet_chains`), the text
//! [`crate::render`]'s. This module only reads the snapshot, asks the
//! kernel and answers.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

use axum::extract::{Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use kp_model::explain::{explain, ChainCheck, DataplaneTrace, Explanation, Packet, Route};
use kp_model::status::{service_ports, FamilyStatus};
use kp_model::{Endpoint, IpFamily, NodeInfo, Protocol, ProxierConfig, ProxyState, ServicePort};
use kp_sync::ProgrammedState;
use serde::Deserialize;

use crate::config::ProxyMode;
use crate::render::{explain_text, status_table};
use kp_model::format_rfc3339;

/// What the debug endpoints read: the snapshot and the settings the
/// dataplanes were built with.
#[derive(Clone)]
pub struct DebugState {
    pub programmed: ProgrammedState,
    /// One per family, as the dataplanes got them.
    pub configs: Arc<Vec<ProxierConfig>>,
    pub mode: ProxyMode,
    pub node: String,
    pub iptables_backend: Option<kp_iptables::Variant>,
}

/// The programmed state per family, the ports whose name starts with
/// `filter`. Families that never synced are listed empty.
pub fn services_status(d: &DebugState, filter: Option<&str>) -> Vec<FamilyStatus> {
    // Clone the matching entries (Arc copies) and release the lock before
    // building rows, so the sync loop never waits for a large answer.
    let snapshot: Vec<(ProxyState, Option<String>, bool)> = {
        let g = d.programmed.read();
        d.configs
            .iter()
            .map(|pc| match g.family(pc.family) {
                Some(f) => {
                    let mut st = ProxyState::new(f.state.family, f.state.node.clone());
                    for (name, sp) in &f.state.services {
                        if filter.is_none_or(|p| name.to_string().starts_with(p)) {
                            st.services.insert(name.clone(), Arc::clone(sp));
                            if let Some(eps) = f.state.endpoints.get(name) {
                                st.endpoints.insert(name.clone(), Arc::clone(eps));
                            }
                        }
                    }
                    (st, f.last_sync.map(format_rfc3339), f.last_full)
                }
                None => (
                    ProxyState::new(pc.family, NodeInfo::named(&d.node)),
                    None,
                    false,
                ),
            })
            .collect()
    };
    snapshot
        .into_iter()
        .map(|(st, last, full)| FamilyStatus {
            family: st.family.to_string(),
            node: st.node.name.clone(),
            zone: st.node.zone.clone(),
            last_sync_kind: last
                .as_ref()
                .map(|_| if full { "full" } else { "partial" }.to_string()),
            last_sync: last,
            service_ports: service_ports(&st, None),
        })
        .collect()
}

/// Why a live explanation could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ExplainError {
    #[error("this proxy runs on node {ours}, not {asked}: ask {asked}'s proxy")]
    OtherNode { ours: String, asked: String },
}

/// Explains `pkt` against the programmed state, then, in nftables and
/// iptables modes, checks the chains it traverses in the kernel.
pub fn explain_live(
    d: &DebugState,
    pkt: &Packet,
    node: Option<&str>,
) -> Result<Explanation, ExplainError> {
    if let Some(n) = node.filter(|n| *n != d.node) {
        return Err(ExplainError::OtherNode {
            ours: d.node.clone(),
            asked: n.to_string(),
        });
    }
    let family = IpFamily::of(&pkt.dst);
    type Hit = (Arc<ServicePort>, Option<Arc<Vec<Endpoint>>>, NodeInfo);
    let (mut ex, hit): (Explanation, Option<Hit>) = {
        let g = d.programmed.read();
        let states: Vec<&ProxyState> = g.families.iter().map(|f| &f.state).collect();
        let cfgs: Vec<&ProxierConfig> = d.configs.iter().collect();
        let mut ex = explain(&states, &cfgs, pkt);
        if ex.node.is_empty() {
            ex.node = d.node.clone();
        }
        let hit = ex.matched.as_ref().and_then(|m| {
            let f = g.family(family)?;
            let sp = f.state.services.get(&m.key)?;
            Some((
                Arc::clone(sp),
                f.state.endpoints.get(&m.key).cloned(),
                f.state.node.clone(),
            ))
        });
        (ex, hit)
    };
    if let (Some(route), Some((sp, eps, node)), Some(pc)) = (
        ex.route(),
        hit,
        d.configs.iter().find(|c| c.family == family),
    ) {
        let eps = eps.as_deref().map(|v| v.as_slice()).unwrap_or(&[]);
        ex.dataplane = kernel_trace(d, &sp, eps, pc, &node, &route);
    }
    Ok(ex)
}

/// The chains `route` traverses per the dataplane's own naming, each looked
/// up in the kernel; None in modes without a chain layout (ipvs,
/// userspace).
pub fn kernel_trace(
    d: &DebugState,
    sp: &ServicePort,
    eps: &[Endpoint],
    pc: &ProxierConfig,
    node: &NodeInfo,
    route: &Route,
) -> Option<DataplaneTrace> {
    let mut trace = DataplaneTrace {
        mode: d.mode.as_str().to_string(),
        ..Default::default()
    };
    match d.mode {
        ProxyMode::Nftables => {
            use kp_nftables::NftBackend;
            let table = format!(
                "{} {}",
                match pc.family {
                    IpFamily::V4 => "ip",
                    IpFamily::V6 => "ip6",
                },
                kp_nftables::TABLE_NAME
            );
            // Netlink, as the proxy itself: no `nft` program needed. A chain
            // of ours without rules counts as missing (every one has rules).
            let mut nl = kp_nftables::NftNetlink::new();
            for chain in kp_nftables::packet_chains(sp, eps, pc, node, route) {
                let present = match nl.chain_has_rules(pc.family, kp_nftables::TABLE_NAME, &chain) {
                    Ok(p) => Some(p),
                    Err(e) => {
                        trace.error.get_or_insert_with(|| e.to_string());
                        None
                    }
                };
                trace.chains.push(ChainCheck {
                    table: table.clone(),
                    chain,
                    present,
                });
            }
        }
        ProxyMode::Iptables => {
            use kp_iptables::IptablesBackend;
            let mut cli = kp_iptables::IptablesCli::choose(pc.family, d.iptables_backend);
            for (table, chain) in kp_iptables::packet_chains(sp, eps, pc, node, route) {
                let present = match cli.chain_exists(&table, &chain) {
                    Ok(p) => Some(p),
                    Err(e) => {
                        trace.error.get_or_insert_with(|| e.to_string());
                        None
                    }
                };
                trace.chains.push(ChainCheck {
                    table,
                    chain,
                    present,
                });
            }
        }
        ProxyMode::Ipvs | ProxyMode::Userspace => return None,
    }
    trace.drift = trace
        .chains
        .iter()
        .filter(|c| c.present == Some(false))
        .map(|c| {
            format!(
                "{} {}: missing or empty in the kernel, though the last sync installed it (the next resync repairs it)",
                c.table, c.chain
            )
        })
        .collect();
    Some(trace)
}

#[derive(Debug, Deserialize)]
struct ExplainQuery {
    src: IpAddr,
    dst: IpAddr,
    port: u16,
    protocol: Option<String>,
    node: Option<String>,
    format: Option<String>,
}

#[derive(Debug, Deserialize)]
struct ServicesQuery {
    service: Option<String>,
    format: Option<String>,
}

fn text(status: StatusCode, body: String) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        body,
    )
        .into_response()
}

fn json<T: serde::Serialize>(v: &T) -> Response {
    match serde_json::to_string_pretty(v) {
        Ok(body) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/json")],
            body + "\n",
        )
            .into_response(),
        Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")),
    }
}

fn wants_text(format: Option<&str>) -> bool {
    matches!(format, Some("text" | "table"))
}

/// Parses a protocol as users write it (`tcp`, `UDP`); TCP when absent.
pub fn parse_protocol(s: Option<&str>) -> Option<Protocol> {
    Protocol::parse(Some(&s.unwrap_or("TCP").to_ascii_uppercase()))
}

async fn explain_handler(State(d): State<DebugState>, Query(q): Query<ExplainQuery>) -> Response {
    let Some(protocol) = parse_protocol(q.protocol.as_deref()) else {
        return text(
            StatusCode::BAD_REQUEST,
            "protocol must be TCP, UDP or SCTP\n".into(),
        );
    };
    let pkt = Packet {
        src: q.src,
        dst: q.dst,
        port: q.port,
        protocol,
    };
    let as_text = wants_text(q.format.as_deref());
    // The kernel read-back blocks (netlink, iptables programs).
    let res = tokio::task::spawn_blocking(move || explain_live(&d, &pkt, q.node.as_deref())).await;
    match res {
        Ok(Ok(ex)) if as_text => text(StatusCode::OK, explain_text(&ex)),
        Ok(Ok(ex)) => json(&ex),
        Ok(Err(e)) => text(StatusCode::BAD_REQUEST, format!("{e}\n")),
        Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")),
    }
}

async fn services_handler(State(d): State<DebugState>, Query(q): Query<ServicesQuery>) -> Response {
    let as_text = wants_text(q.format.as_deref());
    let res = tokio::task::spawn_blocking(move || services_status(&d, q.service.as_deref())).await;
    match res {
        Ok(fams) if as_text => text(StatusCode::OK, status_table(&fams)),
        Ok(fams) => {
            let body: BTreeMap<&str, &Vec<FamilyStatus>> = [("families", &fams)].into();
            json(&body)
        }
        Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")),
    }
}

/// `/debug/services` and `/debug/explain`, merged into the metrics router.
pub fn debug_router(d: DebugState) -> Router {
    Router::new()
        .route("/debug/services", get(services_handler))
        .route("/debug/explain", get(explain_handler))
        .with_state(d)
}
