//! The short soak: `scripts/soak.sh` as CI runs it (2,000 streamed requests through
//! `harrier serve --api-server-count 2`, 10% hang-ups mid-stream, 5% invalid requests), with
//! every check of the full run but the RSS bound, which needs the long run's steady state
//! (docs/soak.md).

mod common;

use std::process::Command;

use serde_json::Value;

#[test]
fn short_soak_loses_nothing_and_ends_idle() {
    let out = tempfile::tempdir().unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/soak.sh");
    let started = std::time::Instant::now();
    let status = Command::new("bash")
        .arg(script)
        .args(["--requests", "2000", "--concurrency", "64"])
        .args(["--rss-tolerance", "off", "--kv-cache-mib", "64"])
        .arg("--out")
        .arg(out.path())
        .args(["--bin", common::BIN])
        // Shorter requests than the full run's, to stay well inside a minute on 2 cores.
        .args(["--input-len", "32", "--output-len", "16"])
        .status()
        .expect("running scripts/soak.sh");
    eprintln!("short soak: {:?}", started.elapsed());
    let log = std::fs::read_to_string(out.path().join("soak.txt")).unwrap_or_default();
    assert!(status.success(), "soak.sh failed ({status}):\n{log}");

    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("soak.json")).unwrap())
            .unwrap();
    let load = &report["load"];
    let n = |k: &str| load[k].as_u64().unwrap_or_else(|| panic!("{k} in {load}"));
    assert_eq!(n("sent"), 2000);
    assert_eq!((n("failed"), n("hung")), (0, 0), "{}", load["errors"]);
    assert_eq!(n("completed") + n("disconnected") + n("rejected"), 2000);
    assert_eq!(n("rejected"), n("planned_bad"));
    // The mix is there: about 10% hang-ups and 5% invalid requests.
    assert!((140..=260).contains(&n("planned_disconnects")), "{load}");
    assert!((60..=140).contains(&n("planned_bad")), "{load}");
    assert!(
        n("disconnected") * 10 >= n("planned_disconnects") * 8,
        "{load}"
    );
    let end = &report["server_end"];
    assert_eq!(end["kv_blocks_used"], 0.0, "{end}");
    assert_eq!(end["frontend_requests_in_flight"], 0.0, "{end}");
    assert!(report["passed"].as_bool().unwrap());

    // One RSS row a second for the launcher, the engine and both front ends.
    let csv = std::fs::read_to_string(out.path().join("rss.csv")).unwrap();
    let mut lines = csv.lines();
    assert_eq!(
        lines.next().unwrap(),
        "t_s,phase,sent,done,launcher_rss_kb,engine_rss_kb,frontend-0_rss_kb,frontend-1_rss_kb"
    );
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    assert!(rows.len() >= 8, "{} rows", rows.len());
    assert!(rows
        .iter()
        .all(|r| r.len() == 8 && r[4..].iter().all(|kb| kb.parse::<u64>().unwrap() > 0)));
    let procs = report["processes"].as_array().unwrap();
    assert_eq!(procs.len(), 4, "{procs:?}");
}
