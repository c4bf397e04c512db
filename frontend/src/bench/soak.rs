//! `harrier bench soak`: a long run of the benchmark's load against a `harrier serve`, with
//! the resident memory of every server process sampled, then checked (`scripts/soak.sh`
//! starts the server and runs this; results in `docs/soak.md`).
//!
//! ```text
//!   /proc scan: the launcher (--server-pid) and its children ─► launcher, engine, frontend-N
//!   sampler task, every --sample-interval:  VmRSS of each ─► --rss-csv (and memory)
//!   the load (bench::run)  ──────────────►  ends ─► settle: poll /metrics until idle
//!   checks:  no request lost or hung, every invalid one refused, KV blocks 0 and nothing
//!            running/waiting/in flight, every process alive, and (unless --rss-tolerance
//!            off) each process's mean RSS over the last quarter of the load within the
//!            tolerance of its mean over the second quarter (the first is warm-up: the
//!            engine touches its KV pages, allocators reach their working set)
//! ```
//!
//! A failed check makes the command exit non-zero.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use hyper::{Method, StatusCode};
use serde::Serialize;

use super::{BenchResult, BenchServeArgs, Progress};
use crate::http_client::{BaseUrl, Conn};

#[derive(Debug, Clone, clap::Args)]
pub struct SoakArgs {
    #[command(flatten)]
    pub load: BenchServeArgs,
    /// The `harrier serve` launcher: it and its children (engine core, front ends) are
    /// watched.
    #[arg(long)]
    pub server_pid: u32,
    /// Write the RSS samples here (CSV: seconds, requests sent and done, then each process's
    /// VmRSS in kB).
    #[arg(long)]
    pub rss_csv: PathBuf,
    #[arg(long, default_value_t = 1.0)]
    pub sample_interval: f64,
    /// Largest allowed RSS growth of any process from the second quarter of the load to the
    /// last, as a fraction; `off` only reports it (a short run has no steady state to judge).
    #[arg(long, default_value = "0.05")]
    pub rss_tolerance: Tolerance,
    /// Seconds to wait after the load for the server to become idle (KV blocks 0).
    #[arg(long, default_value_t = 15.0)]
    pub settle_timeout: f64,
}

/// `--rss-tolerance`: a fraction, or `off` (None).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tolerance(pub Option<f64>);

impl std::str::FromStr for Tolerance {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s == "off" {
            return Ok(Self(None));
        }
        match s.parse::<f64>() {
            Ok(x) if x.is_finite() && x >= 0.0 => Ok(Self(Some(x))),
            _ => Err("expected a fraction (e.g. 0.05) or `off`".into()),
        }
    }
}

/// One server process.
#[derive(Debug, Clone, Serialize)]
pub struct Watched {
    pub name: String,
    pub pid: u32,
}

/// One row of the CSV: seconds since the start, requests sent and done, each process's RSS
/// in kB (`None` once it is gone).
#[derive(Debug, Clone)]
struct Row {
    t: f64,
    sent: u64,
    done: u64,
    load: bool,
    rss_kb: Vec<Option<u64>>,
}

/// One process's memory over the load.
#[derive(Debug, Clone, Serialize)]
pub struct RssStats {
    pub name: String,
    pub pid: u32,
    pub first_kb: u64,
    /// Mean over the second quarter of the load (after warm-up) and over the last quarter.
    pub q2_mean_kb: f64,
    pub q4_mean_kb: f64,
    pub max_kb: u64,
    /// `q4 / q2 - 1`.
    pub growth: f64,
}

/// The server's state once the load is over.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ServerEnd {
    pub kv_blocks_used: f64,
    pub requests_running: f64,
    pub requests_waiting: f64,
    pub frontend_requests_in_flight: f64,
    pub aborts_sent: f64,
    /// Seconds from the end of the load until all of the above were 0 (None: not within
    /// --settle-timeout).
    pub idle_after_s: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Check {
    pub name: String,
    pub passed: bool,
    pub detail: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct SoakReport {
    pub load: BenchResult,
    pub processes: Vec<RssStats>,
    /// RSS (kB) of each process at every 10% of the load: (percent, seconds, requests done,
    /// RSS per process in the order of `processes`).
    pub curve: Vec<(u32, f64, u64, Vec<Option<u64>>)>,
    pub server_end: ServerEnd,
    pub checks: Vec<Check>,
    pub passed: bool,
}

pub fn run_soak(args: SoakArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let report = rt.block_on(soak(args.clone()))?;
    print_report(&report, args.rss_tolerance.0);
    if let Some(path) = &args.load.json {
        let text = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))?;
    }
    if !report.passed {
        let failed: Vec<&str> = report
            .checks
            .iter()
            .filter(|c| !c.passed)
            .map(|c| c.name.as_str())
            .collect();
        bail!("soak failed: {}", failed.join("; "));
    }
    Ok(())
}

