//! /statusz and /flagz on the metrics address, as upstream's component-base
//! z-pages (ComponentStatusz and ComponentFlagz, beta and on in v1.36).
//!
//! Text for people: a title, upstream's warning that the page is not
//! machine parseable, then `key<delimiter>value` lines with the delimiter
//! picked at random (per request for statusz, once per process for flagz)
//! from upstream's four, so that nobody scrapes them. Structured JSON
//! (`application/json;as=Statusz|Flagz;g=config.k8s.io;v=v1beta1`, or
//! v1alpha1 with upstream's deprecation warning) for tools. Any other
//! Accept is answered 406 with a Kubernetes Status, in YAML when YAML was
//! asked for, otherwise JSON.
//!
//! What differs from upstream: no "Go version" (there is no Go here);
//! "Binary version" says kube-proxy-rs (see
//! [`crate::metrics::component::git_version`]); the flags are ours.

use std::ffi::OsString;
use std::hash::{BuildHasher, Hasher};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use clap::CommandFactory;

use crate::config::Cli;
use crate::metrics::component::{git_version, KUBERNETES_VERSION};
use kp_model::format_rfc3339;

const COMPONENT: &str = "kube-proxy";
const WARNING: &str = "Warning: This endpoint is not meant to be machine parseable, has no formatting compatibility guarantees and is for debugging purposes only.";
/// Upstream's delimiters between a key and its value.
const DELIMITERS: [&str; 4] = [":", ": ", "=", " "];
const UNACCEPTABLE: &str =
    "only the following media types are accepted: application/json, application/yaml, text/plain";

/// What the pages show, fixed for the life of the process.
#[derive(Debug, Clone)]
pub struct Zpages {
    pub started: SystemTime,
    /// Every flag with its effective value, sorted by name.
    pub flags: Vec<(String, String)>,
    /// The metrics server's paths, by their first segment (upstream's
    /// aggregation).
    pub paths: Vec<&'static str>,
    /// flagz's delimiter, picked once.
    flag_delimiter: &'static str,
    /// The ComponentStatusz and ComponentFlagz feature gates.
    statusz_enabled: bool,
    flagz_enabled: bool,
}

fn random_index(n: usize) -> usize {
    // RandomState is seeded from the OS per instance: enough to vary the
    // delimiter, which is only meant to discourage parsing.
    let h = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    (h % n as u64) as usize
}

/// `args` (the program's command line, `args[0]` its name) parsed with our
/// flags: each flag's value as given, or its default; "" when it has none.
/// A command line that does not parse (it did when the proxy started)
/// shows the defaults.
pub fn flag_values(args: impl IntoIterator<Item = OsString>) -> Vec<(String, String)> {
    let cmd = Cli::command();
    let matches = cmd
        .clone()
        .try_get_matches_from(args)
        .or_else(|_| cmd.clone().try_get_matches_from(["kube-proxy"]));
    let mut out = Vec::new();
    for arg in cmd.get_arguments() {
        let Some(long) = arg.get_long() else {
            continue;
        };
        let id = arg.get_id().as_str();
        let m = matches.as_ref().ok();
        // Printed as upstream's pflag values print: durations as Go's
        // Duration.String() ("15m0s", not "15m"), lists as "[a,b]".
        let value = if let Some(d) = m.and_then(|m| m.try_get_one::<Duration>(id).ok().flatten()) {
            crate::config::duration::format_go_duration(*d)
        } else {
            let raw: Vec<String> = m
                .and_then(|m| m.try_get_raw(id).ok().flatten())
                .map(|vals| vals.map(|v| v.to_string_lossy().into_owned()).collect())
                .unwrap_or_default();
            if arg.get_value_delimiter().is_some() {
                format!("[{}]", raw.join(","))
            } else {
                raw.join(",")
            }
        };
        out.push((long.to_string(), value));
    }
    // clap's own flags; the process runs, so neither was asked for.
    for own in ["help", "version"] {
        if !out.iter().any(|(k, _)| k == own) {
            out.push((own.to_string(), "false".to_string()));
        }
    }
    out.sort();
    out
}

