//! The `schedule` of rlc.yaml: 5-field cron in UTC.

use std::str::FromStr;

/// Why a `schedule` is not a 5-field cron expression.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    /// Not 5 fields.
    #[error("schedule `{expr}`: expected 5 fields (minute hour day-of-month month day-of-week)")]
    Fields {
        /// The expression as written.
        expr: String,
    },
    /// A field the `cron` crate refuses.
    #[error("schedule `{expr}`: {reason}")]
    Field {
        /// The expression as written.
        expr: String,
        /// The `cron` crate's words.
        reason: String,
    },
}

/// Converts a 5-field cron expression (minute hour day-of-month month day-of-week, UTC,
/// Sunday = 0 or 7) into a schedule of the `cron` crate (seconds first, Sunday = 1).
pub fn parse_schedule(expr: &str) -> Result<cron::Schedule, ScheduleError> {
    let fields: Vec<&str> = expr.split_whitespace().collect();
    if fields.len() != 5 {
        return Err(ScheduleError::Fields { expr: expr.into() });
    }
    let dow = fields[4]
        .split(',')
        .map(|item| {
            let (range, step) = match item.split_once('/') {
                Some((r, s)) => (r, Some(s)),
                None => (item, None),
            };
            let conv = |s: &str| -> String {
                match s.parse::<u32>() {
                    Ok(n) if n <= 7 => ((n % 7) + 1).to_string(),
                    _ => s.to_string(),
                }
            };
            let range = match range.split_once('-') {
                // `5-0`/`5-7` style ranges ending on Sunday: Sunday is 1 in the crate.
                Some((a, b)) if b == "7" || b == "0" => format!("{}-7,1", conv(a)),
                Some((a, b)) => format!("{}-{}", conv(a), conv(b)),
                None => conv(range),
            };
            match step {
                Some(s) => format!("{range}/{s}"),
                None => range,
            }
        })
        .collect::<Vec<_>>()
        .join(",");
    let six = format!(
        "0 {} {} {} {} {dow}",
        fields[0], fields[1], fields[2], fields[3]
    );
    cron::Schedule::from_str(&six).map_err(|e| ScheduleError::Field {
        expr: expr.into(),
        reason: e.to_string(),
    })
}
