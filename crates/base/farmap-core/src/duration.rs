//! Durations as people write them: a number and a unit, always both.
//!
//! Units: `ns`, `us` (or `µs`), `ms`, `s`, `m` (or `min`), `h`. The number may have a
//! fraction (`1.5s`, `0.25ms`). A bare number is refused: `30` could mean 30 ms or 30 s, and
//! farmap once read it both ways in different places. Every flag and option that takes a
//! duration uses [`parse_duration`]; [`format_duration`] prints one in a form it reads back.

use std::time::Duration;

/// The units [`parse_duration`] accepts, for messages.
pub const DURATION_UNITS: &str = "ns, us (or µs), ms, s, m (or min), h";

/// Why a duration string could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid duration {input:?}: {reason}")]
pub struct DurationError {
    input: String,
    reason: String,
}

const NANOS_PER: [(&str, u128); 8] = [
    ("ns", 1),
    ("us", 1_000),
    ("µs", 1_000),
    ("ms", 1_000_000),
    ("s", 1_000_000_000),
    ("m", 60_000_000_000),
    ("min", 60_000_000_000),
    ("h", 3_600_000_000_000),
];

/// Parses `10ms`, `250us`, `1.5s`, `2m`, `1h`, `0ms` into a duration (exactly, to the
/// nanosecond). A bare number, an unknown unit, a negative value, a value finer than a
/// nanosecond or larger than [`Duration::MAX`] is an error that says what is accepted.
pub fn parse_duration(input: &str) -> Result<Duration, DurationError> {
    let err = |reason: String| DurationError {
        input: input.to_owned(),
        reason,
    };
    let (num, unit) = crate::split_quantity(input);
    if num.is_empty() {
        return Err(err(format!(
            "expected a number followed by a unit ({DURATION_UNITS}), e.g. 500ms or 30s"
        )));
    }
    if unit.is_empty() {
        return Err(err(format!(
            "a unit is required ({DURATION_UNITS}), e.g. {num}ms or {num}s"
        )));
    }
    let Some(&(_, per)) = NANOS_PER.iter().find(|(name, _)| *name == unit) else {
        return Err(err(format!("unknown unit {unit:?} (use {DURATION_UNITS})")));
    };
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if frac.contains('.') || int.is_empty() && frac.is_empty() {
        return Err(err("malformed number".into()));
    }
    let too_large = || err("too large".into());
    let int: u128 = if int.is_empty() {
        0
    } else {
        int.parse().map_err(|_| too_large())?
    };
    let mut nanos = int.checked_mul(per).ok_or_else(too_large)?;
    if !frac.is_empty() {
        let digits = u32::try_from(frac.len()).map_err(|_| err("too many decimals".into()))?;
        let denom = 10u128
            .checked_pow(digits)
            .ok_or_else(|| err("too many decimals".into()))?;
        let frac: u128 = frac.parse().map_err(|_| err("malformed number".into()))?;
        let frac_nanos = frac.checked_mul(per).ok_or_else(too_large)?;
        if !frac_nanos.is_multiple_of(denom) {
            return Err(err("finer than a nanosecond".into()));
        }
        nanos = nanos
            .checked_add(frac_nanos / denom)
            .ok_or_else(too_large)?;
    }
    let secs = u64::try_from(nanos / 1_000_000_000).map_err(|_| too_large())?;
    Ok(Duration::new(secs, (nanos % 1_000_000_000) as u32))
}

/// Formats a duration in the largest unit that holds it exactly (`30s`, `250ms`, `1500us`,
/// `2m`, `1h`, `7ns`); [`parse_duration`] reads the result back to the same value.
pub fn format_duration(d: Duration) -> String {
    let nanos = d.as_nanos();
    if nanos == 0 {
        return "0s".into();
    }
    for (name, per) in [
        ("h", 3_600_000_000_000u128),
        ("m", 60_000_000_000),
        ("s", 1_000_000_000),
        ("ms", 1_000_000),
        ("us", 1_000),
    ] {
        if nanos.is_multiple_of(per) {
            return format!("{}{name}", nanos / per);
        }
    }
    format!("{nanos}ns")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_and_fractions() {
        let ok = [
            ("0ms", Duration::ZERO),
            ("10ms", Duration::from_millis(10)),
            ("250us", Duration::from_micros(250)),
            ("250µs", Duration::from_micros(250)),
            ("7ns", Duration::from_nanos(7)),
            ("1.5s", Duration::from_millis(1500)),
            (".5s", Duration::from_millis(500)),
            ("0.25ms", Duration::from_micros(250)),
            ("2m", Duration::from_secs(120)),
            ("2min", Duration::from_secs(120)),
            ("1.5h", Duration::from_secs(5400)),
            (" 30s ", Duration::from_secs(30)),
        ];
        for (input, want) in ok {
            assert_eq!(parse_duration(input), Ok(want), "{input}");
        }
    }

    #[test]
    fn bare_numbers_and_bad_units_are_refused_with_the_units() {
        for bare in ["30", "0", "1.5"] {
            let e = parse_duration(bare).unwrap_err().to_string();
            assert!(
                e.contains("a unit is required") && e.contains("ms") && e.contains("h"),
                "{bare}: {e}"
            );
        }
        for bad in [
            "",
            "ms",
            "ten",
            "10 parsecs",
            "5d",
            "-1s",
            "1.2.3s",
            "0.5ns",
            "1e3ms",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad} should be refused");
        }
        assert!(parse_duration("99999999999999999999999h").is_err());
        let e = parse_duration("5d").unwrap_err().to_string();
        assert!(e.contains("unknown unit \"d\"") && e.contains("min"), "{e}");
    }

    #[test]
    fn formatting_reads_back() {
        for d in [
            Duration::ZERO,
            Duration::from_nanos(7),
            Duration::from_micros(1500),
            Duration::from_millis(250),
            Duration::from_secs(30),
            Duration::from_secs(120),
            Duration::from_secs(7200),
            Duration::new(3, 1),
        ] {
            assert_eq!(parse_duration(&format_duration(d)), Ok(d), "{d:?}");
        }
        assert_eq!(format_duration(Duration::from_millis(1500)), "1500ms");
        assert_eq!(format_duration(Duration::from_secs(90)), "90s");
        assert_eq!(format_duration(Duration::from_secs(3600)), "1h");
    }
}