impl Zpages {
    /// This process: its start time, its command line, and whether the
    /// /debug pages are served.
    pub fn for_process(debug: bool) -> Self {
        let started = crate::metrics::process::read_self()
            .map(|s| UNIX_EPOCH + Duration::from_secs_f64(s.start_time_seconds.max(0.0)))
            .unwrap_or_else(SystemTime::now);
        Self::new(started, flag_values(std::env::args_os()), debug)
    }

    pub fn new(started: SystemTime, flags: Vec<(String, String)>, debug: bool) -> Self {
        let mut paths = vec!["/configz", "/flagz", "/healthz", "/metrics", "/proxyMode"];
        if debug {
            paths.push("/debug");
        }
        paths.sort_unstable();
        Zpages {
            started,
            flags,
            paths,
            flag_delimiter: DELIMITERS[random_index(DELIMITERS.len())],
            statusz_enabled: true,
            flagz_enabled: true,
        }
    }

    /// Serves only the pages whose feature gate is on (upstream's
    /// ComponentStatusz, ComponentFlagz); /statusz then lists no /flagz.
    pub fn with_gates(mut self, statusz: bool, flagz: bool) -> Self {
        self.statusz_enabled = statusz;
        self.flagz_enabled = flagz;
        if !flagz {
            self.paths.retain(|p| *p != "/flagz");
        }
        self
    }

    /// /statusz's text with `delim`, at `now`.
    pub fn statusz_text(&self, now: SystemTime, delim: &str) -> String {
        let up = now
            .duration_since(self.started)
            .unwrap_or_default()
            .as_secs();
        format!(
            "\n{COMPONENT} statusz\n{WARNING}\n\n\
             Started{delim} {}\n\
             Up{delim} {} hr {:02} min {:02} sec\n\
             Binary version{delim} {}\n\
             Emulation version{delim} {}\n\
             Paths{delim} {}\n",
            unix_date(self.started),
            up / 3600,
            (up / 60) % 60,
            up % 60,
            git_version().trim_start_matches('v'),
            emulation_version(),
            self.paths.join(" "),
        )
    }

    /// /flagz's text with `delim`.
    pub fn flagz_text(&self, delim: &str) -> String {
        let mut out = format!("\n{COMPONENT} flagz\n{WARNING}\n");
        for (k, v) in &self.flags {
            out.push_str(&format!("{k}{delim}{v}\n"));
        }
        out
    }

    fn statusz_json(&self, now: SystemTime, version: &str) -> String {
        let start = UNIX_EPOCH
            + Duration::from_secs(
                self.started
                    .duration_since(UNIX_EPOCH)
                    .unwrap_or_default()
                    .as_secs(),
            );
        let body = StatuszObject {
            kind: "Statusz",
            api_version: format!("config.k8s.io/{version}"),
            metadata: Metadata { name: COMPONENT },
            start_time: format_rfc3339(start),
            uptime_seconds: now
                .duration_since(self.started)
                .unwrap_or_default()
                .as_secs(),
            binary_version: git_version().trim_start_matches('v').to_string(),
            emulation_version: emulation_version(),
            paths: &self.paths,
        };
        serde_json::to_string_pretty(&body).unwrap_or_default()
    }

    fn flagz_json(&self, version: &str) -> String {
        let body = FlagzObject {
            kind: "Flagz",
            api_version: format!("config.k8s.io/{version}"),
            metadata: Metadata { name: COMPONENT },
            flags: self
                .flags
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect(),
        };
        serde_json::to_string_pretty(&body).unwrap_or_default()
    }
}

// The structured pages as structs: their fields in upstream's order.
#[derive(serde::Serialize)]
struct Metadata {
    name: &'static str,
}

#[derive(serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct StatuszObject<'a> {
    kind: &'static str,
    api_version: String,
    metadata: Metadata,
    start_time: String,
    uptime_seconds: u64,
    binary_version: String,
    emulation_version: String,
    paths: &'a [&'static str],
}

#[derive(serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct FlagzObject<'a> {
    kind: &'static str,
    api_version: String,
    metadata: Metadata,
    flags: std::collections::BTreeMap<&'a str, &'a str>,
}

