//! Durations on the command line: `500ms`, `5s`, `1m30s`, `1h`, `1.5s`, or a bare number of
//! seconds; nothing else (see [`parse_duration`]). A refusal says which forms work; clap adds
//! the flag's name.

use std::time::Duration;

/// Why a duration was refused; clap adds the flag's name. The words say which forms work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    /// Nothing, or only whitespace.
    #[error("an empty duration ({FORMS})")]
    Empty,
    /// Not one of the forms.
    #[error("{input:?} is not a duration: {why} ({FORMS})")]
    NotADuration {
        /// As given.
        input: String,
        /// What is wrong with it.
        why: String,
    },
    /// Finer than a second where Envoy takes whole seconds.
    #[error("{input:?}: envoy takes this in whole seconds; {value:?} would become {}s", value.as_secs())]
    NotWholeSeconds {
        /// As given.
        input: String,
        /// What it reads as.
        value: Duration,
    },
    /// Zero where zero cannot work.
    #[error("{input:?}: must be more than zero (a zero deadline or interval cannot work)")]
    Zero {
        /// As given.
        input: String,
    },
    /// Zero where at least a whole second is needed.
    #[error("{input:?}: must be at least 1s")]
    UnderASecond {
        /// As given.
        input: String,
    },
}

/// A duration Envoy gets in whole seconds (`--drain-time-s`, `--parent-shutdown-time-s`):
/// anything else would be truncated on the way, silently.
pub fn parse_whole_seconds(input: &str) -> Result<Duration, DurationError> {
    let d = parse_duration(input)?;
    if d.subsec_nanos() != 0 {
        return Err(DurationError::NotWholeSeconds {
            input: input.to_owned(),
            value: d,
        });
    }
    Ok(d)
}

/// A duration that must not be zero (a deadline, a poll interval).
pub fn parse_positive_duration(input: &str) -> Result<Duration, DurationError> {
    let d = parse_duration(input)?;
    if d.is_zero() {
        return Err(DurationError::Zero {
            input: input.to_owned(),
        });
    }
    Ok(d)
}

/// A whole number of seconds, more than zero.
pub fn parse_positive_whole_seconds(input: &str) -> Result<Duration, DurationError> {
    let d = parse_whole_seconds(input)?;
    if d.is_zero() {
        return Err(DurationError::UnderASecond {
            input: input.to_owned(),
        });
    }
    Ok(d)
}

/// The forms every duration flag takes, for its errors.
const FORMS: &str = "use a number of seconds (30, 1.5) or <number><unit> parts from h, m, s, ms, each once and \
     in that order (500ms, 5s, 1m30s, 1h, 1.5s)";

/// Parses a duration: a bare number of seconds (`30`, `1.5`), or `<number><unit>` parts with
/// units `h`, `m`, `s`, `ms`, each at most once and in that order (`1m30s`, `1h2m3s`,
/// `1s500ms`); a number is digits with an optional fraction (`1.5`). Nothing else: no sign, no
/// exponent, no bare `.5`, no repeated unit. Surrounding whitespace (an environment file's) is
/// ignored. Computed exactly in nanoseconds; a value finer than a nanosecond or larger than a
/// [`Duration`] is refused.
pub fn parse_duration(input: &str) -> Result<Duration, DurationError> {
    let s = input.trim();
    if s.is_empty() {
        return Err(DurationError::Empty);
    }
    let bad = |why: &str| DurationError::NotADuration {
        input: input.to_owned(),
        why: why.to_owned(),
    };
    if s.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return nanos_of(s, NANOS_PER_SECOND)
            .map_err(&bad)
            .map(Duration::from_nanos);
    }
    let mut total: u64 = 0;
    let mut rest = s;
    // Units seen so far: each must be smaller than the one before it.
    let mut previous = u64::MAX;
    while !rest.is_empty() {
        let number_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (number, tail) = rest.split_at(number_len);
        let unit_len = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_len);
        let scale = match unit {
            "h" => 3600 * NANOS_PER_SECOND,
            "m" => 60 * NANOS_PER_SECOND,
            "s" => NANOS_PER_SECOND,
            "ms" => NANOS_PER_SECOND / 1000,
            "" => return Err(bad("a number without a unit after the first part")),
            other => return Err(bad(&format!("unknown unit {other:?}"))),
        };
        if scale >= previous {
            return Err(bad(&format!("{unit:?} repeated or out of order")));
        }
        previous = scale;
        let part = nanos_of(number, scale).map_err(&bad)?;
        total = total.checked_add(part).ok_or_else(|| bad("too large"))?;
        rest = tail;
    }
    Ok(Duration::from_nanos(total))
}

