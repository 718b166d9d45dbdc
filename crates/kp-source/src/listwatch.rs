//! How one resource is listed and watched, as a pure state machine: fed
//! with what the API server answered, it says which request to make next.
//! reflector.rs makes the requests and feeds the answers back; the tests
//! below drive every transition without a server.
//!
//! The requests are the ones client-go's reflector (v1.35+) makes, so that
//! a proxy costs the API server what upstream's does:
//! - a relist is first a streaming list: a watch with
//!   `sendInitialEvents=true&resourceVersionMatch=NotOlderThan` and
//!   bookmarks, whose initial state the server sends as ADDED events from
//!   its watch cache, ending with a bookmark annotated
//!   `k8s.io/initial-events-end: "true"`; the same stream then carries the
//!   changes;
//! - when the server will not stream (422 with the WatchList feature off;
//!   v1.36 over an etcd without progress notifications answers 200 and
//!   then an ERROR event, 500), a list: `resourceVersion=0&limit=500` the
//!   first time (served from the watch cache, not etcd), the last
//!   resourceVersion seen afterwards (unpaged: from the cache too), and
//!   only when that version is gone (410) a consistent list
//!   (`resourceVersion` unset, pages of 500, an etcd read);
//! - then a watch from the list's resourceVersion, renewed from the last
//!   version seen whenever it ends, relisted (from the last version) only
//!   after 410 Gone.
//!
//! Failures the consumer must hear about (the server unreachable, a list
//! or watch refused) are marked `report`; retries after them wait a
//! backoff the loop computes from `failures` (only data resets it).

use crate::codec::{ApiStatus, ListMeta};

/// client-go's page size for lists.
pub const PAGE_SIZE: u32 = 500;

/// A request to make.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    /// A streaming list (a watch sending the initial state first), from
    /// `resource_version` or, without one, from the most recent state.
    StreamingList { resource_version: Option<String> },
    /// One page of a list. `resource_version` None is a consistent read;
    /// a continuation carries only the token (and the limit).
    List {
        resource_version: Option<String>,
        limit: Option<u32>,
        continue_token: Option<String>,
    },
    /// A watch from `resource_version`.
    Watch { resource_version: String },
}

impl Request {
    /// Begins a relist (the consumer's `Init` goes before it).
    pub fn starts_relist(&self) -> bool {
        matches!(
            self,
            Request::StreamingList { .. }
                | Request::List {
                    continue_token: None,
                    ..
                }
        )
    }

    pub fn is_watch(&self) -> bool {
        !matches!(self, Request::List { .. })
    }

    /// The query string, with the selectors and, for watches, the timeout.
    pub fn query(&self, labels: Option<&str>, fields: Option<&str>, timeout_secs: u32) -> String {
        let mut q = form_urlencoded::Serializer::new(String::new());
        let watch = |q: &mut form_urlencoded::Serializer<'_, String>| {
            q.append_pair("allowWatchBookmarks", "true");
        };
        if let Some(f) = fields.filter(|f| !f.is_empty()) {
            q.append_pair("fieldSelector", f);
        }
        if let Some(l) = labels.filter(|l| !l.is_empty()) {
            q.append_pair("labelSelector", l);
        }
        match self {
            Request::StreamingList { resource_version } => {
                watch(&mut q);
                if let Some(rv) = resource_version {
                    q.append_pair("resourceVersion", rv);
                }
                q.append_pair("resourceVersionMatch", "NotOlderThan");
                q.append_pair("sendInitialEvents", "true");
            }
            Request::List {
                resource_version,
                limit,
                continue_token,
            } => {
                if let Some(c) = continue_token {
                    q.append_pair("continue", c);
                }
                if let Some(l) = limit {
                    q.append_pair("limit", &l.to_string());
                }
                if let (Some(rv), None) = (resource_version, continue_token) {
                    q.append_pair("resourceVersion", rv);
                }
            }
            Request::Watch { resource_version } => {
                watch(&mut q);
                q.append_pair("resourceVersion", resource_version);
            }
        }
        if self.is_watch() {
            q.append_pair("timeoutSeconds", &timeout_secs.to_string());
            q.append_pair("watch", "true");
        }
        q.finish()
    }
}

/// What to do after an answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Next {
    /// Keep reading the current response.
    Read,
    /// Make this request now.
    Send(Request),
    /// Make this request after the backoff for `failures` failures in a row.
    After { failures: u32, request: Request },
}