/// "1.36": the release whose behaviour this one follows.
fn emulation_version() -> String {
    let mut p = KUBERNETES_VERSION.split('.');
    format!(
        "{}.{}",
        p.next().unwrap_or_default(),
        p.next().unwrap_or_default()
    )
}

/// Go's time.UnixDate in UTC: "Sat Nov  7 22:05:04 UTC 2026".
pub fn unix_date(t: SystemTime) -> String {
    let secs = t.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
    // "YYYY-MM-DDTHH:MM:SSZ" for whole seconds.
    let iso = format_rfc3339(UNIX_EPOCH + Duration::from_secs(secs));
    let (year, month, day, time) = (&iso[0..4], &iso[5..7], &iso[8..10], &iso[11..19]);
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    // 1970-01-01 was a Thursday.
    const DAYS: [&str; 7] = ["Thu", "Fri", "Sat", "Sun", "Mon", "Tue", "Wed"];
    let month = month
        .parse::<usize>()
        .ok()
        .and_then(|m| MONTHS.get(m.wrapping_sub(1)))
        .copied()
        .unwrap_or("???");
    let day: u32 = day.parse().unwrap_or(0);
    format!(
        "{} {month} {day:>2} {time} UTC {year}",
        DAYS[((secs / 86_400) % 7) as usize]
    )
}

/// What a request's Accept header selects.
#[derive(Debug, PartialEq, Eq)]
pub enum Negotiated {
    Text,
    /// Structured, in config.k8s.io `version`.
    Json(&'static str),
    /// Nothing we serve: the Status in YAML if asked for, else in JSON,
    /// compact if JSON itself was asked for (as upstream's encoders do).
    NotAcceptable {
        yaml: bool,
        json: bool,
    },
}

/// Upstream's negotiation: text/plain (also `text/*`, `*/*`, or no Accept),
/// or `application/json` with `as=KIND;g=config.k8s.io;v=v1alpha1|v1beta1`;
/// ranges are tried by quality, then in the order given.
pub fn negotiate(accept: Option<&str>, kind: &str) -> Negotiated {
    let Some(accept) = accept.map(str::trim).filter(|a| !a.is_empty()) else {
        return Negotiated::Text;
    };
    // (quality, position, media type, parameters)
    type Range = (f32, usize, String, Vec<(String, String)>);
    let mut ranges: Vec<Range> = Vec::new();
    for (i, part) in accept.split(',').enumerate() {
        let mut fields = part.split(';').map(str::trim);
        let media = fields.next().unwrap_or_default().to_ascii_lowercase();
        let mut q = 1.0;
        let mut params = Vec::new();
        for p in fields {
            let Some((k, v)) = p.split_once('=') else {
                continue;
            };
            let (k, v) = (k.trim().to_ascii_lowercase(), v.trim().trim_matches('"'));
            if k == "q" {
                q = v.parse().unwrap_or(0.0);
            } else {
                params.push((k, v.to_string()));
            }
        }
        if q > 0.0 {
            ranges.push((q, i, media, params));
        }
    }
    ranges.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let param = |params: &[(String, String)], key: &str| {
        params
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
    };
    for (_, _, media, params) in &ranges {
        match media.as_str() {
            "text/plain" | "text/*" | "*/*" => return Negotiated::Text,
            "application/json"
                if param(params, "as").as_deref() == Some(kind)
                    && param(params, "g").as_deref() == Some("config.k8s.io") =>
            {
                match param(params, "v").as_deref() {
                    Some("v1beta1") => return Negotiated::Json("v1beta1"),
                    Some("v1alpha1") => return Negotiated::Json("v1alpha1"),
                    _ => {}
                }
            }
            _ => {}
        }
    }
    let yaml = ranges.iter().any(|(_, _, m, _)| m == "application/yaml");
    let json = ranges.iter().any(|(_, _, m, _)| m == "application/json");
    Negotiated::NotAcceptable { yaml, json }
}

/// Upstream pretty-prints for people: clients whose User-Agent is curl's,
/// wget's or a browser's.
fn pretty_client(headers: &HeaderMap) -> bool {
    headers
        .get(header::USER_AGENT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ua| {
            ["curl", "Wget", "Mozilla/"]
                .iter()
                .any(|p| ua.starts_with(p))
        })
}

fn not_acceptable(yaml: bool, compact: bool) -> Response {
    // Written out as upstream's encoders print them: JSON in its field
    // order (serde_json would sort it), YAML folded at 80 columns.
    let (ctype, body) = if yaml {
        (
            "application/yaml",
            "apiVersion: v1\ncode: 406\nkind: Status\nmessage: 'only the following media types are accepted: application/json, application/yaml,\n  text/plain'\nmetadata: {}\nreason: NotAcceptable\nstatus: Failure\n".to_string(),
        )
    } else if compact {
        (
            "application/json",
            format!(
                "{{\"kind\":\"Status\",\"apiVersion\":\"v1\",\"metadata\":{{}},\"status\":\"Failure\",\"message\":\"{UNACCEPTABLE}\",\"reason\":\"NotAcceptable\",\"code\":406}}\n"
            ),
        )
    } else {
        (
            "application/json",
            format!(
                "{{\n  \"kind\": \"Status\",\n  \"apiVersion\": \"v1\",\n  \"metadata\": {{}},\n  \"status\": \"Failure\",\n  \"message\": \"{UNACCEPTABLE}\",\n  \"reason\": \"NotAcceptable\",\n  \"code\": 406\n}}"
            ),
        )
    };
    (
        StatusCode::NOT_ACCEPTABLE,
        [(header::CONTENT_TYPE, ctype)],
        body,
    )
        .into_response()
}

fn text(body: String) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], body).into_response()
}

