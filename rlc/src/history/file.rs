//! History from a file: a saved `query_range` JSON response, or CSV with the header
//! `ts,service,caller,procedure,rps` (`ts` in unix seconds or RFC 3339; an empty caller or
//! procedure means none; a missing row is a missing sample).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use chrono::{DateTime, Utc};
use schema::{HistoryConfig, LabelNames};

use super::error::CsvError;
use super::prometheus::{feed, Response};
use super::{grid, Builder, History, HistoryError, ParseError};

/// Loads `path`, on a grid ending at `end` or at the file's last sample if that is earlier.
pub fn load(path: &Path, cfg: &HistoryConfig, end: DateTime<Utc>) -> Result<History, HistoryError> {
    let text = std::fs::read_to_string(path).map_err(|e| HistoryError::Io {
        path: path.to_path_buf(),
        source: e,
    })?;
    let perr = |source: ParseError| HistoryError::Parse {
        what: path.display().to_string(),
        source,
    };
    let is_csv = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("csv"));
    let end = end.timestamp();
    if is_csv {
        let csv = parse_csv(&text).map_err(|e| perr(e.into()))?;
        let last = csv.last.unwrap_or(end);
        let step = cfg.step.as_secs() as i64;
        let (start, step, len) = grid(cfg, end.min(last + step));
        // CSV columns have fixed names; the configured label names are for Prometheus.
        let mut b = Builder::new(start, step, len, LabelNames::default());
        // One key per label set, then that series' samples in the file's order: what keying
        // and adding every row on its own gives, without the per-row work.
        for (metric, samples) in csv.series {
            if let Some(k) = b.key(&metric) {
                b.add_many(&k, samples.into_iter().map(|(ts, v)| (ts as f64, v)));
            }
        }
        Ok(b.finish())
    } else {
        let r: Response<'_> = serde_json::from_str(&text).map_err(|e| perr(e.into()))?;
        if r.status != "success" {
            return Err(perr(ParseError::Status {
                status: r.status,
                error: r.error.unwrap_or_default(),
            }));
        }
        let data = r.data.ok_or_else(|| perr(ParseError::NoData))?;
        let last = data
            .result
            .iter()
            .flat_map(|m| m.values.iter().map(|v| v.0 as i64))
            .max()
            .unwrap_or(end);
        let step = cfg.step.as_secs() as i64;
        let (start, step, len) = grid(cfg, end.min(last + step));
        let labels = cfg
            .prometheus
            .as_ref()
            .map(|p| p.labels.clone())
            .unwrap_or_default();
        let mut b = Builder::new(start, step, len, labels);
        feed(&mut b, &data).map_err(perr)?;
        Ok(b.finish())
    }
}

/// A series' labels by name.
type Labels = BTreeMap<String, String>;

/// The rows of a CSV file by label set, each set once (rows repeat it per sample).
struct Csv {
    /// Every label set with its samples `(ts, rps)`, in the order the sets first appear.
    series: Vec<(Labels, Vec<(i64, f64)>)>,
    /// The latest timestamp, if any row.
    last: Option<i64>,
}

