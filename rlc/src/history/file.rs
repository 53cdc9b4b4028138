//! History from a file: a saved `query_range` JSON response, or CSV with the header
//! `ts,service,caller,procedure,rps` (`ts` in unix seconds or RFC 3339; an empty caller or
//! procedure means none; a missing row is a missing sample).

use std::collections::BTreeMap;
use std::path::Path;

use chrono::{DateTime, Utc};
use schema::{HistoryConfig, LabelNames};

use super::prometheus::{feed, Response};
use super::{grid, Builder, History, HistoryError};

/// Loads `path`, on a grid ending at `end` or at the file's last sample if that is earlier.
pub fn load(path: &Path, cfg: &HistoryConfig, end: DateTime<Utc>) -> Result<History, HistoryError> {
    let text = std::fs::read_to_string(path).map_err(|e| HistoryError::Io {
        path: path.to_path_buf(),
        source: e,
    })?;
    let perr = |message: String| HistoryError::Parse {
        what: path.display().to_string(),
        message,
    };
    let is_csv = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("csv"));
    let end = end.timestamp();
    if is_csv {
        let rows = parse_csv(&text).map_err(perr)?;
        let last = rows.iter().map(|r| r.0).max().unwrap_or(end);
        let step = cfg.step.as_secs() as i64;
        let (start, step, len) = grid(cfg, end.min(last + step));
        // CSV columns have fixed names; the configured label names are for Prometheus.
        let mut b = Builder::new(start, step, len, LabelNames::default());
        for (ts, metric, v) in rows {
            if let Some(k) = b.key(&metric) {
                b.add(&k, ts as f64, v);
            }
        }
        Ok(b.finish())
    } else {
        let r: Response<'_> = serde_json::from_str(&text).map_err(|e| perr(e.to_string()))?;
        if r.status != "success" {
            return Err(perr(format!(
                "status {}: {}",
                r.status,
                r.error.unwrap_or_default()
            )));
        }
        let data = r.data.ok_or_else(|| perr("no data".into()))?;
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

type Row = (i64, BTreeMap<String, String>, f64);

fn parse_csv(text: &str) -> Result<Vec<Row>, String> {
    let mut rows = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || (n == 0 && line.starts_with("ts,")) {
            continue;
        }
        let f: Vec<&str> = line.split(',').map(str::trim).collect();
        if f.len() != 5 {
            return Err(format!(
                "line {}: expected 5 fields ts,service,caller,procedure,rps",
                n + 1
            ));
        }
        let ts = f[0]
            .parse::<i64>()
            .ok()
            .or_else(|| {
                DateTime::parse_from_rfc3339(f[0])
                    .ok()
                    .map(|d| d.timestamp())
            })
            .ok_or_else(|| format!("line {}: bad timestamp `{}`", n + 1, f[0]))?;
        let v = f[4]
            .parse::<f64>()
            .map_err(|_| format!("line {}: bad rps `{}`", n + 1, f[4]))?;
        let mut m = BTreeMap::new();
        for (k, val) in [("service", f[1]), ("caller", f[2]), ("procedure", f[3])] {
            if !val.is_empty() {
                m.insert(k.to_string(), val.to_string());
            }
        }
        rows.push((ts, m, v));
    }
    Ok(rows)
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
