//! Metric series in a plain form that front ends exchange through a shared directory, and the
//! merge that turns every front end's series into the server's.
//!
//! Each front end writes its request-level series to `<dir>/<identity>.json` (a temporary
//! file renamed into place, so a reader sees a whole snapshot or the previous one) every
//! [`SNAPSHOT_INTERVAL`] and when it stops. A scrape of any front end merges its own live
//! series with the other files: counters and histograms are summed over every snapshot,
//! including those of front ends that have exited (the server's totals never go down), gauges
//! only over snapshots younger than [`GAUGE_TTL`] (live front ends). This is Prometheus'
//! multiprocess mode, as vLLM runs it for its API servers.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use prometheus::proto::{self, MetricType};
use serde::{Deserialize, Serialize};

/// How often a front end publishes its series when they changed (a scrape sees the other
/// front ends this late at most). A publish is a gather and a few KiB written to a file.
pub const SNAPSHOT_INTERVAL: Duration = Duration::from_millis(100);
/// Gauges of a snapshot older than this are left out (its front end is gone or stuck).
pub const GAUGE_TTL: Duration = Duration::from_secs(3);
/// Snapshot files larger than this are skipped (ours are a few KiB).
const MAX_SNAPSHOT_BYTES: u64 = 4 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Histogram {
    /// (upper bound, cumulative count), ascending; the +Inf bucket is `count`.
    pub buckets: Vec<(f64, u64)>,
    pub sum: f64,
    pub count: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Value {
    Scalar(f64),
    Histogram(Histogram),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Series {
    pub labels: Vec<(String, String)>,
    pub value: Value,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Family {
    pub name: String,
    pub help: String,
    pub kind: Kind,
    pub series: Vec<Series>,
}

/// What one front end publishes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Snapshot {
    pub identity: String,
    pub families: Vec<Family>,
}

/// Families gathered from a registry (counter, gauge and histogram types; others dropped).
pub fn from_proto(families: &[proto::MetricFamily]) -> Vec<Family> {
    let mut out = Vec::new();
    for f in families {
        let kind = match f.get_field_type() {
            MetricType::COUNTER => Kind::Counter,
            MetricType::GAUGE => Kind::Gauge,
            MetricType::HISTOGRAM => Kind::Histogram,
            _ => continue,
        };
        let series = f
            .get_metric()
            .iter()
            .map(|m| Series {
                labels: m
                    .get_label()
                    .iter()
                    .map(|l| (l.name().to_string(), l.value().to_string()))
                    .collect(),
                value: match kind {
                    Kind::Counter => Value::Scalar(m.get_counter().get_value()),
                    Kind::Gauge => Value::Scalar(m.get_gauge().get_value()),
                    Kind::Histogram => {
                        let h = m.get_histogram();
                        Value::Histogram(Histogram {
                            buckets: h
                                .get_bucket()
                                .iter()
                                .map(|b| (b.upper_bound(), b.cumulative_count()))
                                .collect(),
                            sum: h.get_sample_sum(),
                            count: h.get_sample_count(),
                        })
                    }
                },
            })
            .collect();
        out.push(Family {
            name: f.name().to_string(),
            help: f.help().to_string(),
            kind,
            series,
        });
    }
    out
}

/// The families in the form the text encoder takes.
pub fn to_proto(families: &[Family]) -> Vec<proto::MetricFamily> {
    families
        .iter()
        .filter(|f| !f.series.is_empty())
        .map(|f| {
            let mut pf = proto::MetricFamily::default();
            pf.set_name(f.name.clone());
            pf.set_help(f.help.clone());
            pf.set_field_type(match f.kind {
                Kind::Counter => MetricType::COUNTER,
                Kind::Gauge => MetricType::GAUGE,
                Kind::Histogram => MetricType::HISTOGRAM,
            });
            let metrics = f
                .series
                .iter()
                .map(|s| {
                    let mut m = proto::Metric::default();
                    m.set_label(
                        s.labels
                            .iter()
                            .map(|(k, v)| {
                                let mut l = proto::LabelPair::default();
                                l.set_name(k.clone());
                                l.set_value(v.clone());
                                l
                            })
                            .collect(),
                    );
                    match (&s.value, f.kind) {
                        (Value::Scalar(v), Kind::Counter) => {
                            let mut c = proto::Counter::default();
                            c.set_value(*v);
                            m.set_counter(c);
                        }
                        (Value::Scalar(v), _) => {
                            let mut g = proto::Gauge::default();
                            g.set_value(*v);
                            m.set_gauge(g);
                        }
                        (Value::Histogram(h), _) => {
                            let mut ph = proto::Histogram::default();
                            ph.set_sample_count(h.count);
                            ph.set_sample_sum(h.sum);
                            ph.set_bucket(
                                h.buckets
                                    .iter()
                                    .map(|&(ub, c)| {
                                        let mut b = proto::Bucket::default();
                                        b.set_upper_bound(ub);
                                        b.set_cumulative_count(c);
                                        b
                                    })
                                    .collect(),
                            );
                            m.set_histogram(ph);
                        }
                    }
                    m
                })
                .collect();
            pf.set_metric(metrics);
            pf
        })
        .collect()
}

/// Adds `other`'s series into `into` (by family name and label set): counters and histograms
/// always, gauges when `gauges`. A family or series `into` lacks is appended; a family whose
/// kind differs, or a histogram whose buckets differ, is skipped (another binary's snapshot).
pub fn merge(into: &mut Vec<Family>, other: &[Family], gauges: bool) {
    for of in other {
        if of.kind == Kind::Gauge && !gauges {
            continue;
        }
        let f = match into.iter_mut().find(|f| f.name == of.name) {
            Some(f) if f.kind == of.kind => f,
            Some(_) => continue,
            None => {
                into.push(of.clone());
                continue;
            }
        };
        for os in &of.series {
            match f.series.iter_mut().find(|s| s.labels == os.labels) {
                None => f.series.push(os.clone()),
                Some(s) => match (&mut s.value, &os.value) {
                    (Value::Scalar(a), Value::Scalar(b)) => *a += b,
                    (Value::Histogram(a), Value::Histogram(b))
                        if a.buckets.len() == b.buckets.len()
                            && a.buckets.iter().zip(&b.buckets).all(|(x, y)| x.0 == y.0) =>
                    {
                        for (x, y) in a.buckets.iter_mut().zip(&b.buckets) {
                            x.1 += y.1;
                        }
                        a.sum += b.sum;
                        a.count += b.count;
                    }
                    _ => {}
                },
            }
        }
    }
}

/// The shared directory as one front end sees it.
#[derive(Debug)]
pub struct SharedDir {
    dir: PathBuf,
    identity: String,
    /// The last snapshot written, to skip writing an unchanged one (idle servers write
    /// nothing; gauges of an idle front end stay fresh through [`GAUGE_TTL`] refreshes).
    last: std::sync::Mutex<(Vec<u8>, std::time::Instant)>,
}

impl SharedDir {
    /// `identity` must be unique per process start (its file name in `dir`).
    pub fn new(dir: &Path, identity: String) -> std::io::Result<SharedDir> {
        std::fs::create_dir_all(dir)?;
        Ok(SharedDir {
            dir: dir.to_path_buf(),
            identity,
            last: std::sync::Mutex::new((Vec::new(), std::time::Instant::now())),
        })
    }

    fn own_file(&self) -> PathBuf {
        self.dir.join(format!("{}.json", self.identity))
    }

    /// Publishes this front end's series (atomically: a temporary file renamed into place).
    /// The directory is made again if it went away (systemd removes the engine's
    /// RuntimeDirectory when the engine stops; the front ends outlive it).
    pub fn publish(&self, families: Vec<Family>) -> std::io::Result<()> {
        let snap = Snapshot {
            identity: self.identity.clone(),
            families,
        };
        let bytes = serde_json::to_vec(&snap)?;
        let mut last = self.last.lock().expect("snapshot lock");
        // Unchanged, recently written and still there: nothing to do (rewritten every
        // GAUGE_TTL / 3 all the same, so that an idle front end's gauges stay counted).
        if last.0 == bytes && last.1.elapsed() < GAUGE_TTL / 3 && self.own_file().exists() {
            return Ok(());
        }
        let tmp = self.dir.join(format!(".{}.tmp", self.identity));
        if let Err(e) = std::fs::write(&tmp, &bytes) {
            if e.kind() != std::io::ErrorKind::NotFound {
                return Err(e);
            }
            std::fs::create_dir_all(&self.dir)?;
            std::fs::write(&tmp, &bytes)?;
        }
        std::fs::rename(&tmp, self.own_file())?;
        *last = (bytes, std::time::Instant::now());
        Ok(())
    }

    /// Merges every other front end's latest snapshot into `own` (this front end's live
    /// series). Unreadable or malformed files are logged and skipped.
    pub fn merge_others(&self, own: &mut Vec<Family>) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        let own_file = self.own_file();
        let now = SystemTime::now();
        for e in entries.flatten() {
            let path = e.path();
            if path == own_file || path.extension().and_then(|x| x.to_str()) != Some("json") {
                continue;
            }
            let Ok(meta) = e.metadata() else { continue };
            if meta.len() > MAX_SNAPSHOT_BYTES {
                tracing::warn!(path = %path.display(), "metrics snapshot too large; skipped");
                continue;
            }
            let fresh = meta
                .modified()
                .ok()
                .and_then(|m| now.duration_since(m).ok())
                .is_some_and(|age| age <= GAUGE_TTL);
            match std::fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice::<Snapshot>(&b).map_err(|e| e.to_string()))
            {
                Ok(snap) => merge(own, &snap.families, fresh),
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "unreadable metrics snapshot; skipped")
                }
            }
        }
    }
}

