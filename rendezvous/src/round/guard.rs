//! Who may speak for which node: the [`Guard`] the service checks before an event for a node
//! takes effect (the secret the caller presents, the one a new node is given, the bound on
//! waiting nodes), decided atomically with the event ([`apply_guarded`], [`apply_joining`]).

use super::event::{reject, Action, Decision, Event, Rejection};
use super::job::Job;
use super::machine::apply_in_place;
use super::settings::{JobSettings, Millis};

/// What the service checks before an event for a node takes effect, decided atomically with
/// the event (the same store update).
#[derive(Clone, Default)]
pub struct Guard {
    /// The secret the caller presents for the event's node.
    pub secret: Option<String>,
    /// For a join: the secret the node gets if the job holds no key for it (minted at the edge,
    /// since the machine draws no random numbers).
    pub minted: Option<String>,
    /// Most nodes that may wait to join (forming round and standbys); `None`:
    /// [`MAX_NODES`](crate::round::MAX_NODES).
    pub max_pending: Option<usize>,
}

/// Secrets are never printed (logs, panics).
impl std::fmt::Debug for Guard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let redacted = |s: &Option<String>| s.as_ref().map(|_| "<redacted>");
        f.debug_struct("Guard")
            .field("secret", &redacted(&self.secret))
            .field("minted", &redacted(&self.minted))
            .field("max_pending", &self.max_pending)
            .finish()
    }
}

/// Whether a caller presenting `secret` may speak for `node_id`: always when the job holds no
/// key for it (a new node; a node the job forgot), else only with the secret of that key.
pub fn authorize(job: &Job, node_id: &str, secret: Option<&str>) -> Result<(), Rejection> {
    match job.keys.get(node_id) {
        None => Ok(()),
        Some(key) if secret.is_some_and(|s| crate::identity::matches(key, s)) => Ok(()),
        Some(_) => Err(Rejection::Forbidden { node_id: node_id.to_owned() }),
    }
}

/// [`apply_in_place`] behind the service's checks: the caller must hold the node's secret, a
/// new node takes `guard.minted` as its key, and a join beyond the bound on waiting nodes is
/// refused. Every refusal leaves `job` untouched.
pub fn apply_guarded(job: &mut Job, ev: Event, guard: &Guard, now: Millis) -> Decision {
    let new_node = match ev.node_id() {
        Some(id) => {
            // A join whose minted secret the job already took is its own retry (an update
            // applied twice after an answer was lost).
            let own_retry = matches!(ev, Event::Join(_))
                && guard
                    .minted
                    .as_deref()
                    .zip(job.keys.get(id))
                    .is_some_and(|(m, key)| crate::identity::matches(key, m));
            if let Err(r) =
                authorize(job, id, guard.secret.as_deref()).or_else(|r| if own_retry { Ok(()) } else { Err(r) })
            {
                return reject(r);
            }
            (matches!(ev, Event::Join(_)) && !job.keys.contains_key(id)).then(|| id.to_owned())
        }
        None => None,
    };
    if let (Event::Join(n), Some(max)) = (&ev, guard.max_pending) {
        let id = n.node_id.as_str();
        if !job.is_pending(id) && !job.is_member(id) && job.pending.len() >= max && !job.phase.is_terminal() {
            return reject(Rejection::LimitReached {
                message: format!(
                    "job has {} nodes waiting to join: the service's bound on nodes per job \
                     (rlaunch-rendezvous --max-nodes {max})",
                    job.pending.len()
                ),
            });
        }
    }
    let d = apply_in_place(job, ev, now);
    if let (Some(id), Some(minted)) = (new_node, guard.minted.as_deref()) {
        if !matches!(d.action, Action::Rejected(_)) && (job.is_pending(&id) || job.is_member(&id)) {
            job.keys.insert(id, crate::identity::digest(minted));
        }
    }
    d
}

/// [`apply_guarded`] for a call that brings the node's settings (a join): the job first takes
/// what it adopts from them ([`JobSettings::adopt`]), so a node asking for `--fingerprint strict`
/// is itself held to it; a rejected event leaves the settings as they were.
pub fn apply_joining(job: &mut Job, settings: Option<&JobSettings>, ev: Event, guard: &Guard, now: Millis) -> Decision {
    let Some(settings) = settings else { return apply_guarded(job, ev, guard, now) };
    let before = job.settings.clone();
    job.settings.adopt(settings);
    let d = apply_guarded(job, ev, guard, now);
    if matches!(d.action, Action::Rejected(_)) {
        job.settings = before;
    }
    d
}

/// The secret `node_id` holds after a guarded join: the minted one if the job took it, else the
/// one the caller presented.
pub fn secret_after_join(job: &Job, node_id: &str, guard: &Guard) -> Option<String> {
    let key = job.keys.get(node_id)?;
    [guard.minted.as_ref(), guard.secret.as_ref()]
        .into_iter()
        .flatten()
        .find(|s| crate::identity::matches(key, s))
        .cloned()
}
