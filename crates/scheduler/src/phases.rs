//! Wall-clock phase timestamps of one request, kept by whoever routes its events (the
//! scheduler daemon, the in-process engine). The scheduler core stays clock-free: it only says
//! which requests took their first slot in a `schedule()` call ([`crate::Scheduler::started`]).

use baton_proto::FirstTokenTimes;
use std::time::Instant;

/// When a request was admitted and first launched, and whether its first token came.
#[derive(Clone, Copy, Debug)]
pub struct PhaseClock {
    arrived: Instant,
    scheduled: Option<Instant>,
    had_token: bool,
}

impl PhaseClock {
    /// A request admitted at `now`.
    pub fn new(now: Instant) -> Self {
        Self {
            arrived: now,
            scheduled: None,
            had_token: false,
        }
    }

    /// The request's rows went into a launch at `now`; only the first call counts (a
    /// preempted request's relaunch does not restart its phases, as in vLLM).
    pub fn scheduled(&mut self, now: Instant) {
        self.scheduled.get_or_insert(now);
    }

    /// A token of the request arrived at `now`: its queue and prefill times if it is the
    /// first (and the request was launched, as every request with a token was).
    pub fn token(&mut self, now: Instant) -> Option<FirstTokenTimes> {
        if std::mem::replace(&mut self.had_token, true) {
            return None;
        }
        let s = self.scheduled?;
        Some(FirstTokenTimes {
            queue: s.saturating_duration_since(self.arrived).as_secs_f64(),
            prefill: now.saturating_duration_since(s).as_secs_f64(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_first_token_reports_queue_and_prefill_from_the_first_launch() {
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let mut c = PhaseClock::new(t0);
        c.scheduled(ms(10));
        c.scheduled(ms(50)); // a relaunch after preemption
        let t = c.token(ms(30)).expect("first token");
        assert!((t.queue - 0.010).abs() < 1e-9, "{t:?}");
        assert!((t.prefill - 0.020).abs() < 1e-9, "{t:?}");
        assert_eq!(c.token(ms(40)), None, "only the first token reports");
        // A token without a launch (cannot happen) reports nothing rather than a guess.
        assert_eq!(PhaseClock::new(t0).token(ms(1)), None);
    }
}
