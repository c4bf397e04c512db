//! Silence that counts only while this process runs.
//!
//! Both ends of a link declare the other gone after a timeout of silence, checked every tick
//! (the front end an engine core, the engine core a front end). A process that did not run for
//! a while (a starved CPU, a paused VM or container) would count its own stall as the peer's
//! silence, while the peer's messages wait unread in the socket: CI's soak once lost 96 requests
//! to a live engine that way (two front ends' checks had run a second late; docs/frontend.md).
//! [`StallClock`] measures how late each check came; the caller moves its peers' last-seen times
//! forward by that ([`discounted`]). A peer that really went silent is still found after the
//! timeout: the checks keep their pace.

use std::time::Duration;

use tokio::time::Instant;

/// When the last periodic check ran, against its period.
#[derive(Debug, Clone)]
pub struct StallClock {
    tick: Duration,
    last_check: Instant,
}

impl StallClock {
    /// A clock for checks every `tick`, the first one due a tick after `now`.
    pub fn new(tick: Duration, now: Instant) -> Self {
        Self {
            tick,
            last_check: now,
        }
    }

    /// Records a check at `now`; returns the time since the last one beyond two ticks: this
    /// process did not run then (two ticks of slack for a timer that fires a little late).
    pub fn stalled(&mut self, now: Instant) -> Duration {
        let stalled = now
            .saturating_duration_since(self.last_check)
            .saturating_sub(2 * self.tick);
        self.last_check = now;
        stalled
    }
}

/// `last_seen` moved forward by a stall of this process, never past `now`.
pub fn discounted(last_seen: Instant, stalled: Duration, now: Instant) -> Instant {
    (last_seen + stalled).min(now)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_time_past_two_ticks_is_a_stall() {
        let ms = Duration::from_millis;
        let t0 = Instant::now();
        let mut c = StallClock::new(ms(100), t0);
        assert_eq!(c.stalled(t0 + ms(100)), Duration::ZERO);
        // A timer a tick late is within the slack; 50 ms more is a stall of 50 ms.
        assert_eq!(c.stalled(t0 + ms(300)), Duration::ZERO);
        assert_eq!(c.stalled(t0 + ms(550)), ms(50));
        // Two seconds between checks: 1.8 s of them this process did not run.
        assert_eq!(c.stalled(t0 + ms(2550)), ms(1800));
        // The same instant again is no stall.
        assert_eq!(c.stalled(t0 + ms(2550)), Duration::ZERO);
        assert_eq!(discounted(t0, ms(1800), t0 + ms(2550)), t0 + ms(1800));
        let late = t0 + ms(2000);
        assert_eq!(discounted(late, ms(1800), t0 + ms(2550)), t0 + ms(2550));
    }
}