pub async fn soak(args: SoakArgs) -> anyhow::Result<SoakReport> {
    let procs = discover(Path::new("/proc"), args.server_pid)?;
    let base = BaseUrl::parse(&args.load.base_url).await?;
    let key = args.load.api_key.clone();
    let progress = Arc::new(Progress::default());
    let rows = Arc::new(Mutex::new(Vec::<Row>::new()));
    let loading = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let start = Instant::now();
    let sampler = {
        let (procs, rows, progress, loading) = (
            procs.clone(),
            rows.clone(),
            progress.clone(),
            loading.clone(),
        );
        let mut csv = std::io::BufWriter::new(
            std::fs::File::create(&args.rss_csv)
                .with_context(|| format!("creating {}", args.rss_csv.display()))?,
        );
        let header: Vec<String> = procs.iter().map(|p| format!("{}_rss_kb", p.name)).collect();
        writeln!(csv, "t_s,phase,sent,done,{}", header.join(","))?;
        let interval = Duration::from_secs_f64(args.sample_interval.max(0.01));
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            loop {
                tick.tick().await;
                let row = Row {
                    t: start.elapsed().as_secs_f64(),
                    sent: progress.sent.load(Ordering::Relaxed),
                    done: progress.done.load(Ordering::Relaxed),
                    load: loading.load(Ordering::Relaxed),
                    rss_kb: procs.iter().map(|p| rss_kb(p.pid)).collect(),
                };
                let cells: Vec<String> = row
                    .rss_kb
                    .iter()
                    .map(|r| r.map(|v| v.to_string()).unwrap_or_default())
                    .collect();
                let phase = if row.load { "load" } else { "settle" };
                let line = format!(
                    "{:.1},{phase},{},{},{}",
                    row.t,
                    row.sent,
                    row.done,
                    cells.join(",")
                );
                if writeln!(csv, "{line}").and_then(|()| csv.flush()).is_err() {
                    tracing::warn!("could not write an RSS sample");
                }
                rows.lock().expect("rows").push(row);
            }
        })
    };
    let load = super::run(args.load.clone(), progress).await;
    loading.store(false, Ordering::Relaxed);
    let load_end = Instant::now();
    let server_end = match &load {
        Ok(_) => settle(&base, key.as_deref(), args.settle_timeout, load_end).await,
        Err(_) => ServerEnd::default(),
    };
    // One more sample after the settle, then stop.
    tokio::time::sleep(Duration::from_secs_f64(
        args.sample_interval.clamp(0.01, 1.0),
    ))
    .await;
    sampler.abort();
    let load = load?;
    let rows = std::mem::take(&mut *rows.lock().expect("rows"));
    Ok(judge(&args, load, &procs, &rows, server_end))
}

