//! Bounded fuzzing support for the harnesses of every crate (tests only: feature `fuzz`, or
//! this crate's own `cfg(test)`).
//!
//! The harnesses are proptest properties that `cargo test` runs with a fixed case count and a
//! fixed seed, so CI spends a known, small time on them and fails the same way on every run.
//! Locally they run longer: `HARRIER_FUZZ_CASES=N` runs N cases per property from a random seed
//! (proptest prints the failing input and persists it under `proptest-regressions/`), and
//! `PROPTEST_RNG_SEED=S` pins a seed. docs/fuzzing.md lists the harnesses.
//!
//! Three guards turn "never a panic, a hang or a huge allocation" into checks:
//! - a panic fails the property (proptest catches it and shrinks the input);
//! - [`watch`] arms a watchdog for one case: a case running past its limit prints its input
//!   and aborts the test binary, so a hang is a failure with the input named, not a stuck job;
//! - [`TrackingAlloc`] (a test binary's `#[global_allocator]`) records the largest single
//!   allocation made on this thread inside [`largest_allocation`], so a length prefix that
//!   claims 4 GB shows up as a 4 GB request even where the OS would have granted it lazily.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::HashMap;
use std::fmt::{self, Write as _};
use std::sync::{Mutex, OnceLock};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use proptest::test_runner::{Config, RngSeed};

/// Cases per property; overrides every harness's default (and switches to a random seed).
pub const CASES_ENV: &str = "HARRIER_FUZZ_CASES";

/// The seed CI runs with (unless `PROPTEST_RNG_SEED` is set).
const CI_SEED: u64 = 0x4841_5252_4945_5221;

/// The number of cases a property runs: `HARRIER_FUZZ_CASES`, else `default`.
pub fn cases(default: u32) -> u32 {
    std::env::var(CASES_ENV)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(default)
}

/// The proptest configuration of a harness: `default` cases from the fixed CI seed, or
/// `HARRIER_FUZZ_CASES` cases from a random seed; `PROPTEST_RNG_SEED` wins over both seeds.
/// Shrinking is capped so a failure is reported in seconds.
pub fn config(default: u32) -> Config {
    let base = Config::default();
    let long_run = std::env::var_os(CASES_ENV).is_some();
    let seed_given = std::env::var_os("PROPTEST_RNG_SEED").is_some();
    Config {
        cases: cases(default),
        rng_seed: if seed_given || long_run {
            base.rng_seed
        } else {
            RngSeed::Fixed(CI_SEED)
        },
        max_shrink_iters: 2_000,
        max_shrink_time: 30_000,
        ..base
    }
}

/// How long one case of a harness may run before the watchdog calls it a hang. Generous:
/// debug builds on a loaded two-core runner are slow, and a real hang never finishes.
pub const CASE_LIMIT: Duration = Duration::from_secs(30);

/// Cases in flight, by thread: (harness name, start, the input as debug text).
type Running = HashMap<ThreadId, (&'static str, Instant, String)>;

fn running() -> &'static Mutex<Running> {
    static RUNNING: OnceLock<Mutex<Running>> = OnceLock::new();
    static WATCHDOG: OnceLock<()> = OnceLock::new();
    WATCHDOG.get_or_init(|| {
        std::thread::Builder::new()
            .name("fuzz-watchdog".into())
            .spawn(|| loop {
                std::thread::sleep(Duration::from_millis(250));
                let Some(map) = RUNNING.get() else { continue };
                let map = map.lock().unwrap_or_else(|e| e.into_inner());
                for (name, start, input) in map.values() {
                    if start.elapsed() > CASE_LIMIT {
                        eprintln!(
                            "fuzz harness {name}: a case ran over {CASE_LIMIT:?} (a hang?); input: {input}"
                        );
                        std::process::abort();
                    }
                }
            })
            .expect("spawning the fuzz watchdog");
    });
    RUNNING.get_or_init(Default::default)
}

/// Disarms the watchdog for this thread's case when dropped.
pub struct CaseGuard(());

impl Drop for CaseGuard {
    fn drop(&mut self) {
        let mut map = running().lock().unwrap_or_else(|e| e.into_inner());
        map.remove(&std::thread::current().id());
    }
}

