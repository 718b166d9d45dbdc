//! The one queue from the sources to the sync loop.
//!
//! Bounded: while a long sync runs, a source's send waits (and its watch
//! stream with it: the API server buffers) instead of objects queueing
//! without limit; the tracker coalesces whatever the loop then reads. The
//! sources are async and send with `.await`; the sync loop is a thread of
//! its own and waits on the queue with a deadline (the next sync), through
//! a small timer-only runtime of its own.

use std::sync::mpsc::{RecvTimeoutError, TryRecvError};
use std::time::Duration;

use kp_source::SourceEvent;
use tokio::sync::mpsc;

/// Source events waiting for the sync loop, at most.
pub const EVENT_QUEUE: usize = 8192;

/// The sending side: what the sources hold.
pub type EventSender = mpsc::Sender<SourceEvent>;

/// A queue of `capacity` events: the sources' end and the sync loop's.
pub fn event_queue(capacity: usize) -> std::io::Result<(EventSender, Events)> {
    let (tx, rx) = mpsc::channel(capacity.max(1));
    let waiter = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()?;
    Ok((
        tx,
        Events {
            rx,
            waiter: Some(waiter),
        },
    ))
}

/// The sync loop's end of the queue.
pub struct Events {
    rx: mpsc::Receiver<SourceEvent>,
    /// Drives the deadline of a wait (`None` for a [`crate::ManualClock`]'s
    /// queue, whose time is virtual and which never blocks).
    waiter: Option<tokio::runtime::Runtime>,
}

impl Events {
    /// A queue end without a timer, for the virtual clock.
    pub(crate) fn untimed(rx: mpsc::Receiver<SourceEvent>) -> Self {
        Events { rx, waiter: None }
    }

    /// The next event if one is queued.
    pub fn try_recv(&mut self) -> Result<SourceEvent, TryRecvError> {
        self.rx.try_recv().map_err(|e| match e {
            mpsc::error::TryRecvError::Empty => TryRecvError::Empty,
            mpsc::error::TryRecvError::Disconnected => TryRecvError::Disconnected,
        })
    }

    /// Waits up to `timeout` for the next event. Must not be called from
    /// async code (the sync loop runs on a thread of its own).
    pub fn recv_timeout(&mut self, timeout: Duration) -> Result<SourceEvent, RecvTimeoutError> {
        match self.try_recv() {
            Ok(ev) => return Ok(ev),
            Err(TryRecvError::Disconnected) => return Err(RecvTimeoutError::Disconnected),
            Err(TryRecvError::Empty) => {}
        }
        let rx = &mut self.rx;
        match &self.waiter {
            Some(rt) => rt.block_on(async {
                match tokio::time::timeout(timeout, rx.recv()).await {
                    Ok(Some(ev)) => Ok(ev),
                    Ok(None) => Err(RecvTimeoutError::Disconnected),
                    Err(_) => Err(RecvTimeoutError::Timeout),
                }
            }),
            // Only a virtual clock's queue has no timer, and it never waits.
            None => Err(RecvTimeoutError::Timeout),
        }
    }

    /// The plain receiver, for a reader that is async itself (--dry-run).
    pub fn into_receiver(mut self) -> mpsc::Receiver<SourceEvent> {
        if let Some(rt) = self.waiter.take() {
            rt.shutdown_background();
        }
        let (_, empty) = mpsc::channel(1);
        std::mem::replace(&mut self.rx, empty)
    }
}

impl Drop for Events {
    // Dropping a runtime inside async code panics; the queue may be dropped
    // there (a sync thread that failed to start, --dry-run).
    fn drop(&mut self) {
        if let Some(rt) = self.waiter.take() {
            rt.shutdown_background();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn a_wait_ends_at_its_deadline_or_with_an_event_or_when_the_sources_are_gone() {
        let (tx, mut events) = event_queue(2).unwrap();
        let t = Instant::now();
        assert_eq!(
            events.recv_timeout(Duration::from_millis(30)).unwrap_err(),
            RecvTimeoutError::Timeout
        );
        assert!(t.elapsed() >= Duration::from_millis(30));
        let sender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            tx.blocking_send(SourceEvent::Synced).unwrap();
            // Full at two: the third waits until the loop has read one.
            tx.blocking_send(SourceEvent::Reconnected).unwrap();
            tx.blocking_send(SourceEvent::Reconnected).unwrap();
            tx.blocking_send(SourceEvent::Synced).unwrap();
        });
        let ev = events.recv_timeout(Duration::from_secs(10)).unwrap();
        assert!(matches!(ev, SourceEvent::Synced));
        let mut n = 0;
        while let Ok(ev) = events.recv_timeout(Duration::from_secs(10)) {
            n += 1;
            if matches!(ev, SourceEvent::Synced) {
                break;
            }
        }
        assert_eq!(n, 3);
        sender.join().unwrap();
        assert_eq!(
            events.recv_timeout(Duration::from_secs(10)).unwrap_err(),
            RecvTimeoutError::Disconnected
        );
    }
}