fn structured(kind: &str, version: &str, body: String) -> Response {
    let ctype = format!("application/json;g=config.k8s.io;v={version};as={kind}");
    let mut resp = body.into_response();
    let h = resp.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&ctype) {
        h.insert(header::CONTENT_TYPE, v);
    }
    if version == "v1alpha1" {
        let warning = format!(
            "299 - \"This version of the {} endpoint is deprecated. Please use a newer version.\"",
            kind.to_ascii_lowercase()
        );
        if let Ok(v) = HeaderValue::from_str(&warning) {
            h.insert(header::WARNING, v);
        }
    }
    resp
}

fn accept(headers: &HeaderMap) -> Option<String> {
    // Several Accept headers count as one list.
    let all: Vec<&str> = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect();
    (!all.is_empty()).then(|| all.join(","))
}

async fn statusz(State(z): State<Arc<Zpages>>, headers: HeaderMap) -> Response {
    let now = SystemTime::now();
    match negotiate(accept(&headers).as_deref(), "Statusz") {
        Negotiated::Text => text(z.statusz_text(now, DELIMITERS[random_index(DELIMITERS.len())])),
        Negotiated::Json(v) => structured("Statusz", v, z.statusz_json(now, v)),
        Negotiated::NotAcceptable { yaml, json } => {
            not_acceptable(yaml, json && !pretty_client(&headers))
        }
    }
}

async fn flagz(State(z): State<Arc<Zpages>>, headers: HeaderMap) -> Response {
    match negotiate(accept(&headers).as_deref(), "Flagz") {
        Negotiated::Text => text(z.flagz_text(z.flag_delimiter)),
        Negotiated::Json(v) => structured("Flagz", v, z.flagz_json(v)),
        Negotiated::NotAcceptable { yaml, json } => {
            not_acceptable(yaml, json && !pretty_client(&headers))
        }
    }
}

/// The /statusz and /flagz routes, those whose gate is on.
pub fn router(z: Zpages) -> Router {
    let mut r = Router::new();
    if z.statusz_enabled {
        r = r.route("/statusz", get(statusz));
    }
    if z.flagz_enabled {
        r = r.route("/flagz", get(flagz));
    }
    r.with_state(Arc::new(z))
}

