//! What an unclear outcome leaves behind: the parked event, when it is tried again
//! ([`Policy`], an operator's [`Schedule`]), what the driver does for it ([`UnclearStep`]) and
//! what a look-up proved ([`LookupOutcome`]). Why an unclear outcome parks one event and
//! holds only its aggregate, and how the core acts on it: `pipeline/unclear.rs`. A leaf of
//! the crate, so that the core's state can hold these without the module that acts on them.

use std::time::{Duration, SystemTime};

use outbox_core::OutboxEvent;
use uuid::Uuid;

use crate::contract::{AggKey, Command, Pending};

/// How long a send may go unanswered before it counts, with what waits behind it, as
/// waiting on an unclear outcome ([`crate::PipelineCore::waiting_on_unclear`]): far above a
/// healthy destination's answer (milliseconds, a second under load), far below the message
/// timeouts that park it (Kafka 30 s by default).
pub const UNANSWERED_AFTER: Duration = Duration::from_secs(5);

/// How unclear outcomes are retried, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// The wait before the first look-up or resend; it doubles per try.
    pub first: Duration,
    /// The longest wait between two tries.
    pub max: Duration,
    /// Before the first look-up of a possibly persisted attempt, counted from its report: the
    /// time in which its request may still reach the broker while the producer session lives
    /// (Kafka: zero makes a scan that found nothing prove little). Zero where the look-up is itself an idempotent resend.
    pub settle: Duration,
    /// Tries (sends and look-ups that ended unclear) before the relay says so loudly.
    pub budget: u32,
    /// An operator's retry schedule instead of the doubling from `first` to `max` (webhook
    /// senders' convention: immediately, 5 s, 5 min, 30 min, 2 h, ...): the wait after the
    /// n-th unclear outcome is its n-th step (the last one repeats), give or take a tenth.
    pub schedule: Option<Schedule>,
}

/// A retry schedule: up to [`Schedule::MAX_STEPS`] waits. `Copy`, as the policy is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Schedule {
    steps: [Duration; Schedule::MAX_STEPS],
    len: usize,
}

impl Schedule {
    pub const MAX_STEPS: usize = 16;

    /// A schedule of `steps` (1 to [`Self::MAX_STEPS`] waits); the error says which rule it
    /// breaks.
    pub fn new(steps: &[Duration]) -> Result<Schedule, String> {
        if steps.is_empty() || steps.len() > Self::MAX_STEPS {
            return Err(format!(
                "a retry schedule has 1 to {} steps; this one has {}",
                Self::MAX_STEPS,
                steps.len()
            ));
        }
        let mut s = Schedule {
            steps: [Duration::ZERO; Self::MAX_STEPS],
            len: steps.len(),
        };
        s.steps[..steps.len()].copy_from_slice(steps);
        Ok(s)
    }

    pub fn steps(&self) -> &[Duration] {
        &self.steps[..self.len]
    }

    /// The unclear outcomes a schedule allows before the relay says so loudly: one per step
    /// (the rule for `unclear_schedule_ms` without an `unclear_budget`, and for an endpoint's
    /// own schedule).
    pub fn budget(&self) -> u32 {
        self.len as u32
    }

    /// The wait after the `tries`-th unclear outcome of `event` (1 = the first): its step (the
    /// last repeats), moved by up to a tenth either way so that events that failed together
    /// are not all tried again at the same moment. The jitter is a hash of the event and the
    /// try, not a random draw: the core has no randomness of its own, and a replayed trace
    /// waits the same.
    pub fn wait(&self, tries: u32, event: Uuid) -> Duration {
        let i = (tries.max(1) as usize - 1).min(self.len - 1);
        let step = self.steps[i];
        let h = event
            .as_u128()
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(u128::from(tries))
            .rotate_left(29)
            .wrapping_mul(0xBF58_476D_1CE4_E5B9);
        // -10 % ..= +10 %, in hundredths of a percent; whole milliseconds, as every other
        // wait of the core (a driver that counts in milliseconds never wakes up a fraction
        // of one too early: the simulator did, for ever).
        let per_10k = (h % 2001) as u64;
        let ms = step.as_millis() as u64;
        Duration::from_millis(ms * (9_000 + per_10k) / 10_000)
    }
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            first: Duration::from_millis(200),
            max: Duration::from_secs(10),
            settle: Duration::ZERO,
            budget: 30,
            schedule: None,
        }
    }
}

