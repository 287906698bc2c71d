//! `--drain-time 500ms`, `--stop-grace 1m30s`, ...: `envoy_agent::config::duration::parse_duration`
//! on any UTF-8 text (flags and environment variables are text).
//!
//! Besides "no panic": for text made only of `<integer><unit>` parts (`1m30s`, `250ms`) adding
//! up to at most a day, each unit once and largest first, the result must be exact; text with a
//! sign or an exponent must be refused.
#![no_main]

use std::time::Duration;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let parsed = envoy_agent::config::duration::parse_duration(text);
    // No sign, no exponent: a refusal, never a guess.
    if text.contains(['+', '-', 'e', 'E']) {
        assert!(parsed.is_err(), "{text:?} accepted as {parsed:?}");
    }
    if let Some(exact) = exact_nanos(text.trim()) {
        assert_eq!(
            parsed,
            Ok(Duration::from_nanos(exact)),
            "{text:?} is {exact} ns exactly"
        );
    }
});

/// `Some(nanoseconds)` when `s` is one or more `<digits><h|m|s|ms>` parts (each unit once, in
/// that order), each number at most
/// 9 digits, totalling at most a day; `None` for anything else (not checked).
fn exact_nanos(s: &str) -> Option<u64> {
    if s.is_empty() {
        return None;
    }
    let mut total: u64 = 0;
    let mut rest = s;
    let mut previous = u64::MAX;
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit())?;
        if digits == 0 || digits > 9 {
            return None;
        }
        let number: u64 = rest[..digits].parse().ok()?;
        let tail = &rest[digits..];
        let unit_len = tail
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(tail.len());
        let scale: u64 = match &tail[..unit_len] {
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            _ => return None,
        };
        // Each unit once, largest first: anything else is refused, not summed.
        if scale >= previous {
            return None;
        }
        previous = scale;
        total = total.checked_add(number.checked_mul(scale)?)?;
        if total > 86_400_000_000_000 {
            return None;
        }
        rest = &tail[unit_len..];
    }
    Some(total)
}