fn parse_csv(text: &str) -> Result<Csv, CsvError> {
    let mut csv = Csv {
        series: Vec::new(),
        last: None,
    };
    let mut index: HashMap<[&str; 3], usize> = HashMap::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || (n == 0 && line.starts_with("ts,")) {
            continue;
        }
        let mut f = [""; 5];
        let mut count = 0;
        for field in line.split(',').map(str::trim) {
            if let Some(slot) = f.get_mut(count) {
                *slot = field;
            }
            count += 1;
        }
        if count != 5 {
            return Err(CsvError::Fields { line: n + 1 });
        }
        let ts = f[0]
            .parse::<i64>()
            .ok()
            .or_else(|| {
                DateTime::parse_from_rfc3339(f[0])
                    .ok()
                    .map(|d| d.timestamp())
            })
            .ok_or_else(|| CsvError::Timestamp {
                line: n + 1,
                text: f[0].to_string(),
            })?;
        let v = f[4].parse::<f64>().map_err(|source| CsvError::Rps {
            line: n + 1,
            text: f[4].to_string(),
            source,
        })?;
        let i = *index.entry([f[1], f[2], f[3]]).or_insert_with(|| {
            let mut m = BTreeMap::new();
            for (k, val) in [("service", f[1]), ("caller", f[2]), ("procedure", f[3])] {
                if !val.is_empty() {
                    m.insert(k.to_string(), val.to_string());
                }
            }
            csv.series.push((m, Vec::new()));
            csv.series.len() - 1
        });
        csv.series[i].1.push((ts, v));
        csv.last = csv.last.max(Some(ts));
    }
    Ok(csv)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> HistoryConfig {
        serde_yaml::from_str("file: x.csv\nlookback: 1h\nstep: 1m").unwrap()
    }

    #[test]
    fn csv_missing_rows_stay_missing_and_bad_series_are_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("h.csv");
        let t0 = 1_700_000_000 / 60 * 60;
        let mut s = String::from("ts,service,caller,procedure,rps\n");
        for i in 0..60 {
            if i != 10 {
                s += &format!("{},maps,web,route,{}\n", t0 + i * 60, i);
            }
            s += &format!(
                "{},maps,bad,route,{}\n",
                t0 + i * 60,
                if i == 5 {
                    "NaN".to_string()
                } else {
                    "1".into()
                }
            );
        }
        s += &format!("{t0},maps,,,3\n");
        std::fs::write(&p, s).unwrap();
        let h = load(&p, &cfg(), Utc::now()).unwrap();
        assert_eq!(h.len, 60);
        assert_eq!(h.end(), t0 + 60 * 60);
        let web = h.series.values().next().unwrap();
        assert_eq!(h.series.len(), 1, "{:?}", h.series.keys());
        assert_eq!(web.present(), 59);
        assert!(web.values[10].is_nan());
        assert_eq!(web.values[59], 59.0);
        assert_eq!(h.rejected.len(), 2, "{:?}", h.rejected);
        assert!(h
            .rejected
            .iter()
            .any(|r| r.caller.as_deref() == Some("bad") && r.reason.contains("NaN")));
        assert!(h
            .rejected
            .iter()
            .any(|r| r.reason.contains("without a `caller` or `procedure`")));
    }

    /// Series interleaved row by row (valid ones, one with a NaN, one without caller or
    /// procedure, one with an invalid name; rows missing, samples finer than the step, unix and
    /// RFC 3339 times) load as they do when every row is keyed and added on its own.
    #[test]
    fn csv_series_load_as_when_each_row_is_added_on_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("h.csv");
        let t0 = 1_700_000_000 / 60 * 60;
        let sets = [
            ["maps", "web", "route"],
            ["maps", "bad", ""],
            ["maps", "", ""],
            ["pay", "gw", "charge"],
            ["pay", "gw x", ""],
        ];
        let mut text = String::from("ts,service,caller,procedure,rps\n");
        let mut rows = Vec::new();
        for i in 0..60i64 {
            for (k, set) in sets.iter().enumerate() {
                let k = k as i64;
                if (i + k) % 7 == 3 {
                    continue;
                }
                let ts = t0 + i * 60 + k * 7;
                let v = if set[1] == "bad" && i == 31 {
                    f64::NAN
                } else {
                    (i * (k + 1) % 50) as f64
                };
                let when = if i % 2 == 0 {
                    ts.to_string()
                } else {
                    DateTime::from_timestamp(ts, 0).unwrap().to_rfc3339()
                };
                text += &format!("{when},{},{},{},{v}\n", set[0], set[1], set[2]);
                rows.push((ts, set, v));
            }
        }
        std::fs::write(&p, text).unwrap();
        let now = Utc::now();
        let h = load(&p, &cfg(), now).unwrap();

        let last = rows.iter().map(|r| r.0).max().unwrap();
        let (start, step, len) = grid(&cfg(), now.timestamp().min(last + 60));
        let mut b = Builder::new(start, step, len, LabelNames::default());
        for (ts, set, v) in &rows {
            let metric: BTreeMap<String, String> = ["service", "caller", "procedure"]
                .iter()
                .zip(set.iter())
                .filter(|(_, v)| !v.is_empty())
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            if let Some(k) = b.key(&metric) {
                b.add_many(&k, std::iter::once((*ts as f64, *v)));
            }
        }
        let each_row = b.finish();
        assert_eq!(format!("{h:?}"), format!("{each_row:?}"));
        assert_eq!(h.series.len(), 2, "{:?}", h.series.keys());
        assert_eq!(h.rejected.len(), 3, "{:?}", h.rejected);
    }

    /// A CSV line that cannot be read fails the load, naming the file, the line and the field.
    #[test]
    fn csv_errors_name_the_file_the_line_and_the_field() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("h.csv");
        for (line, want) in [
            (
                "1700000000,maps,web,route",
                "line 2: expected 5 fields ts,service,caller,procedure,rps",
            ),
            (
                "yesterday,maps,web,route,1",
                "line 2: bad timestamp `yesterday`",
            ),
            ("1700000000,maps,web,route,x", "line 2: bad rps `x`"),
        ] {
            std::fs::write(&p, format!("ts,service,caller,procedure,rps\n{line}\n")).unwrap();
            let e = load(&p, &cfg(), Utc::now()).unwrap_err();
            assert!(
                matches!(
                    e,
                    HistoryError::Parse {
                        source: ParseError::Csv(_),
                        ..
                    }
                ),
                "{e}"
            );
            assert_eq!(
                e.to_string(),
                format!("cannot parse {}: {want}", p.display())
            );
        }
    }

    #[test]
    fn saved_query_range_json() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("h.json");
        let t0 = 1_700_000_000 / 60 * 60;
        let vals: Vec<String> = (0..60)
            .map(|i| format!("[{},\"{}\"]", t0 + i * 60, i))
            .collect();
        std::fs::write(
            &p,
            format!(
                r#"{{"status":"success","data":{{"resultType":"matrix","result":[{{"metric":{{"service":"maps","procedure":"route"}},"values":[{}]}}]}}}}"#,
                vals.join(",")
            ),
        )
        .unwrap();
        let h = load(&p, &cfg(), Utc::now()).unwrap();
        let s = h.series.values().next().unwrap();
        assert_eq!(s.present(), 60);
        assert_eq!(s.max(), Some(59.0));
    }

    #[test]
    fn csv_finer_than_the_step_keeps_the_peak_of_each_step() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("h.csv");
        let t0 = 1_700_000_000 / 60 * 60;
        let mut s = String::from("ts,service,caller,procedure,rps\n");
        for i in 0..60 {
            // Four 15 s samples per minute; the second is the minute's peak.
            for (k, v) in [(0, 10.0), (15, 40.0), (30, 20.0), (45, 5.0)] {
                let ts = t0 + i * 60 + k;
                if k < 30 {
                    s += &format!("{ts},maps,web,route,{v}\n");
                }
            }
        }
        std::fs::write(&p, s).unwrap();
        let h = load(&p, &cfg(), Utc::now()).unwrap();
        let web = h.series.values().next().unwrap();
        assert_eq!(web.max(), Some(40.0), "{:?}", &web.values[..4]);
    }
}
