//! The one duration parser: a sequence of `<number><unit>` parts (`30s`, `7d`, `1h30m`), with
//! the units of the caller's grammar. rlc.yaml's durations ([`crate::HumanDuration`]) take
//! [`HUMAN_UNITS`]; durations a Prometheus server reports take [`PROMETHEUS_UNITS`].

/// `s`, `m`, `h`, `d`, `w`: the units of every duration in the files rlc reads.
pub const HUMAN_UNITS: &[(&str, u64)] = &[
    ("s", 1_000),
    ("m", 60_000),
    ("h", 3_600_000),
    ("d", 86_400_000),
    ("w", 604_800_000),
];

/// Prometheus' units (`ms` to `y`), as its flags and configuration print durations.
pub const PROMETHEUS_UNITS: &[(&str, u64)] = &[
    ("ms", 1),
    ("s", 1_000),
    ("m", 60_000),
    ("h", 3_600_000),
    ("d", 86_400_000),
    ("w", 604_800_000),
    ("y", 31_536_000_000),
];

/// Why a duration was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DurationError {
    /// Empty, or a part without its number.
    NoNumber,
    /// A part whose unit is not one of the grammar's.
    Unit,
    /// Longer than `u64` milliseconds.
    TooLong,
}

/// `text` in milliseconds, each part's unit (its letters) one of `units`.
pub fn parse_ms(text: &str, units: &[(&str, u64)]) -> Result<u64, DurationError> {
    let mut rest = text.trim();
    if rest.is_empty() {
        return Err(DurationError::NoNumber);
    }
    let mut total = 0u64;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        if digits == 0 {
            return Err(DurationError::NoNumber);
        }
        let n: u64 = rest[..digits].parse().map_err(|_| DurationError::TooLong)?;
        rest = &rest[digits..];
        let letters = rest
            .find(|c: char| !c.is_ascii_alphabetic())
            .unwrap_or(rest.len());
        let (_, ms) = units
            .iter()
            .find(|(u, _)| *u == &rest[..letters])
            .ok_or(DurationError::Unit)?;
        total = n
            .checked_mul(*ms)
            .and_then(|v| total.checked_add(v))
            .ok_or(DurationError::TooLong)?;
        rest = &rest[letters..];
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::type_complexity)] // a table of cases
    fn one_parser_two_grammars() {
        let cases: &[(&str, &[(&str, u64)], Result<u64, DurationError>)] = &[
            ("30s", HUMAN_UNITS, Ok(30_000)),
            ("1h30m", HUMAN_UNITS, Ok(5_400_000)),
            ("2w", HUMAN_UNITS, Ok(1_209_600_000)),
            ("5y", HUMAN_UNITS, Err(DurationError::Unit)),
            ("300ms", HUMAN_UNITS, Err(DurationError::Unit)),
            ("300ms", PROMETHEUS_UNITS, Ok(300)),
            ("1m30s", PROMETHEUS_UNITS, Ok(90_000)),
            ("5m", PROMETHEUS_UNITS, Ok(300_000)),
            ("1y", PROMETHEUS_UNITS, Ok(31_536_000_000)),
            ("", HUMAN_UNITS, Err(DurationError::NoNumber)),
            ("d", HUMAN_UNITS, Err(DurationError::NoNumber)),
            ("1h m", HUMAN_UNITS, Err(DurationError::NoNumber)),
            ("1hm", HUMAN_UNITS, Err(DurationError::Unit)),
            (
                "99999999999999999999s",
                HUMAN_UNITS,
                Err(DurationError::TooLong),
            ),
            (
                "18446744073709552s",
                HUMAN_UNITS,
                Err(DurationError::TooLong),
            ),
        ];
        for (text, units, want) in cases {
            assert_eq!(&parse_ms(text, units), want, "{text}");
        }
    }
}
