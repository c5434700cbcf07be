//! A signal reaching the agent: relayed to the workers, or the job stopped (forwarded first).

use super::{is_stop_signal, Action, AfterStop, Core, Millis, Outcome, Phase, RunOutcome};

impl Core {
    pub(super) fn on_signal(&mut self, signal: i32, now: Millis, out: &mut Vec<Action>) {
        let handled = self.handled.contains(&signal);
        if !handled && !is_stop_signal(signal) {
            if self.workers_alive {
                out.push(Action::Relay(signal));
            }
            return;
        }
        if handled && !matches!(self.phase, Phase::Stopping { .. }) {
            // The workers get the signal itself first (Ctrl-C reaches them as Ctrl-C), as
            // torchrun forwards it; an unhandled stop signal stops them with SIGTERM.
            self.stop_first = signal;
        }
        let then = match self.elastic() {
            Some(_) => AfterStop::Leave(signal),
            None => AfterStop::Exit(Outcome::Run(RunOutcome::Interrupted { signal })),
        };
        match &mut self.phase {
            Phase::Running { placement, succeeded: false } => {
                let round = placement.round;
                self.stop_workers(round, then, out);
            }
            Phase::Lingering { round, .. } | Phase::Parking { round, .. } => {
                let round = *round;
                self.stop_workers(round, then, out);
            }
            Phase::Stopping { then: pending, .. } => {
                // The stop under way ends the run now, whatever it was for.
                *pending = then;
            }
            Phase::Leaving { .. } | Phase::Done => {}
            Phase::Joining { .. } if self.parked.is_some() => {
                // Parked workers stop first: nothing of the job runs on while the node leaves.
                let round = self.parked.take().unwrap_or_default();
                self.stop_workers(round, then, out);
            }
            _ => {
                self.outbox = None;
                self.leave(signal, now, out);
            }
        }
    }
}