/// The machine's answer to one input.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    /// A relist completed: the consumer's `InitDone`.
    pub init_done: bool,
    /// The consumer hears of this failure.
    pub report: bool,
    pub next: Next,
}

impl Step {
    fn read() -> Step {
        Step {
            init_done: false,
            report: false,
            next: Next::Read,
        }
    }
    fn send(r: Request) -> Step {
        Step {
            next: Next::Send(r),
            ..Step::read()
        }
    }
}

/// How an object event is passed on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Part of a relist's initial state (`InitApply`).
    Initial,
    /// A change (`Apply` / `Delete`).
    Change,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum State {
    /// No request made yet.
    Idle,
    /// A streaming list; `initial` until its end bookmark.
    Streaming { initial: bool, events: u32 },
    /// A list's page; `rv` and `limit` as the list was asked, `continued`
    /// once past its first page.
    Listing {
        rv: Option<String>,
        limit: Option<u32>,
        continued: bool,
    },
    /// A watch.
    Watching { events: u32 },
}

/// The list/watch state of one resource.
#[derive(Clone, Debug)]
pub struct ListWatch {
    streaming: bool,
    /// The last resourceVersion synced ("" before the first list).
    rv: String,
    /// The last version is gone (410): the next list is a consistent one.
    rv_unavailable: bool,
    /// A `resourceVersion=0` list came back in pages: the server has no
    /// watch cache for this resource, so lists stay paged.
    paginated: bool,
    failures: u32,
    state: State,
}

/// 410 Gone / Expired: the version asked for is no longer kept.
fn is_expired(s: &ApiStatus) -> bool {
    s.code == 410 || s.reason == "Expired" || s.reason == "Gone"
}

/// The version asked for is newer than the server has seen (an API server
/// behind the one that served the last list): as expired.
fn is_too_large(s: &ApiStatus) -> bool {
    s.message.contains("Too large resource version")
        || s.message.contains("too large resource version")
}

impl ListWatch {
    /// `streaming`: try streaming lists first (what upstream's client does).
    pub fn new(streaming: bool) -> ListWatch {
        ListWatch {
            streaming,
            rv: String::new(),
            rv_unavailable: false,
            paginated: false,
            failures: 0,
            state: State::Idle,
        }
    }

    /// The last resourceVersion synced.
    pub fn resource_version(&self) -> &str {
        &self.rv
    }

    /// Consecutive failures (reset by data).
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// The first request.
    pub fn start(&mut self) -> Request {
        self.relist()
    }

    /// The first request when a list at `resource_version` was already
    /// read (by someone else: the caller hands its items to the consumer):
    /// a watch from there, as after this machine's own list.
    pub fn resume(&mut self, resource_version: &str) -> Request {
        self.rv = resource_version.to_string();
        let r = Request::Watch {
            resource_version: self.rv.clone(),
        };
        self.entered(&r);
        r
    }

    /// A relist: streaming first when enabled.
    fn relist(&mut self) -> Request {
        let r = if self.streaming {
            Request::StreamingList {
                resource_version: (!self.rv_unavailable && !self.rv.is_empty())
                    .then(|| self.rv.clone()),
            }
        } else {
            self.list_request()
        };
        self.entered(&r);
        r
    }

    /// The list client-go's reflector makes: from the cache at "0" the
    /// first time, at the last version afterwards (unpaged, so that the
    /// cache serves it), consistent (paged) when that version is gone.
    fn list_request(&self) -> Request {
        let rv = if self.rv_unavailable {
            None
        } else if self.rv.is_empty() {
            Some("0".to_string())
        } else {
            Some(self.rv.clone())
        };
        let limit = match rv.as_deref() {
            _ if self.paginated => Some(PAGE_SIZE),
            Some("0") | None => Some(PAGE_SIZE),
            Some(_) => None,
        };
        Request::List {
            resource_version: rv,
            limit,
            continue_token: None,
        }
    }

    /// Records that `r` is the request in flight.
    fn entered(&mut self, r: &Request) {
        self.state = match r {
            Request::StreamingList { .. } => State::Streaming {
                initial: true,
                events: 0,
            },
            Request::List {
                resource_version,
                limit,
                continue_token,
            } => State::Listing {
                rv: resource_version.clone(),
                limit: *limit,
                continued: continue_token.is_some(),
            },
            Request::Watch { .. } => State::Watching { events: 0 },
        };
    }

