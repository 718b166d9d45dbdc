//! The test API server inside a lab network namespace: its runtime's threads
//! live there, so it listens on that namespace's 127.0.0.1, where a proxy
//! started in the namespace finds it (the reliability tests, kp-bench soak).

use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use serde_json::Value;

use crate::ApiServer;

#[derive(Debug, thiserror::Error)]
pub enum NetnsApiError {
    #[error("starting the test API server in namespace {ns}: {reason}")]
    Start { ns: String, reason: String },
    #[error("a {kind} the test API server cannot decode: {source}")]
    Decode {
        kind: &'static str,
        source: serde_json::Error,
    },
    #[error("the test API server keeps no objects of kind {0:?}")]
    Kind(Option<String>),
}

/// [`ApiServer`] on a runtime of its own in namespace `ns`; stopped on drop.
pub struct NetnsApiServer {
    pub srv: ApiServer,
    stop: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl NetnsApiServer {
    pub fn start(ns: &str) -> Result<NetnsApiServer, NetnsApiError> {
        let err = |reason: String| NetnsApiError::Start {
            ns: ns.to_string(),
            reason,
        };
        let (tx, rx) = mpsc::channel();
        let (stop_tx, stop_rx) = mpsc::channel::<()>();
        let name = ns.to_string();
        let thread = std::thread::spawn(move || {
            let inner = tx.clone();
            let entered = kp_netlab::in_netns(&name, move || {
                let tx = inner;
                let rt = match tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(1)
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = tx.send(Err(format!("runtime: {e}")));
                        return;
                    }
                };
                let srv = rt.block_on(ApiServer::start());
                let _ = tx.send(Ok(srv.clone()));
                let _ = stop_rx.recv();
                srv.shutdown();
                drop(srv);
                rt.shutdown_timeout(Duration::from_secs(1));
            });
            if let Err(e) = entered {
                let _ = tx.send(Err(e.to_string()));
            }
        });
        let srv = rx
            .recv()
            .map_err(|_| err("its thread ended".into()))?
            .map_err(err)?;
        Ok(NetnsApiServer {
            srv,
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }

    /// Creates or replaces a Service, EndpointSlice or Node given as JSON.
    pub fn apply(&self, obj: &Value) -> Result<(), NetnsApiError> {
        fn decode<T: serde::de::DeserializeOwned>(
            kind: &'static str,
            obj: &Value,
        ) -> Result<T, NetnsApiError> {
            T::deserialize(obj).map_err(|source| NetnsApiError::Decode { kind, source })
        }
        match obj["kind"].as_str() {
            Some("Service") => self.srv.apply_service(decode("Service", obj)?),
            Some("EndpointSlice") => self.srv.apply_endpoint_slice(decode("EndpointSlice", obj)?),
            Some("Node") => self.srv.apply_node(decode("Node", obj)?),
            other => return Err(NetnsApiError::Kind(other.map(str::to_string))),
        }
        Ok(())
    }
}

impl Drop for NetnsApiServer {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