/// Polls /metrics until the server is idle or `timeout` passes; the last values seen.
async fn settle(base: &BaseUrl, key: Option<&str>, timeout: f64, since: Instant) -> ServerEnd {
    let deadline = since + Duration::from_secs_f64(timeout);
    let mut end = ServerEnd::default();
    loop {
        match scrape(base, key).await {
            Ok(m) => {
                let get = |n: &str| m.get(n).copied().unwrap_or(f64::NAN);
                end = ServerEnd {
                    kv_blocks_used: get("harrier_engine_kv_blocks_used"),
                    requests_running: get("harrier_engine_num_requests_running"),
                    requests_waiting: get("harrier_engine_num_requests_waiting"),
                    frontend_requests_in_flight: get("harrier_frontend_requests_in_flight"),
                    aborts_sent: get("harrier_aborts_sent_total"),
                    idle_after_s: None,
                };
                let idle = [
                    end.kv_blocks_used,
                    end.requests_running,
                    end.requests_waiting,
                    end.frontend_requests_in_flight,
                ]
                .iter()
                .all(|&v| v == 0.0);
                if idle {
                    end.idle_after_s = Some(since.elapsed().as_secs_f64());
                    return end;
                }
            }
            Err(e) => tracing::warn!("scraping /metrics: {e:#}"),
        }
        if Instant::now() >= deadline {
            return end;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn scrape(base: &BaseUrl, key: Option<&str>) -> anyhow::Result<HashMap<String, f64>> {
    let mut conn = Conn::connect(base, key).await?;
    let (status, body) = conn.call(Method::GET, "/metrics", None).await?;
    if status != StatusCode::OK {
        bail!("/metrics answered {status}");
    }
    Ok(parse_metrics(&String::from_utf8_lossy(&body)))
}

/// Prometheus text: each series' value, summed over its labels.
fn parse_metrics(text: &str) -> HashMap<String, f64> {
    let mut out = HashMap::new();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let value = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok());
        if let (Some(v), true) = (value, name_end > 0) {
            *out.entry(line[..name_end].to_owned()).or_insert(0.0) += v;
        }
    }
    out
}

/// The launcher and its children under `proc_root`, named by role.
fn discover(proc_root: &Path, server_pid: u32) -> anyhow::Result<Vec<Watched>> {
    let launcher_alive = proc_root.join(server_pid.to_string()).exists();
    anyhow::ensure!(launcher_alive, "no process {server_pid}");
    let mut found = vec![Watched {
        name: "launcher".into(),
        pid: server_pid,
    }];
    for entry in std::fs::read_dir(proc_root)? {
        let entry = entry?;
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue; // gone since the listing
        };
        if parse_ppid(&stat) != Some(server_pid) {
            continue;
        }
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let args: Vec<&str> = cmdline
            .split(|&b| b == 0)
            .filter_map(|a| std::str::from_utf8(a).ok())
            .collect();
        if let Some(name) = role(&args) {
            found.push(Watched { name, pid });
        }
    }
    found.sort_by(|a, b| rank(&a.name).cmp(&rank(&b.name)).then(a.name.cmp(&b.name)));
    let has = |prefix: &str| found.iter().any(|w| w.name.starts_with(prefix));
    if !has("engine") || !has("frontend") {
        bail!("process {server_pid} has no engine-core and front-end children: is it `harrier serve`? (found {found:?})");
    }
    Ok(found)
}

fn rank(name: &str) -> u8 {
    match name {
        "launcher" => 0,
        "engine" => 1,
        _ => 2,
    }
}

/// The parent pid from `/proc/<pid>/stat` (the command name may hold spaces and parens).
fn parse_ppid(stat: &str) -> Option<u32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// A child's role from its arguments: `engine`, or `frontend-<index>`.
fn role(args: &[&str]) -> Option<String> {
    match args.get(1).copied()? {
        "engine-core" => Some("engine".into()),
        "frontend" => {
            let index = args
                .iter()
                .position(|a| *a == "--frontend-index")
                .and_then(|i| args.get(i + 1))
                .unwrap_or(&"0");
            Some(format!("frontend-{index}"))
        }
        _ => None,
    }
}

fn rss_kb(pid: u32) -> Option<u64> {
    parse_vmrss(&std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?)
}