    fn go(&mut self, r: Request) -> Step {
        self.entered(&r);
        Step::send(r)
    }

    /// A failure: the consumer hears of it, and `r` follows the backoff.
    fn fail(&mut self, r: Request) -> Step {
        self.failures += 1;
        self.entered(&r);
        Step {
            init_done: false,
            report: true,
            next: Next::After {
                failures: self.failures,
                request: r,
            },
        }
    }

    /// Not worth reporting, but not progress either: `r` after the backoff.
    fn later(&mut self, r: Request) -> Step {
        self.failures += 1;
        self.entered(&r);
        Step {
            init_done: false,
            report: false,
            next: Next::After {
                failures: self.failures,
                request: r,
            },
        }
    }

    fn watch_request(&self) -> Request {
        Request::Watch {
            resource_version: self.rv.clone(),
        }
    }

    /// The request in flight was answered with an error status.
    pub fn refused(&mut self, status: &ApiStatus) -> Step {
        match self.state.clone() {
            State::Idle => {
                let r = self.relist();
                Step::send(r)
            }
            State::Streaming { .. } => {
                if is_expired(status) || is_too_large(status) {
                    // The version asked for is gone: stream the most
                    // recent state instead.
                    self.rv_unavailable = true;
                    let r = self.relist();
                    return Step::send(r);
                }
                // No streaming here (feature off, an older server): list.
                // The list's answer decides what is reported.
                let r = self.list_request();
                self.go(r)
            }
            State::Listing {
                rv,
                limit,
                continued,
            } => {
                if is_expired(status) || is_too_large(status) {
                    if continued {
                        // A continuation expired: the whole list again,
                        // unpaged, at the version first asked (the pager's
                        // fallback).
                        return self.go(Request::List {
                            resource_version: rv,
                            limit: None,
                            continue_token: None,
                        });
                    }
                    if rv.is_some() {
                        self.rv_unavailable = true;
                        let r = self.list_request();
                        return self.go(r);
                    }
                }
                let _ = limit;
                let r = self.relist();
                self.fail(r)
            }
            State::Watching { .. } => {
                if is_expired(status) {
                    let r = self.relist();
                    return Step::send(r);
                }
                let r = self.watch_request();
                self.fail(r)
            }
        }
    }

    /// The request in flight got no answer (connection refused, reset,
    /// timed out).
    pub fn unreachable(&mut self) -> Step {
        match self.state {
            State::Watching { .. } | State::Streaming { initial: false, .. } => {
                let r = self.watch_request();
                self.fail(r)
            }
            _ => {
                let r = self.relist();
                self.fail(r)
            }
        }
    }

    /// An object event arrived: how to pass it on.
    pub fn object(&mut self, resource_version: &str) -> Role {
        self.failures = 0;
        match &mut self.state {
            State::Streaming {
                initial: true,
                events,
            } => {
                *events += 1;
                Role::Initial
            }
            State::Streaming { events, .. } | State::Watching { events } => {
                *events += 1;
                if !resource_version.is_empty() {
                    self.rv = resource_version.to_string();
                }
                Role::Change
            }
            State::Listing { .. } | State::Idle => Role::Initial,
        }
    }

    /// A bookmark arrived.
    pub fn bookmark(&mut self, resource_version: &str, initial_events_end: bool) -> Step {
        self.failures = 0;
        let mut step = Step::read();
        match &mut self.state {
            State::Streaming { initial, events } => {
                *events += 1;
                if *initial && initial_events_end {
                    *initial = false;
                    self.rv_unavailable = false;
                    step.init_done = true;
                }
                if !*initial && !resource_version.is_empty() {
                    self.rv = resource_version.to_string();
                }
            }
            State::Watching { events } => {
                *events += 1;
                if !resource_version.is_empty() {
                    self.rv = resource_version.to_string();
                }
            }
            State::Listing { .. } | State::Idle => {}
        }
        step
    }

