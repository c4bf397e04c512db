//! Start-up progress (model download, weight loading, kernel compilation): a bar or spinner on
//! a terminal, log lines when stderr is not one (systemd, docker, CI), so long starts never
//! look hung and never fill a journal with redraws.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

/// How a quantity is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    Bytes,
    Items,
}

/// One task's progress. Without a terminal it logs at the start, at every 10% and at the end.
pub struct StartupProgress {
    what: String,
    unit: Unit,
    bar: Option<ProgressBar>,
    total: u64,
    done: u64,
    logged_decile: u64,
    start: Instant,
}

impl StartupProgress {
    /// A task of `total` units (0: unknown, shown as a spinner).
    pub fn new(what: impl Into<String>, total: u64, unit: Unit) -> Self {
        Self::with_terminal(what, total, unit, std::io::stderr().is_terminal())
    }

    /// As [`StartupProgress::new`], choosing bar or log lines explicitly.
    pub fn with_terminal(what: impl Into<String>, total: u64, unit: Unit, terminal: bool) -> Self {
        let what = what.into();
        let bar = terminal.then(|| {
            let (bar, template) = if total == 0 {
                (ProgressBar::new_spinner(), "{spinner} {msg} {elapsed}")
            } else if unit == Unit::Bytes {
                (
                    ProgressBar::new(total),
                    "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
                )
            } else {
                (
                    ProgressBar::new(total),
                    "{msg} [{bar:30}] {pos}/{len} {elapsed}",
                )
            };
            bar.set_style(
                ProgressStyle::with_template(template)
                    .expect("progress template")
                    .progress_chars("=> "),
            );
            bar.set_message(what.clone());
            if total == 0 {
                bar.enable_steady_tick(Duration::from_millis(120));
            }
            bar
        });
        if bar.is_none() {
            match (total, unit) {
                (0, _) => tracing::info!("{what}"),
                (t, Unit::Bytes) => tracing::info!(bytes = t, "{what}"),
                (t, Unit::Items) => tracing::info!(total = t, "{what}"),
            }
        }
        StartupProgress {
            what,
            unit,
            bar,
            total,
            done: 0,
            logged_decile: 0,
            start: Instant::now(),
        }
    }

    /// `n` more units done.
    pub fn inc(&mut self, n: u64) {
        self.done += n;
        match &self.bar {
            Some(bar) => bar.set_position(self.done),
            None if self.total > 0 => {
                let decile = (self.done * 10 / self.total).min(10);
                if decile > self.logged_decile && decile < 10 {
                    self.logged_decile = decile;
                    tracing::info!("{}: {}%", self.what, decile * 10);
                }
            }
            None => {}
        }
    }

    /// The task's size (0: unknown).
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Units done so far.
    pub fn done(&self) -> u64 {
        self.done
    }

    /// The task ended: the bar stays on screen; a log line gives the time.
    pub fn finish(self) {
        let secs = self.start.elapsed().as_secs_f64();
        match &self.bar {
            Some(bar) => bar.finish(),
            None => match self.unit {
                Unit::Bytes if self.total > 0 => {
                    tracing::info!(bytes = self.done, seconds = secs, "{}: done", self.what)
                }
                _ => tracing::info!(seconds = secs, "{}: done", self.what),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_without_a_terminal() {
        let mut p = StartupProgress::with_terminal("x", 200, Unit::Items, false);
        for _ in 0..20 {
            p.inc(10);
        }
        assert_eq!(p.done(), 200);
        assert_eq!(p.logged_decile, 9, "the 100% line is the finish line");
        p.finish();
        let mut s = StartupProgress::with_terminal("spin", 0, Unit::Items, false);
        s.inc(3);
        assert_eq!(s.done(), 3);
        s.finish();
    }
}
