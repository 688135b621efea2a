//! "SIZE or N%": the one grammar of every bound given either in bytes or as a share of a
//! region (`--local-max`, `--cache-max`, `region limit`).

use std::fmt;
use std::str::FromStr;

use crate::{format_size, parse_size};

/// A bound in bytes, or as a percentage of a region's size.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SizeOrPercent {
    /// At most this many bytes (more than zero).
    Bytes(u64),
    /// At most this percentage of the region's size (0 < p ≤ 100).
    Percent(f64),
}

impl SizeOrPercent {
    /// The bound in bytes for a region of `size` bytes.
    pub fn bytes_of(&self, size: u64) -> u64 {
        match *self {
            SizeOrPercent::Bytes(b) => b,
            SizeOrPercent::Percent(p) => (size as f64 * p.clamp(0.0, 100.0) / 100.0) as u64,
        }
    }

    /// The bound in whole chunks for a region of `size` bytes in chunks of `chunk_size`
    /// bytes: rounded down, at least one chunk, at most every chunk.
    pub fn chunks(&self, size: u64, chunk_size: u64) -> u64 {
        let total = size.div_ceil(chunk_size.max(1));
        (self.bytes_of(size) / chunk_size.max(1)).clamp(1, total.max(1))
    }
}

impl FromStr for SizeOrPercent {
    type Err = String;

    /// `N%` with N in (0, 100], or a size as everywhere ([`parse_size`]: `512MiB`, `64K`,
    /// `4096`), more than zero.
    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim();
        if let Some(p) = t.strip_suffix('%') {
            let p: f64 = p
                .trim()
                .parse()
                .map_err(|_| format!("{s:?}: not a percentage (like 30%)"))?;
            if !(p > 0.0 && p <= 100.0) {
                return Err(format!("{s:?}: the percentage must be in (0, 100]"));
            }
            return Ok(SizeOrPercent::Percent(p));
        }
        match parse_size(t) {
            Ok(0) => Err(format!("{s:?}: a bound of 0 bytes would hold nothing")),
            Ok(b) => Ok(SizeOrPercent::Bytes(b)),
            Err(e) => Err(format!(
                "{e} (a size like 512MiB, or a percentage like 30%)"
            )),
        }
    }
}

impl fmt::Display for SizeOrPercent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SizeOrPercent::Bytes(b) => f.write_str(&format_size(*b)),
            SizeOrPercent::Percent(p) => write!(f, "{p}%"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_percentages_parse_as_everywhere() {
        let p = |s: &str| s.parse::<SizeOrPercent>();
        assert_eq!(p("512MiB"), Ok(SizeOrPercent::Bytes(512 << 20)));
        assert_eq!(p("64K"), Ok(SizeOrPercent::Bytes(64 << 10)));
        assert_eq!(p("4096"), Ok(SizeOrPercent::Bytes(4096)));
        assert_eq!(p(" 30% "), Ok(SizeOrPercent::Percent(30.0)));
        assert_eq!(p("0.5%"), Ok(SizeOrPercent::Percent(0.5)));
        assert_eq!(p("100%"), Ok(SizeOrPercent::Percent(100.0)));
        for bad in ["0", "0%", "101%", "x%", "-3%", "lots", ""] {
            assert!(p(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn bounds_in_bytes_and_chunks() {
        assert_eq!(SizeOrPercent::Percent(25.0).bytes_of(64 << 20), 16 << 20);
        assert_eq!(SizeOrPercent::Bytes(5000).bytes_of(1 << 30), 5000);
        // Rounded down to whole chunks, at least one, at most all.
        assert_eq!(SizeOrPercent::Bytes(3 * 4096 + 5).chunks(1 << 20, 4096), 3);
        assert_eq!(SizeOrPercent::Bytes(1).chunks(1 << 20, 4096), 1);
        assert_eq!(SizeOrPercent::Bytes(1 << 40).chunks(1 << 20, 4096), 256);
        assert_eq!(SizeOrPercent::Percent(50.0).chunks(1 << 20, 65536), 8);
    }

    #[test]
    fn display_reads_back() {
        for s in ["512MiB", "30%", "0.5%"] {
            let v: SizeOrPercent = s.parse().unwrap();
            assert_eq!(v.to_string().parse::<SizeOrPercent>(), Ok(v), "{s}");
        }
    }
}