    /// A list page arrived (its items were passed on as initial state).
    pub fn page(&mut self, meta: &ListMeta) -> Step {
        self.failures = 0;
        let State::Listing { rv, limit, .. } = self.state.clone() else {
            return Step::read();
        };
        if !meta.continue_token.is_empty() {
            if rv.as_deref() == Some("0") {
                self.paginated = true;
            }
            return self.go(Request::List {
                resource_version: rv,
                limit: limit.or(Some(PAGE_SIZE)),
                continue_token: Some(meta.continue_token.clone()),
            });
        }
        self.rv = meta.resource_version.clone();
        self.rv_unavailable = false;
        let r = self.watch_request();
        let mut step = self.go(r);
        step.init_done = true;
        step
    }

    /// An ERROR event arrived on a stream.
    pub fn stream_error(&mut self, status: &ApiStatus) -> Step {
        match self.state {
            State::Streaming { initial: true, .. } => self.refused(status),
            _ if is_expired(status) => {
                // The watch's history is gone: relist from the last version
                // (a streaming list serves it from the cache).
                let r = self.relist();
                Step::send(r)
            }
            _ => {
                let r = self.watch_request();
                self.fail(r)
            }
        }
    }

    /// The stream ended cleanly (its timeout, the server closing it, or a
    /// frame cut off at the end).
    pub fn stream_ended(&mut self) -> Step {
        match self.state {
            // Ended before its initial state was complete: again, later.
            State::Streaming { initial: true, .. } => {
                let r = self.relist();
                self.later(r)
            }
            // A watch that ended with nothing at all: do not spin on a
            // server that closes every watch at once.
            State::Streaming { events: 0, .. } | State::Watching { events: 0 } => {
                let r = self.watch_request();
                self.later(r)
            }
            State::Streaming { .. } | State::Watching { .. } => {
                let r = self.watch_request();
                self.go(r)
            }
            State::Listing { .. } | State::Idle => {
                let r = self.relist();
                self.later(r)
            }
        }
    }

    /// The stream broke (a transport error, bytes that do not decode).
    pub fn stream_failed(&mut self) -> Step {
        self.unreachable()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: u16, reason: &str) -> ApiStatus {
        ApiStatus {
            code,
            reason: reason.into(),
            message: String::new(),
        }
    }

    fn streaming(rv: Option<&str>) -> Request {
        Request::StreamingList {
            resource_version: rv.map(Into::into),
        }
    }

    fn list(rv: Option<&str>, limit: Option<u32>) -> Request {
        Request::List {
            resource_version: rv.map(Into::into),
            limit,
            continue_token: None,
        }
    }

    fn watch(rv: &str) -> Request {
        Request::Watch {
            resource_version: rv.into(),
        }
    }

    fn page(rv: &str, cont: &str) -> ListMeta {
        ListMeta {
            resource_version: rv.into(),
            continue_token: cont.into(),
        }
    }

    fn send(r: Request) -> Step {
        Step::send(r)
    }

    fn sent(step: &Step) -> Request {
        match &step.next {
            Next::Send(r) | Next::After { request: r, .. } => r.clone(),
            Next::Read => panic!("no request in {step:?}"),
        }
    }

    /// A machine whose streaming list completed at resourceVersion 10.
    fn streamed() -> ListWatch {
        let mut m = ListWatch::new(true);
        m.start();
        assert_eq!(m.object("5"), Role::Initial);
        assert!(m.bookmark("10", true).init_done);
        m
    }

    #[test]
    fn a_streaming_list_becomes_the_watch() {
        let mut m = ListWatch::new(true);
        assert_eq!(m.start(), streaming(None));
        assert_eq!(m.object("3"), Role::Initial);
        assert_eq!(m.object("7"), Role::Initial);
        // An ordinary bookmark in the initial phase ends nothing.
        assert_eq!(m.bookmark("8", false), Step::read());
        assert_eq!(m.resource_version(), "");
        let s = m.bookmark("10", true);
        assert_eq!(
            s,
            Step {
                init_done: true,
                report: false,
                next: Next::Read
            }
        );
        assert_eq!(m.resource_version(), "10");
        // The same stream carries the changes.
        assert_eq!(m.object("11"), Role::Change);
        assert_eq!(m.resource_version(), "11");
        assert_eq!(m.bookmark("15", false), Step::read());
        assert_eq!(m.resource_version(), "15");
        // Its timeout: a plain watch from there, at once.
        assert_eq!(m.stream_ended(), send(watch("15")));
    }

