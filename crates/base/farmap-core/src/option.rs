//! Values of store-spec options that every scheme shares (`connections=`, `timeout=`,
//! `retries=`...): one parser each, so every store says the same thing about a bad value;
//! and [`OutOfRange`], the one error for a library option out of its range.

use std::fmt::Display;
use std::ops::RangeInclusive;
use std::str::FromStr;
use std::time::Duration;

/// The longest per-request timeout a spec may give.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(86_400);

/// A whole number within `range` (`connections=8`, `retries=3`). The error is the reason,
/// for the caller to put in its own error type.
pub fn parse_count<T>(value: &str, range: RangeInclusive<T>) -> Result<T, String>
where
    T: FromStr + PartialOrd + Display,
{
    value
        .parse::<T>()
        .ok()
        .filter(|n| range.contains(n))
        .ok_or_else(|| {
            format!(
                "{value:?} is not a whole number from {} to {}",
                range.start(),
                range.end()
            )
        })
}

/// A per-request timeout (`500ms`, `30s`, `2m`: a unit is required), more than zero and at
/// most a day ([`MAX_TIMEOUT`]).
pub fn parse_timeout(value: &str) -> Result<Duration, String> {
    let d = crate::parse_duration(value).map_err(|e| e.to_string())?;
    if d.is_zero() || d > MAX_TIMEOUT {
        return Err(format!(
            "{value:?} is not between 0 and 24h (exclusive of 0)"
        ));
    }
    Ok(d)
}

/// A setting of a library's options (a server's, a device's) outside what it allows.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what} must be from {min} to {max}, not {value}")]
pub struct OutOfRange {
    /// The option.
    pub what: &'static str,
    /// Its value.
    pub value: u64,
    /// Smallest allowed.
    pub min: u64,
    /// Largest allowed.
    pub max: u64,
}

/// Checks that option `what` is within `min..=max`.
pub fn check_range(what: &'static str, value: u64, min: u64, max: u64) -> Result<(), OutOfRange> {
    if (min..=max).contains(&value) {
        Ok(())
    } else {
        Err(OutOfRange {
            what,
            value,
            min,
            max,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_timeouts_are_bounded() {
        assert_eq!(parse_count("8", 1..=64usize), Ok(8));
        assert_eq!(
            parse_count("0", 1..=64usize).unwrap_err(),
            "\"0\" is not a whole number from 1 to 64"
        );
        assert!(parse_count::<u32>("x", 0..=3).is_err());
        assert_eq!(parse_timeout("2s"), Ok(Duration::from_secs(2)));
        assert!(parse_timeout("0s").is_err());
        assert!(parse_timeout("25h").is_err());
        assert!(parse_timeout("5").is_err(), "a unit is required");
        assert_eq!(check_range("n", 3, 1, 3), Ok(()));
        assert_eq!(
            check_range("n", 4, 1, 3).unwrap_err().to_string(),
            "n must be from 1 to 3, not 4"
        );
    }
}