/// Arms the watchdog for the case now running on this thread; `input` is what it prints
/// (its first 4 KiB of debug text) if the case runs past [`CASE_LIMIT`].
pub fn watch(name: &'static str, input: &dyn fmt::Debug) -> CaseGuard {
    let text = debug_prefix(input, 4096);
    let mut map = running().lock().unwrap_or_else(|e| e.into_inner());
    map.insert(std::thread::current().id(), (name, Instant::now(), text));
    CaseGuard(())
}

/// The first `limit` bytes of `{value:?}`, without formatting the rest (inputs can be large).
pub fn debug_prefix(value: &dyn fmt::Debug, limit: usize) -> String {
    struct Capped {
        out: String,
        limit: usize,
    }
    impl fmt::Write for Capped {
        fn write_str(&mut self, s: &str) -> fmt::Result {
            let room = self.limit.saturating_sub(self.out.len());
            if s.len() <= room {
                self.out.push_str(s);
                return Ok(());
            }
            let mut cut = room;
            while !s.is_char_boundary(cut) {
                cut -= 1;
            }
            self.out.push_str(&s[..cut]);
            self.out.push_str(" …");
            Err(fmt::Error)
        }
    }
    let mut w = Capped {
        out: String::new(),
        limit,
    };
    let _ = write!(w, "{value:?}");
    w.out
}

thread_local! {
    /// Whether this thread is inside [`largest_allocation`], and the largest size seen.
    static TRACKING: Cell<bool> = const { Cell::new(false) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

/// The system allocator, recording allocation sizes for [`largest_allocation`]. Install it in
/// a test binary with `#[global_allocator] static A: TrackingAlloc = TrackingAlloc;`.
pub struct TrackingAlloc;

impl TrackingAlloc {
    #[inline]
    fn record(size: usize) {
        // `try_with`: never panic inside the allocator (e.g. during thread teardown).
        if TRACKING.try_with(Cell::get).unwrap_or(false) {
            let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
        }
    }
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged; the only
// addition reads and writes this thread's `Cell`s, which neither allocate nor unwind.
unsafe impl GlobalAlloc for TrackingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        Self::record(layout.size());
        // SAFETY: forwarded as is; the caller upholds `alloc`'s contract.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        Self::record(layout.size());
        // SAFETY: forwarded as is; the caller upholds `alloc_zeroed`'s contract.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        Self::record(new_size);
        // SAFETY: forwarded as is; `ptr` came from this allocator, i.e. from `System`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded as is; `ptr` came from this allocator, i.e. from `System`.
        unsafe { System.dealloc(ptr, layout) }
    }
}

/// Runs `f` and returns its result with the largest single allocation (bytes) it made on this
/// thread. Reads 0 unless the test binary installed [`TrackingAlloc`].
pub fn largest_allocation<R>(f: impl FnOnce() -> R) -> (R, usize) {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            TRACKING.with(|t| t.set(self.0));
        }
    }
    let outer = TRACKING.with(|t| t.replace(true));
    let before = LARGEST.with(|l| l.replace(0));
    let reset = Reset(outer);
    let out = f();
    drop(reset);
    let largest = LARGEST.with(|l| l.replace(before.max(l.get())));
    (out, largest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_prefix_stops_at_the_limit_on_a_char_boundary() {
        let s = "é".repeat(10_000);
        let p = debug_prefix(&s, 101);
        assert!(p.len() <= 101 + " …".len(), "{}", p.len());
        assert!(p.starts_with("\"éé"));
        assert_eq!(debug_prefix(&5, 100), "5");
    }

    #[test]
    fn largest_allocation_sees_a_big_vector() {
        let (v, largest) = largest_allocation(|| vec![0u8; 1 << 20]);
        assert_eq!(v.len(), 1 << 20);
        assert!(largest >= 1 << 20, "{largest}");
        let ((), small) = largest_allocation(|| drop(std::hint::black_box(vec![0u8; 16])));
        assert!(small < 1 << 20, "{small}");
    }

    #[test]
    fn config_defaults_to_a_fixed_seed() {
        if std::env::var_os(CASES_ENV).is_none() && std::env::var_os("PROPTEST_RNG_SEED").is_none()
        {
            let c = config(7);
            assert_eq!(c.cases, 7);
            assert_eq!(c.rng_seed, RngSeed::Fixed(CI_SEED));
        }
    }
}
