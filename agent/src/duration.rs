//! Durations on the command line: `500ms`, `5s`, `1m30s`, `1h`, `1.5s`, or a bare number of
//! seconds.

use std::time::Duration;

/// A duration Envoy gets in whole seconds (`--drain-time-s`, `--parent-shutdown-time-s`):
/// anything else would be truncated on the way, silently.
pub fn parse_whole_seconds(input: &str) -> Result<Duration, String> {
    let d = parse_duration(input)?;
    if d.subsec_nanos() != 0 {
        return Err(format!(
            "{input:?}: envoy takes this in whole seconds; {d:?} would become {}s",
            d.as_secs()
        ));
    }
    Ok(d)
}

/// A duration that must not be zero (a deadline, a poll interval).
pub fn parse_positive_duration(input: &str) -> Result<Duration, String> {
    let d = parse_duration(input)?;
    if d.is_zero() {
        return Err(format!(
            "{input:?}: must be more than zero (a zero deadline or interval cannot work)"
        ));
    }
    Ok(d)
}

/// A whole number of seconds, more than zero.
pub fn parse_positive_whole_seconds(input: &str) -> Result<Duration, String> {
    let d = parse_whole_seconds(input)?;
    if d.is_zero() {
        return Err(format!("{input:?}: must be at least 1s"));
    }
    Ok(d)
}

/// Parses a sequence of `<number><unit>` parts (`ms`, `s`, `m`, `h`), e.g. `1m30s`, or a bare
/// number of seconds (`30`).
pub fn parse_duration(input: &str) -> Result<Duration, String> {
    let s = input.trim();
    if s.is_empty() {
        return Err("an empty duration (use e.g. 500ms, 5s, 1m30s)".to_owned());
    }
    if let Ok(seconds) = s.parse::<f64>() {
        return Duration::try_from_secs_f64(seconds).map_err(|e| format!("{input:?}: {e}"));
    }
    let mut total = 0.0_f64;
    let mut rest = s;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (number, tail) = rest.split_at(digits);
        let unit_len = tail
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_len);
        let value: f64 = number
            .parse()
            .map_err(|_| format!("{input:?} is not a duration (use e.g. 500ms, 5s, 1m30s)"))?;
        let scale = match unit {
            "ms" => 0.001,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            other => {
                return Err(format!(
                    "{input:?}: unknown unit {other:?} (use ms, s, m or h)"
                ));
            }
        };
        total += value * scale;
        rest = tail;
    }
    Duration::try_from_secs_f64(total).map_err(|e| format!("{input:?}: {e}"))
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
                .contains("5 parsecs")
        );
        assert!(parse_duration("fast").unwrap_err().contains("fast"));
        assert!(parse_duration("5x").unwrap_err().contains("5x"));
        assert!(parse_duration("-1s").is_err());
        assert!(parse_duration("").is_err());
    }
}