/// `VmRSS:    1234 kB` from `/proc/<pid>/status`.
fn parse_vmrss(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// The mean (NaN when empty).
fn mean(v: &[u64]) -> f64 {
    v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64
}

/// One process's statistics over its samples during the load.
fn rss_stats(w: &Watched, series: &[u64]) -> RssStats {
    let n = series.len();
    let q2 = mean(&series[n / 4..n / 2]);
    let q4 = mean(&series[n * 3 / 4..]);
    RssStats {
        name: w.name.clone(),
        pid: w.pid,
        first_kb: series.first().copied().unwrap_or(0),
        q2_mean_kb: q2,
        q4_mean_kb: q4,
        max_kb: series.iter().copied().max().unwrap_or(0),
        growth: q4 / q2 - 1.0,
    }
}

/// Samples a run needs before its quarters mean anything.
const MIN_SAMPLES: usize = 8;

fn judge(
    args: &SoakArgs,
    load: BenchResult,
    procs: &[Watched],
    rows: &[Row],
    server_end: ServerEnd,
) -> SoakReport {
    let mut checks = Vec::new();
    let mut check = |name: &str, passed: bool, detail: String| {
        checks.push(Check {
            name: name.into(),
            passed,
            detail,
        })
    };
    let accounted = load.completed + load.disconnected + load.rejected;
    check(
        "no request lost or hung",
        load.lost() == 0 && accounted == load.sent,
        format!(
            "{} sent: {} completed, {} hung up as planned, {} refused as planned, {} failed, {} hung",
            load.sent, load.completed, load.disconnected, load.rejected, load.failed, load.hung
        ),
    );
    check(
        "every invalid request refused with its 4xx",
        load.rejected == load.planned_bad,
        format!("{}/{}", load.rejected, load.planned_bad),
    );
    let e = &server_end;
    check(
        "server idle at the end (KV blocks 0)",
        e.idle_after_s.is_some(),
        format!(
            "KV blocks used {}, running {}, waiting {}, front-end requests in flight {}{}",
            e.kv_blocks_used,
            e.requests_running,
            e.requests_waiting,
            e.frontend_requests_in_flight,
            e.idle_after_s
                .map(|s| format!(" ({s:.1} s after the load)"))
                .unwrap_or_default()
        ),
    );
    let gone: Vec<&str> = procs
        .iter()
        .enumerate()
        .filter(|(i, _)| rows.last().is_none_or(|r| r.rss_kb[*i].is_none()))
        .map(|(_, w)| w.name.as_str())
        .collect();
    check(
        "every server process alive",
        gone.is_empty(),
        if gone.is_empty() {
            format!("{} processes", procs.len())
        } else {
            format!("gone: {}", gone.join(", "))
        },
    );
    let load_rows: Vec<&Row> = rows.iter().filter(|r| r.load).collect();
    let processes: Vec<RssStats> = procs
        .iter()
        .enumerate()
        .filter_map(|(i, w)| {
            let series: Vec<u64> = load_rows.iter().filter_map(|r| r.rss_kb[i]).collect();
            (series.len() >= MIN_SAMPLES).then(|| rss_stats(w, &series))
        })
        .collect();
    if let Some(tol) = args.rss_tolerance.0 {
        let worst = processes
            .iter()
            .max_by(|a, b| a.growth.total_cmp(&b.growth));
        let enough = processes.len() == procs.len();
        check(
            &format!(
                "RSS flat after warm-up (growth Q2 -> Q4 within {:.1}%)",
                tol * 100.0
            ),
            enough && processes.iter().all(|p| p.growth <= tol),
            match worst {
                Some(w) if enough => format!("largest: {} {:+.2}%", w.name, w.growth * 100.0),
                _ => format!(
                    "too few samples ({} during the load; {MIN_SAMPLES} needed)",
                    load_rows.len()
                ),
            },
        );
    }
    let curve = (0..=10)
        .filter(|_| !load_rows.is_empty())
        .map(|k| {
            let r = load_rows[(k * (load_rows.len() - 1) + 5) / 10];
            (k as u32 * 10, r.t, r.done, r.rss_kb.clone())
        })
        .collect();
    let passed = checks.iter().all(|c| c.passed);
    SoakReport {
        load,
        processes,
        curve,
        server_end,
        checks,
        passed,
    }
}

fn print_report(r: &SoakReport, tolerance: Option<f64>) {
    let l = &r.load;
    let mb = |kb: f64| kb / 1024.0;
    println!("{:=^72}", " Soak Result ");
    println!(
        "{} requests in {:.1} s ({:.1} req/s): {} completed, {}/{} hung up mid-stream, \
         {}/{} invalid refused, {} failed, {} hung",
        l.sent,
        l.duration_s,
        l.sent as f64 / l.duration_s,
        l.completed,
        l.disconnected,
        l.planned_disconnects,
        l.rejected,
        l.planned_bad,
        l.failed,
        l.hung
    );
    println!(
        "{:<12}{:>10}{:>12}{:>12}{:>10}{:>10}",
        "RSS (MB)", "first", "Q2 mean", "Q4 mean", "change", "max"
    );
    for p in &r.processes {
        println!(
            "{:<12}{:>10.1}{:>12.1}{:>12.1}{:>9.2}%{:>10.1}",
            p.name,
            mb(p.first_kb as f64),
            mb(p.q2_mean_kb),
            mb(p.q4_mean_kb),
            p.growth * 100.0,
            mb(p.max_kb as f64)
        );
    }
    if !r.curve.is_empty() {
        let names: Vec<String> = r
            .processes
            .iter()
            .map(|p| format!("{:>12}", p.name))
            .collect();
        println!("{:>4}{:>8}{:>8}{}", "%", "t (s)", "done", names.join(""));
        for (pct, t, done, rss) in &r.curve {
            let cells: Vec<String> = rss
                .iter()
                .map(|v| v.map_or("-".into(), |kb| format!("{:>12.1}", mb(kb as f64))))
                .collect();
            println!("{pct:>4}{t:>8.0}{done:>8}{}", cells.join(""));
        }
    }
    for c in &r.checks {
        let verdict = if c.passed { "PASS" } else { "FAIL" };
        println!("{verdict}  {}: {}", c.name, c.detail);
    }
    if tolerance.is_none() {
        println!("(RSS bound not checked: --rss-tolerance off)");
    }
    for e in l.errors.iter().take(10) {
        println!("error: {e}");
    }
    println!("{}", "=".repeat(72));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_lines_give_the_parent() {
        assert_eq!(parse_ppid("42 (harrier) S 7 42 42 0"), Some(7));
        assert_eq!(parse_ppid("42 (a b) c) (d) R 9 1 1"), Some(9));
        assert_eq!(parse_ppid("garbage"), None);
    }

    #[test]
    fn roles_come_from_the_arguments() {
        assert_eq!(
            role(&["harrier", "engine-core", "--model", "m"]).as_deref(),
            Some("engine")
        );
        assert_eq!(
            role(&[
                "/x/harrier",
                "frontend",
                "--ready-line",
                "--frontend-index",
                "1"
            ])
            .as_deref(),
            Some("frontend-1")
        );
        assert_eq!(role(&["harrier", "serve"]), None);
        assert_eq!(role(&["bash"]), None);
    }

    #[test]
    fn vmrss_is_read_in_kb() {
        let status = "Name:\tharrier\nVmPeak:\t  9 kB\nVmRSS:\t   23328 kB\nRssAnon: 1 kB\n";
        assert_eq!(parse_vmrss(status), Some(23328));
        assert_eq!(parse_vmrss("Name: x\n"), None);
    }

    #[test]
    fn metrics_are_summed_over_labels() {
        let text = "# HELP a x\n# TYPE a gauge\na 3\nb{x=\"1\"} 2\nb{x=\"2\"} 5\nab 1e3\n";
        let m = parse_metrics(text);
        assert_eq!(m["a"], 3.0);
        assert_eq!(m["b"], 7.0);
        assert_eq!(m["ab"], 1000.0);
    }

    #[test]
    fn growth_compares_the_second_and_last_quarters() {
        let w = Watched {
            name: "x".into(),
            pid: 1,
        };
        // Warm-up climbs, then flat: no growth.
        let flat: Vec<u64> = [10, 90, 100, 100, 100, 100, 100, 100].to_vec();
        let s = rss_stats(&w, &flat);
        assert_eq!((s.q2_mean_kb, s.q4_mean_kb, s.max_kb), (100.0, 100.0, 100));
        assert_eq!(s.growth, 0.0);
        // A steady climb after warm-up shows.
        let leak: Vec<u64> = (0..100).map(|i| 1000 + i * 10).collect();
        let s = rss_stats(&w, &leak);
        assert!(s.growth > 0.3, "{}", s.growth);
    }

    #[test]
    fn options_parse() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            soak: SoakArgs,
        }
        let parse = |extra: &[&str]| {
            let mut argv = vec!["soak", "--server-pid", "7", "--rss-csv", "x.csv"];
            argv.extend_from_slice(extra);
            <Cli as clap::Parser>::try_parse_from(argv).map(|c| c.soak)
        };
        let a = parse(&[]).unwrap();
        assert_eq!((a.server_pid, a.rss_tolerance), (7, Tolerance(Some(0.05))));
        let a = parse(&["--rss-tolerance", "off", "--disconnect-fraction", "0.1"]).unwrap();
        assert_eq!(a.rss_tolerance, Tolerance(None));
        assert_eq!(a.load.disconnect_fraction, 0.1);
        assert!(parse(&["--rss-tolerance", "-1"]).is_err());
    }

    #[test]
    fn discovery_names_the_children() {
        let dir = tempfile::tempdir().unwrap();
        let proc = |pid: u32, ppid: u32, args: &[&str]| {
            let d = dir.path().join(pid.to_string());
            std::fs::create_dir(&d).unwrap();
            std::fs::write(d.join("stat"), format!("{pid} (harrier) S {ppid} 1 1")).unwrap();
            std::fs::write(d.join("cmdline"), args.join("\0") + "\0").unwrap();
        };
        proc(10, 1, &["harrier", "serve"]);
        proc(12, 10, &["harrier", "frontend", "--frontend-index", "1"]);
        proc(11, 10, &["harrier", "engine-core"]);
        proc(13, 10, &["harrier", "frontend", "--frontend-index", "0"]);
        proc(14, 99, &["harrier", "frontend", "--frontend-index", "0"]);
        let names: Vec<(String, u32)> = discover(dir.path(), 10)
            .unwrap()
            .into_iter()
            .map(|w| (w.name, w.pid))
            .collect();
        let want = [
            ("launcher", 10),
            ("engine", 11),
            ("frontend-0", 13),
            ("frontend-1", 12),
        ];
        assert_eq!(names, want.map(|(n, p)| (n.to_owned(), p)));
        assert!(discover(dir.path(), 11).is_err(), "no children");
    }
}
