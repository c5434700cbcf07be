//! The agent's signal handlers: every signal it stops on or relays arrives on one channel, in
//! order; which stop the job and which are relayed is the core's decision.

use tokio::signal::unix::{signal, SignalKind};

/// The agent's signal handlers: every signal it stops on or relays arrives here, in order.
pub struct Signals {
    rx: tokio::sync::mpsc::UnboundedReceiver<i32>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Signals {
    /// Handles the stop signals, SIGUSR1 and SIGUSR2 (relayed), and whatever else `handled`
    /// names (`--signals-to-handle`).
    pub(crate) fn install(handled: &[i32]) -> std::io::Result<Signals> {
        let mut all: Vec<i32> = crate::core::DEFAULT_HANDLED_SIGNALS.to_vec();
        all.extend([libc::SIGUSR1, libc::SIGUSR2]);
        all.extend_from_slice(handled);
        all.sort_unstable();
        all.dedup();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let mut tasks = Vec::new();
        for sig in all {
            let mut stream = signal(SignalKind::from_raw(sig))?;
            let tx = tx.clone();
            tasks.push(tokio::spawn(async move {
                while stream.recv().await.is_some() {
                    if tx.send(sig).is_err() {
                        break;
                    }
                }
            }));
        }
        Ok(Signals { rx, tasks })
    }

    /// The next signal; the core decides which stop the job and which are relayed.
    pub(crate) async fn next(&mut self) -> i32 {
        match self.rx.recv().await {
            Some(sig) => sig,
            // The tasks live as long as this; never reached, but waiting forever is right.
            None => std::future::pending().await,
        }
    }
}

impl Drop for Signals {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}