/// The value of one series (a histogram's sample count), by family name and exact label set.
pub fn scalar(families: &[Family], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let want: HashMap<&str, &str> = labels.iter().copied().collect();
    families
        .iter()
        .find(|f| f.name == name)?
        .series
        .iter()
        .find(|s| {
            s.labels.len() == want.len()
                && s.labels
                    .iter()
                    .all(|(k, v)| want.get(k.as_str()) == Some(&v.as_str()))
        })
        .map(|s| match s.value {
            Value::Scalar(v) => v,
            Value::Histogram(ref h) => h.count as f64,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fam(name: &str, kind: Kind, series: Vec<Series>) -> Family {
        Family {
            name: name.into(),
            help: "h".into(),
            kind,
            series,
        }
    }

    fn scalar_series(labels: &[(&str, &str)], v: f64) -> Series {
        Series {
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            value: Value::Scalar(v),
        }
    }

    fn hist(counts: &[u64], sum: f64) -> Series {
        Series {
            labels: vec![],
            value: Value::Histogram(Histogram {
                buckets: [0.1, 1.0]
                    .iter()
                    .copied()
                    .zip(counts.iter().copied())
                    .collect(),
                sum,
                count: *counts.last().unwrap(),
            }),
        }
    }

    #[test]
    fn merge_sums_counters_and_histograms_and_gauges_only_when_live() {
        let mut a = vec![
            fam(
                "c",
                Kind::Counter,
                vec![scalar_series(&[("r", "stop")], 2.0)],
            ),
            fam("g", Kind::Gauge, vec![scalar_series(&[], 1.0)]),
            fam("h", Kind::Histogram, vec![hist(&[1, 2], 0.5)]),
        ];
        let b = vec![
            fam(
                "c",
                Kind::Counter,
                vec![
                    scalar_series(&[("r", "stop")], 3.0),
                    scalar_series(&[("r", "length")], 1.0),
                ],
            ),
            fam("g", Kind::Gauge, vec![scalar_series(&[], 5.0)]),
            fam("h", Kind::Histogram, vec![hist(&[0, 4], 2.0)]),
            fam("new", Kind::Counter, vec![scalar_series(&[], 7.0)]),
        ];
        merge(&mut a, &b, false);
        assert_eq!(scalar(&a, "c", &[("r", "stop")]), Some(5.0));
        assert_eq!(scalar(&a, "c", &[("r", "length")]), Some(1.0));
        assert_eq!(scalar(&a, "g", &[]), Some(1.0), "a stale gauge is left out");
        assert_eq!(scalar(&a, "new", &[]), Some(7.0));
        let Value::Histogram(h) = &a[2].series[0].value else {
            panic!()
        };
        assert_eq!(
            (h.buckets.clone(), h.sum, h.count),
            (vec![(0.1, 1), (1.0, 6)], 2.5, 6)
        );
        merge(&mut a, &b, true);
        assert_eq!(scalar(&a, "g", &[]), Some(6.0), "a live gauge is summed");
    }

    #[test]
    fn merge_skips_mismatched_kinds_and_buckets() {
        let mut a = vec![
            fam("c", Kind::Counter, vec![scalar_series(&[], 1.0)]),
            fam("h", Kind::Histogram, vec![hist(&[1, 1], 0.1)]),
        ];
        let mut other_buckets = hist(&[5, 5], 1.0);
        if let Value::Histogram(h) = &mut other_buckets.value {
            h.buckets[0].0 = 0.2;
        }
        let b = vec![
            fam("c", Kind::Gauge, vec![scalar_series(&[], 9.0)]),
            fam("h", Kind::Histogram, vec![other_buckets]),
        ];
        merge(&mut a, &b, true);
        assert_eq!(scalar(&a, "c", &[]), Some(1.0));
        assert_eq!(scalar(&a, "h", &[]), Some(1.0));
    }

    #[test]
    fn proto_round_trip() {
        let r = prometheus::Registry::new();
        let c = prometheus::IntCounterVec::new(prometheus::Opts::new("c_total", "help"), &["x"])
            .unwrap();
        let h = prometheus::Histogram::with_opts(
            prometheus::HistogramOpts::new("h_seconds", "help").buckets(vec![0.5, 1.0]),
        )
        .unwrap();
        r.register(Box::new(c.clone())).unwrap();
        r.register(Box::new(h.clone())).unwrap();
        c.with_label_values(&["a"]).inc_by(3);
        h.observe(0.7);
        let fams = from_proto(&r.gather());
        assert_eq!(from_proto(&to_proto(&fams)), fams);
        assert_eq!(scalar(&fams, "c_total", &[("x", "a")]), Some(3.0));
        assert_eq!(scalar(&fams, "h_seconds", &[]), Some(1.0));
    }

    #[test]
    fn shared_dir_merges_other_front_ends_and_skips_bad_files() {
        let dir = tempfile::tempdir().unwrap();
        let a = SharedDir::new(dir.path(), "frontend-0-1".into()).unwrap();
        let b = SharedDir::new(dir.path(), "frontend-1-2".into()).unwrap();
        let series = |v| vec![fam("c", Kind::Counter, vec![scalar_series(&[], v)])];
        a.publish(series(1.0)).unwrap();
        b.publish(series(10.0)).unwrap();
        // The directory can go away under a running front end: the next publish makes it again.
        std::fs::remove_dir_all(dir.path()).unwrap();
        a.publish(series(1.0)).unwrap();
        b.publish(series(10.0)).unwrap();
        std::fs::write(dir.path().join("garbage.json"), b"{not json").unwrap();
        // A's scrape: its live value (2: it moved on since its snapshot) plus B's snapshot.
        let mut own = series(2.0);
        a.merge_others(&mut own);
        assert_eq!(scalar(&own, "c", &[]), Some(12.0));
        let mut own = series(10.0);
        b.merge_others(&mut own);
        assert_eq!(scalar(&own, "c", &[]), Some(11.0));
    }
}