    #[test]
    fn without_streaming_the_first_list_is_from_the_cache() {
        let mut m = ListWatch::new(false);
        assert_eq!(m.start(), list(Some("0"), Some(500)));
        assert_eq!(m.object("4"), Role::Initial);
        let s = m.page(&page("20", ""));
        assert!(s.init_done && !s.report);
        assert_eq!(s.next, Next::Send(watch("20")));
        assert_eq!(m.object("21"), Role::Change);
        assert_eq!(m.resource_version(), "21");
    }

    #[test]
    fn a_refused_streaming_list_falls_back_to_a_cached_list() {
        // WatchList off: 422 Invalid.
        let mut m = ListWatch::new(true);
        m.start();
        let s = m.refused(&status(422, "Invalid"));
        assert_eq!(s, send(list(Some("0"), Some(500))));
        // v1.36 over an etcd without progress notifications: 200, then an
        // ERROR event before any object.
        let mut m = ListWatch::new(true);
        m.start();
        let s = m.stream_error(&status(500, "InternalError"));
        assert_eq!(s, send(list(Some("0"), Some(500))));
        // Neither is reported: the list's answer decides.
        assert!(!s.report);
    }

    #[test]
    fn a_streaming_list_from_an_expired_version_restarts_from_now() {
        let mut m = streamed();
        // The watch's history went (410 in the stream): relist from 10.
        assert_eq!(
            m.stream_error(&status(410, "Expired")),
            send(streaming(Some("10")))
        );
        // That version is gone as well: from the most recent state.
        assert_eq!(
            m.stream_error(&status(410, "Expired")),
            send(streaming(None))
        );
        assert!(m.bookmark("30", true).init_done);
        assert_eq!(m.resource_version(), "30");
        // Available again: the next relist names it.
        m.stream_error(&status(410, "Gone"));
        assert_eq!(m.relist(), streaming(Some("30")));
    }

    #[test]
    fn a_streaming_list_cut_short_is_retried_after_a_backoff() {
        let mut m = ListWatch::new(true);
        m.start();
        m.object("3");
        let s = m.stream_ended();
        assert_eq!(
            s.next,
            Next::After {
                failures: 1,
                request: streaming(None)
            }
        );
        assert!(!s.report && !s.init_done);
    }

    #[test]
    fn relists_after_410_use_the_cache_then_a_consistent_read() {
        let mut m = ListWatch::new(false);
        m.start();
        m.page(&page("20", ""));
        m.object("25");
        // The watch expired: relist at the last version, unpaged (the
        // cache serves it).
        assert_eq!(
            m.stream_error(&status(410, "Expired")),
            send(list(Some("25"), None))
        );
        // Also gone (or too new for this server): consistent, paged.
        assert_eq!(
            m.refused(&status(410, "Expired")),
            send(list(None, Some(500)))
        );
        let s = m.page(&page("40", ""));
        assert_eq!(s.next, Next::Send(watch("40")));
        // Too large a version is treated alike.
        m.stream_error(&status(410, "Expired"));
        let tl = ApiStatus {
            code: 504,
            reason: "Timeout".into(),
            message: "Too large resource version: 99, current: 40".into(),
        };
        assert_eq!(m.refused(&tl), send(list(None, Some(500))));
    }

    #[test]
    fn pages_follow_their_continue_token() {
        let mut m = ListWatch::new(false);
        m.start();
        let s = m.page(&page("20", "tok1"));
        assert!(!s.init_done);
        assert_eq!(
            s.next,
            Next::Send(Request::List {
                resource_version: Some("0".into()),
                limit: Some(500),
                continue_token: Some("tok1".into())
            })
        );
        assert!(!sent(&s).starts_relist());
        // The continuation expired: the whole list at "0", unpaged.
        assert_eq!(
            m.refused(&status(410, "Expired")),
            send(list(Some("0"), None))
        );
        assert!(m.page(&page("21", "")).init_done);
        // A paged answer to resourceVersion=0 (no watch cache): later lists
        // stay paged, even at a version.
        m.stream_error(&status(410, "Expired"));
        assert_eq!(m.resource_version(), "21");
        assert_eq!(m.relist(), list(Some("21"), Some(500)));
    }

    #[test]
    fn a_refused_list_is_reported_and_relisted_after_a_backoff() {
        let mut m = ListWatch::new(true);
        m.start();
        m.refused(&status(422, "Invalid"));
        let s = m.refused(&status(403, "Forbidden"));
        assert!(s.report);
        assert_eq!(
            s.next,
            Next::After {
                failures: 1,
                request: streaming(None)
            }
        );
        // Again: the backoff grows until data arrives.
        m.refused(&status(422, "Invalid"));
        let s = m.refused(&status(500, "InternalError"));
        assert!(matches!(s.next, Next::After { failures: 2, .. }));
        m.refused(&status(422, "Invalid"));
        m.object("1");
        assert_eq!(m.failures(), 0);
    }

