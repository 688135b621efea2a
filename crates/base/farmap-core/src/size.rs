//! Sizes as people write them and as farmap prints them.
//!
//! Input takes binary suffixes: `KiB`, `MiB`, `GiB`, `TiB`, `PiB` (and `K`, `M`, `G`, `T`, `P`,
//! `KB`, `MB`, ... which farmap also reads as powers of 1024, since a size given for a region
//! is almost always meant that way). Output of throughput uses MB = 10^6 bytes.
//!
//! A size parses up to `u64::MAX` bytes; a *region* is further limited to
//! [`MAX_CHUNKS`](crate::MAX_CHUNKS) chunks by [`Geometry::new_bounded`](crate::Geometry::new_bounded),
//! which store specs use: `memory:1PiB` is
//! refused (2^34 chunks of 64 KiB) with a message saying so, `memory:1PiB?chunk=4MiB` is not.

use std::fmt;

/// Why a size string could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid size {input:?}: {reason}")]
pub struct SizeError {
    input: String,
    reason: &'static str,
}

/// Parses `256MiB`, `1GiB`, `4096`, `64K`, `1.5GiB` into bytes.
pub fn parse_size(input: &str) -> Result<u64, SizeError> {
    let err = |reason| SizeError {
        input: input.to_owned(),
        reason,
    };
    let (num, suffix) = crate::split_quantity(input);
    if num.is_empty() {
        return Err(err(
            "expected a number, optionally followed by KiB, MiB, GiB, TiB or PiB",
        ));
    }
    let shift = match suffix.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        "p" | "pb" | "pib" => 50,
        _ => return Err(err("unknown suffix (use KiB, MiB, GiB, TiB or PiB)")),
    };
    let unit = 1u64 << shift;
    if let Some((int, frac)) = num.split_once('.') {
        if frac.contains('.') || int.is_empty() && frac.is_empty() {
            return Err(err("malformed number"));
        }
        let int: u64 = if int.is_empty() {
            0
        } else {
            int.parse().map_err(|_| err("number too large"))?
        };
        // Exact decimal fraction of the unit, refusing anything that is not a whole byte.
        // Trailing zeros change nothing (`1.50GiB`); past them, a fraction too long for its
        // product with the unit to fit a u128 is refused (it overflowed before).
        let frac = frac.trim_end_matches('0');
        let digits = u32::try_from(frac.len()).map_err(|_| err("too many decimals"))?;
        let denom = 10u128
            .checked_pow(digits)
            .ok_or_else(|| err("too many decimals"))?;
        let frac_v: u128 = if frac.is_empty() {
            0
        } else {
            frac.parse().map_err(|_| err("malformed number"))?
        };
        let frac_bytes = frac_v
            .checked_mul(u128::from(unit))
            .ok_or_else(|| err("too many decimals"))?;
        if !frac_bytes.is_multiple_of(denom) {
            return Err(err("not a whole number of bytes"));
        }
        let total = u128::from(int) * u128::from(unit) + frac_bytes / denom;
        u64::try_from(total).map_err(|_| err("number too large"))
    } else {
        let v: u64 = num.parse().map_err(|_| err("number too large"))?;
        v.checked_mul(unit).ok_or_else(|| err("number too large"))
    }
}

/// Formats a byte count with the largest binary unit that divides it exactly
/// (`1GiB`, `64KiB`, `10000B`).
pub fn format_size(bytes: u64) -> String {
    const UNITS: [(u32, &str); 5] = [
        (50, "PiB"),
        (40, "TiB"),
        (30, "GiB"),
        (20, "MiB"),
        (10, "KiB"),
    ];
    for (shift, name) in UNITS {
        let unit = 1u64 << shift;
        if bytes >= unit && bytes.is_multiple_of(unit) {
            return format!("{}{}", bytes / unit, name);
        }
    }
    format!("{bytes}B")
}

/// A throughput in MB/s (10^6 bytes per second), printed with one decimal.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd)]
pub struct MbPerSec(pub f64);

impl MbPerSec {
    /// Throughput of `bytes` moved in `secs` seconds.
    pub fn from_bytes(bytes: u64, secs: f64) -> Self {
        if secs <= 0.0 {
            return MbPerSec(f64::INFINITY);
        }
        MbPerSec(bytes as f64 / secs / 1e6)
    }
}

impl fmt::Display for MbPerSec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.1} MB/s", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binary_suffixes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("64KiB").unwrap(), 65536);
        assert_eq!(parse_size("64K").unwrap(), 65536);
        assert_eq!(parse_size("256MiB").unwrap(), 256 << 20);
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert_eq!(parse_size("1gib").unwrap(), 1 << 30);
        assert_eq!(parse_size("1.5GiB").unwrap(), 3 << 29);
        assert_eq!(parse_size("2TiB").unwrap(), 2 << 40);
        assert_eq!(parse_size("1PiB").unwrap(), 1 << 50);
        assert_eq!(parse_size("1P").unwrap(), 1 << 50);
    }

    #[test]
    fn bad_sizes_are_refused() {
        for bad in [
            "",
            "MiB",
            "12XB",
            "1.2.3G",
            "0.3B",
            "99999999999999999999",
            "16777216TiB",
            // 34 decimals times 2^20 overflowed a u128 (found by the store_spec fuzz target).
            "0.1540930516503165037550375503755540MiB",
            "1.0000000000000000000000000000000000000000001PiB",
        ] {
            assert!(parse_size(bad).is_err(), "{bad} should be refused");
        }
        // Trailing zeros are not decimals that count.
        assert_eq!(
            parse_size("1.50000000000000000000000000000000000000000GiB").unwrap(),
            3 << 29
        );
        assert_eq!(parse_size("0.000KiB").unwrap(), 0);
        assert_eq!(parse_size("2.KiB").unwrap(), 2048);
    }

    #[test]
    fn formatting() {
        assert_eq!(format_size(1 << 30), "1GiB");
        assert_eq!(format_size(65536), "64KiB");
        assert_eq!(format_size(10000), "10000B");
        assert_eq!(MbPerSec::from_bytes(2_000_000, 1.0).to_string(), "2.0 MB/s");
    }
}