const NANOS_PER_SECOND: u64 = 1_000_000_000;

/// `number` (digits, optionally `.` and more digits) times `scale` nanoseconds, exactly.
fn nanos_of(number: &str, scale: u64) -> Result<u64, &'static str> {
    let (whole, fraction) = match number.split_once('.') {
        Some((w, f)) => (w, Some(f)),
        None => (number, None),
    };
    let digits = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
    if !digits(whole) || fraction.is_some_and(|f| !digits(f)) {
        return Err("a number is digits, with an optional fraction (1.5)");
    }
    let too_large = "too large";
    let whole: u64 = whole.parse().map_err(|_| too_large)?;
    let mut total = whole.checked_mul(scale).ok_or(too_large)?;
    if let Some(fraction) = fraction {
        // Each digit is worth a tenth of the one before; the last must land on a whole
        // nanosecond.
        let mut worth = scale;
        for digit in fraction.bytes().map(|b| u64::from(b - b'0')) {
            if worth % 10 != 0 && digit != 0 {
                return Err("finer than a nanosecond");
            }
            worth /= 10;
            total = total.checked_add(digit * worth).ok_or(too_large)?;
        }
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("30"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
    }

    #[test]
    fn compound() {
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("1h2m3s"), Ok(Duration::from_secs(3723)));
        assert_eq!(parse_duration("1s500ms"), Ok(Duration::from_millis(1500)));
    }

    #[test]
    fn errors_name_the_input() {
        assert!(
            parse_duration("5 parsecs")
                .unwrap_err()
                .to_string()
                .contains("5 parsecs")
        );
        assert!(
            parse_duration("fast")
                .unwrap_err()
                .to_string()
                .contains("fast")
        );
        assert!(parse_duration("5x").unwrap_err().to_string().contains("5x"));
        assert!(parse_duration("-1s").is_err());
        assert!(parse_duration("").is_err());
    }

    #[test]
    fn fractions_are_exact() {
        assert_eq!(parse_duration("0.001"), Ok(Duration::from_millis(1)));
        assert_eq!(parse_duration("1.5ms"), Ok(Duration::from_micros(1500)));
        assert_eq!(parse_duration("0.000000001s"), Ok(Duration::from_nanos(1)));
        assert_eq!(parse_duration("1.25h"), Ok(Duration::from_secs(4500)));
        assert_eq!(parse_duration(" 5s\n"), Ok(Duration::from_secs(5)));
    }

    /// What fuzzing found accepted (docs/fuzzing.md), and its kin: each refused, with the
    /// forms that work.
    #[test]
    fn only_the_documented_forms() {
        for input in [
            "1e3",
            "1E2",
            "+5",
            "-0",
            "1e-9",
            ".5s",
            "5.s",
            ".5",
            "5.",
            "1s1s",
            "1ms1h",
            "1s1m",
            "0.0000000001s",
            "0.0000001ms",
            "inf",
            "NaN",
            "1s 500ms",
            "1 s",
            "5sec",
            "1m30",
            "99999999999999999999s",
            "18446744073709551615h",
            "1..5s",
            "1.5.5s",
        ] {
            let error = parse_duration(input).expect_err(input).to_string();
            assert!(error.contains(&format!("{input:?}")), "{error}");
            assert!(error.contains("1m30s"), "{error}");
        }
    }
}