    #[test]
    fn watches_resume_from_the_last_version() {
        let mut m = streamed();
        assert_eq!(m.stream_ended(), send(watch("10")));
        // A watch that ends with nothing waits a backoff first.
        let s = m.stream_ended();
        assert_eq!(
            s.next,
            Next::After {
                failures: 1,
                request: watch("10")
            }
        );
        assert!(!s.report);
        m.bookmark("12", false);
        assert_eq!(m.failures(), 0);
        assert_eq!(m.stream_ended(), send(watch("12")));
    }

    #[test]
    fn a_broken_watch_is_reported_and_resumed_from_its_version() {
        let mut m = streamed();
        m.object("11");
        let s = m.stream_failed();
        assert!(s.report);
        assert_eq!(
            s.next,
            Next::After {
                failures: 1,
                request: watch("11")
            }
        );
        // The server unreachable: the same.
        let s = m.unreachable();
        assert!(s.report);
        assert_eq!(
            s.next,
            Next::After {
                failures: 2,
                request: watch("11")
            }
        );
        // Refused (not 410): reported, the same watch again.
        let s = m.refused(&status(500, "InternalError"));
        assert!(s.report);
        assert_eq!(sent(&s), watch("11"));
        // A non-410 ERROR event in the stream: as refused.
        let s = m.stream_error(&status(500, "InternalError"));
        assert!(s.report);
        assert_eq!(sent(&s), watch("11"));
        // 410 when the watch starts: relist, unreported.
        let s = m.refused(&status(410, "Expired"));
        assert_eq!(s, send(streaming(Some("11"))));
    }

    #[test]
    fn an_unreachable_server_during_a_relist_retries_the_relist() {
        let mut m = ListWatch::new(true);
        m.start();
        let s = m.unreachable();
        assert!(s.report);
        assert_eq!(sent(&s), streaming(None));
        let mut m = ListWatch::new(false);
        m.start();
        let s = m.unreachable();
        assert_eq!(sent(&s), list(Some("0"), Some(500)));
        // Broken mid-list: the same.
        m.object("2");
        assert_eq!(sent(&m.stream_failed()), list(Some("0"), Some(500)));
    }

    #[test]
    fn queries_are_client_gos() {
        let q = streaming(None).query(Some("!a,!b"), None, 353);
        assert_eq!(q, "labelSelector=%21a%2C%21b&allowWatchBookmarks=true&resourceVersionMatch=NotOlderThan&sendInitialEvents=true&timeoutSeconds=353&watch=true");
        let q = streaming(Some("7")).query(None, Some("metadata.name=n1"), 300);
        assert_eq!(q, "fieldSelector=metadata.name%3Dn1&allowWatchBookmarks=true&resourceVersion=7&resourceVersionMatch=NotOlderThan&sendInitialEvents=true&timeoutSeconds=300&watch=true");
        assert_eq!(
            list(Some("0"), Some(500)).query(None, None, 300),
            "limit=500&resourceVersion=0"
        );
        assert_eq!(list(None, Some(500)).query(None, None, 300), "limit=500");
        let cont = Request::List {
            resource_version: Some("0".into()),
            limit: Some(500),
            continue_token: Some("abc=".into()),
        };
        assert_eq!(cont.query(None, None, 300), "continue=abc%3D&limit=500");
        assert_eq!(
            watch("42").query(None, None, 599),
            "allowWatchBookmarks=true&resourceVersion=42&timeoutSeconds=599&watch=true"
        );
        assert!(streaming(None).starts_relist() && list(None, None).starts_relist());
        assert!(!watch("1").starts_relist());
    }

    #[test]
    fn a_list_read_elsewhere_is_resumed_with_a_watch_from_its_version() {
        let mut m = ListWatch::new(true);
        assert_eq!(
            m.resume("42"),
            Request::Watch {
                resource_version: "42".into()
            }
        );
        assert_eq!(m.resource_version(), "42");
        assert!(!m.resume("42").starts_relist(), "no Init for the consumer");
    }
}