/// The process's pages, built once.
pub fn for_process(debug: bool) -> Zpages {
    static PAGES: OnceLock<Zpages> = OnceLock::new();
    PAGES.get_or_init(|| Zpages::for_process(debug)).clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unix_date_is_gos() {
        let t = UNIX_EPOCH + Duration::from_secs(1_795_903_504); // 2026-11-28T22:05:04Z
        assert_eq!(unix_date(t), "Sat Nov 28 22:05:04 UTC 2026");
        // Go pads a one-digit day with a space.
        let t = UNIX_EPOCH + Duration::from_secs(1_793_840_523);
        assert_eq!(unix_date(t), "Thu Nov  5 01:02:03 UTC 2026");
        assert_eq!(unix_date(UNIX_EPOCH), "Thu Jan  1 00:00:00 UTC 1970");
    }

    #[test]
    fn negotiation_follows_upstream() {
        use Negotiated::*;
        assert_eq!(negotiate(None, "Flagz"), Text);
        assert_eq!(negotiate(Some("*/*"), "Flagz"), Text);
        assert_eq!(negotiate(Some("text/*"), "Flagz"), Text);
        assert_eq!(
            negotiate(Some("text/html, text/plain;q=0.5"), "Flagz"),
            Text
        );
        assert_eq!(
            negotiate(Some("application/json"), "Flagz"),
            NotAcceptable {
                yaml: false,
                json: true
            }
        );
        assert_eq!(
            negotiate(Some("application/yaml"), "Flagz"),
            NotAcceptable {
                yaml: true,
                json: false
            }
        );
        assert_eq!(
            negotiate(Some("text/html"), "Statusz"),
            NotAcceptable {
                yaml: false,
                json: false
            }
        );
        let j = "application/json;as=Flagz;v=v1beta1;g=config.k8s.io";
        assert_eq!(negotiate(Some(j), "Flagz"), Json("v1beta1"));
        // The kind must be the page's.
        assert_eq!(
            negotiate(Some(j), "Statusz"),
            NotAcceptable {
                yaml: false,
                json: true
            }
        );
        assert_eq!(
            negotiate(Some(&format!("{j}, text/plain")), "Flagz"),
            Json("v1beta1")
        );
        assert_eq!(
            negotiate(Some("text/plain;q=0, application/json"), "Flagz"),
            NotAcceptable {
                yaml: false,
                json: true
            }
        );
    }

    #[test]
    fn flags_show_given_values_and_defaults() {
        let flags = flag_values(
            [
                "kube-proxy",
                "--proxy-mode=iptables",
                "--hostname-override=n1",
                "--conntrack-tcp-timeout-established=0",
                "--nodeport-addresses=10.0.0.0/8,primary",
            ]
            .map(OsString::from),
        );
        let get = |k: &str| {
            flags
                .iter()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v.as_str())
                .unwrap_or_else(|| panic!("no flag {k} in {flags:?}"))
        };
        assert_eq!(get("proxy-mode"), "iptables");
        assert_eq!(get("hostname-override"), "n1");
        assert_eq!(get("conntrack-tcp-timeout-established"), "0s");
        assert_eq!(get("nodeport-addresses"), "[10.0.0.0/8,primary]");
        assert_eq!(get("healthz-bind-address"), "0.0.0.0:10256");
        assert_eq!(get("config"), "");
        assert_eq!(get("config-sync-period"), "15m0s");
        assert_eq!(get("ipvs-exclude-cidrs"), "[]");
        assert_eq!(get("help"), "false");
        let names: Vec<&String> = flags.iter().map(|(k, _)| k).collect();
        let mut sorted = names.clone();
        sorted.sort();
        assert_eq!(names, sorted);
    }

    #[test]
    fn text_pages_have_upstreams_layout() {
        let start = UNIX_EPOCH + Duration::from_secs(1_795_903_504);
        let z = Zpages::new(start, vec![("v".into(), "4".into())], false);
        let s = z.statusz_text(start + Duration::from_secs(3723), " ");
        assert!(s.starts_with(&format!(
            "\nkube-proxy statusz\n{WARNING}\n\nStarted  Sat Nov 28"
        )));
        assert!(s.contains("\nUp  1 hr 02 min 03 sec\n"), "{s}");
        assert!(s.contains("\nEmulation version  1.36\n"), "{s}");
        assert!(
            s.ends_with("\nPaths  /configz /flagz /healthz /metrics /proxyMode\n"),
            "{s}"
        );
        assert_eq!(
            z.flagz_text("="),
            format!("\nkube-proxy flagz\n{WARNING}\nv=4\n")
        );
    }
}