impl Policy {
    /// A webhook endpoint's own policy: its schedule, a budget of its steps
    /// ([`Schedule::budget`]), and no settle time (an HTTP look-up is an idempotent resend).
    pub fn for_endpoint(schedule: Schedule) -> Policy {
        Policy {
            settle: Duration::ZERO,
            budget: schedule.budget(),
            schedule: Some(schedule),
            ..Policy::default()
        }
    }

    /// The wait after the `tries`-th unclear outcome of `event` (1 = the first): the
    /// operator's schedule, else doubling from `first` to `max`.
    pub fn backoff(&self, tries: u32, event: Uuid) -> Duration {
        if let Some(s) = &self.schedule {
            return s.wait(tries, event);
        }
        let doublings = tries.saturating_sub(1).min(20);
        self.first.saturating_mul(1 << doublings).min(self.max)
    }

    /// The wait that repeats once the waits stop growing: the schedule's last step, else
    /// `max`.
    pub fn repeat_wait(&self) -> Duration {
        match &self.schedule {
            Some(s) => s.steps().last().copied().unwrap_or_default(),
            None => self.max,
        }
    }
}

/// An event whose send ended unclear.
#[derive(Debug)]
pub(crate) struct Parked {
    pub(crate) p: Pending,
    pub(crate) key: AggKey,
    /// Look the attempt up (possibly persisted) rather than send it again (not stored).
    pub(crate) lookup: bool,
    pub(crate) due: SystemTime,
    /// A look-up is running: no other until its outcome is in.
    pub(crate) running: bool,
    pub(crate) error: String,
}

/// What the driver does for a parked event now.
#[derive(Debug, Clone)]
#[allow(clippy::large_enum_variant)]
pub enum UnclearStep {
    /// Look up the event's open DISPATCH_UNKNOWN attempt and hand what it proved to
    /// [`crate::PipelineCore::lookup_done`].
    Lookup { event: OutboxEvent },
    /// Execute this send (a message the broker certainly did not store).
    Send(Command),
}

/// What a look-up proved, as the driver recorded it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LookupOutcome {
    /// The broker holds a copy and its receipt is accepted in the ledger (found by the scan,
    /// or stored by the same-key re-publish / retry): the aggregate moves on.
    Recorded,
    /// Proven absent (the attempt is resolved in the ledger): send again with this attempt
    /// generation, to the same frozen destination.
    Retry { attempt_generation: i32 },
    /// Nothing proven: ask again later, not before `after` if the endpoint said so.
    Unresolved {
        error: String,
        after: Option<Duration>,
    },
}

impl From<crate::unknown::Resolved> for LookupOutcome {
    /// What a recorded look-up means for the parked event (the receipt, if any, is in the
    /// ledger already).
    fn from(r: crate::unknown::Resolved) -> Self {
        use crate::unknown::Resolved;
        match r {
            Resolved::Found { .. } | Resolved::StoredByProbe { .. } => LookupOutcome::Recorded,
            Resolved::Retry { attempt_generation } => LookupOutcome::Retry { attempt_generation },
            Resolved::StillUnknown => LookupOutcome::Unresolved {
                error: "the look-up proved nothing".into(),
                after: None,
            },
        }
    }
}

/// What the look-ups of one parked event's open attempts proved together, `prior` (its later
/// attempts') and `next` (the one just looked up): a copy found by any settles the event (no
/// resend); a retry goes above every attempt; nothing proven stops the round.
pub fn merge_lookups(prior: Option<LookupOutcome>, next: LookupOutcome) -> LookupOutcome {
    match (prior, next) {
        (_, u @ LookupOutcome::Unresolved { .. }) => u,
        (Some(LookupOutcome::Recorded), _) | (_, LookupOutcome::Recorded) => {
            LookupOutcome::Recorded
        }
        (
            Some(LookupOutcome::Retry {
                attempt_generation: a,
            }),
            LookupOutcome::Retry {
                attempt_generation: b,
            },
        ) => LookupOutcome::Retry {
            attempt_generation: a.max(b),
        },
        (_, retry) => retry,
    }
}
