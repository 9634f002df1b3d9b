//! How long each phase of a long step took (a recovery of thousands of volumes or
//! containers), for the one log line that says where the time went. Imports nothing from the
//! crate.

use std::fmt;
use std::time::{Duration, Instant};

/// The phases of one step, each timed from the end of the one before.
#[derive(Debug)]
pub struct PhaseTimes {
    began: Instant,
    last: Instant,
    phases: Vec<(&'static str, Duration)>,
}

impl PhaseTimes {
    /// Starts timing the first phase now.
    pub fn start() -> Self {
        let now = Instant::now();
        PhaseTimes {
            began: now,
            last: now,
            phases: Vec::new(),
        }
    }

    /// Ends the phase `name` now; the next one starts.
    pub fn mark(&mut self, name: &'static str) {
        let now = Instant::now();
        self.phases.push((name, now - self.last));
        self.last = now;
    }
}

impl fmt::Display for PhaseTimes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&describe(&self.phases, self.last - self.began))
    }
}

/// `load 412 ms, republish 3 ms, total 415 ms` (pure): each phase in whole milliseconds.
pub fn describe(phases: &[(&str, Duration)], total: Duration) -> String {
    phases
        .iter()
        .map(|(name, took)| format!("{name} {} ms", took.as_millis()))
        .chain(std::iter::once(format!("total {} ms", total.as_millis())))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_phase_and_the_total_in_milliseconds() {
        let ms = Duration::from_millis;
        assert_eq!(describe(&[], ms(0)), "total 0 ms");
        assert_eq!(
            describe(
                &[
                    ("load", ms(412)),
                    ("republish", Duration::from_micros(2900))
                ],
                ms(415)
            ),
            "load 412 ms, republish 2 ms, total 415 ms"
        );
    }

    #[test]
    fn the_phases_follow_one_another() {
        let mut took = PhaseTimes::start();
        std::thread::sleep(Duration::from_millis(5));
        took.mark("first");
        took.mark("second");
        let (first, second) = (took.phases[0].1, took.phases[1].1);
        assert!(first >= Duration::from_millis(5), "{first:?}");
        assert_eq!(first + second, took.last - took.began, "{took:?}");
        assert!(took.to_string().starts_with("first "), "{took}");
    }
}
