//! [`Bandwidth`]: a link rate, parsed with explicit bits or bytes.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// A link rate, in bytes per second.
///
/// Parsed from a number and a unit that says whether it counts bits or bytes:
/// `bit`, `Kbit`, `Mbit`, `Gbit`, `Tbit` (also `bps`, `Mbps`, `Mb/s`...) for bits per
/// second; `B/s`, `KB/s`, `MB/s`, `GB/s` for bytes per second. Prefixes are decimal (M = 10^6,
/// so `100Mbit` is 12.5 MB/s); `Ki`, `Mi`, `Gi` are binary (`1MiB/s` = 1 048 576 bytes per
/// second). A bare number is refused, since it would not say which.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Bandwidth {
    bytes_per_sec: u64,
}

impl Bandwidth {
    /// A rate of `bytes_per_sec` bytes per second, or `None` for zero.
    pub fn from_bytes_per_sec(bytes_per_sec: u64) -> Option<Self> {
        (bytes_per_sec > 0).then_some(Self { bytes_per_sec })
    }

    /// A rate of `bits_per_sec` bits per second (rounded down to whole bytes), or `None` if
    /// that is less than one byte per second.
    pub fn from_bits_per_sec(bits_per_sec: u64) -> Option<Self> {
        Self::from_bytes_per_sec(bits_per_sec / 8)
    }

    /// Bytes per second.
    pub fn bytes_per_sec(self) -> u64 {
        self.bytes_per_sec
    }

    /// How long the link takes to transmit `len` bytes (rounded up to whole nanoseconds).
    pub fn transmit_time(self, len: usize) -> Duration {
        let ns = (len as u128 * 1_000_000_000).div_ceil(u128::from(self.bytes_per_sec));
        Duration::from_nanos(u64::try_from(ns).unwrap_or(u64::MAX))
    }

    /// How many bytes the link carries in `time`.
    pub fn bytes_in(self, time: Duration) -> u64 {
        let b = u128::from(self.bytes_per_sec) * time.as_nanos() / 1_000_000_000;
        u64::try_from(b).unwrap_or(u64::MAX)
    }
}

impl fmt::Debug for Bandwidth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Bandwidth({self})")
    }
}

impl fmt::Display for Bandwidth {
    /// Bits per second with the largest decimal prefix that keeps it exact, then MB/s:
    /// `100Mbit/s (12.5 MB/s)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let bits = u128::from(self.bytes_per_sec) * 8;
        let units: [(u128, &str); 4] = [
            (1_000_000_000_000, "T"),
            (1_000_000_000, "G"),
            (1_000_000, "M"),
            (1_000, "K"),
        ];
        let (value, prefix) = units
            .into_iter()
            .find(|(unit, _)| bits >= *unit && bits % *unit == 0)
            .map_or((bits, ""), |(unit, p)| (bits / unit, p));
        let mb = self.bytes_per_sec as f64 / 1e6;
        write!(f, "{value}{prefix}bit/s ({mb:.1} MB/s)")
    }
}

/// Why a bandwidth string could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid bandwidth {input:?}: {reason}")]
pub struct BandwidthError {
    input: String,
    reason: &'static str,
}

impl FromStr for Bandwidth {
    type Err = BandwidthError;

    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let err = |reason| BandwidthError {
            input: input.to_owned(),
            reason,
        };
        // The number and the unit as every number with a unit splits (farmap-core); the
        // number is read as f64, as link rates need no exact bytes.
        let (num, unit) = farmap_core::split_quantity(input);
        let value: f64 = num
            .parse()
            .map_err(|_| err("expected a number followed by a unit, e.g. 1Gbit or 500MB/s"))?;
        // Bytes or bits: `B/s` and `Bps` (capital B) count bytes; `bit`, `bps`, `b/s` bits.
        let lower = unit.to_ascii_lowercase();
        let (prefix, bits) = if let Some(p) = unit
            .strip_suffix("B/s")
            .or_else(|| unit.strip_suffix("Bps"))
        {
            (p.len(), false)
        } else if let Some(p) = ["bit/s", "bit", "bps", "b/s"]
            .iter()
            .find_map(|suffix| lower.strip_suffix(suffix))
        {
            (p.len(), true)
        } else {
            return Err(err(
                "unit must say bits (bit, Kbit, Mbit, Gbit) or bytes per second (B/s, KB/s, MB/s, GB/s)",
            ));
        };
        let scale: f64 = match &lower[..prefix] {
            "" => 1.0,
            "k" => 1e3,
            "m" => 1e6,
            "g" => 1e9,
            "t" => 1e12,
            "ki" => 1024.0,
            "mi" => 1024.0 * 1024.0,
            "gi" => 1024.0 * 1024.0 * 1024.0,
            "ti" => 1024.0f64.powi(4),
            _ => return Err(err("unknown prefix (use K, M, G, T or Ki, Mi, Gi, Ti)")),
        };
        let bytes = value * scale / if bits { 8.0 } else { 1.0 };
        if !bytes.is_finite() || bytes >= 1e18 {
            return Err(err("too large"));
        }
        Bandwidth::from_bytes_per_sec(bytes.round() as u64)
            .ok_or_else(|| err("must be at least one byte per second"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bandwidths_parse_with_explicit_bits_or_bytes() {
        let bw = |s: &str| s.parse::<Bandwidth>().map(Bandwidth::bytes_per_sec);
        assert_eq!(bw("1Gbit"), Ok(125_000_000));
        assert_eq!(bw("100Mbit"), Ok(12_500_000));
        assert_eq!(bw("100mbit/s"), Ok(12_500_000));
        assert_eq!(bw("100Mbps"), Ok(12_500_000));
        assert_eq!(bw("100Mb/s"), Ok(12_500_000));
        assert_eq!(bw("2.5Gbit"), Ok(312_500_000));
        assert_eq!(bw("500MB/s"), Ok(500_000_000));
        assert_eq!(bw("500MBps"), Ok(500_000_000));
        assert_eq!(bw("1MiB/s"), Ok(1 << 20));
        assert_eq!(bw("64kbit"), Ok(8_000));
        assert_eq!(bw("800bit"), Ok(100));
        for bad in [
            "", "100", "100M", "1Gb", "fast", "1Xbit", "0Mbit", "1bit", "1e30Gbit",
        ] {
            assert!(
                bad.parse::<Bandwidth>().is_err(),
                "{bad:?} should be refused"
            );
        }
        let shown = "100Mbit".parse::<Bandwidth>().map(|b| b.to_string());
        assert_eq!(shown.as_deref(), Ok("100Mbit/s (12.5 MB/s)"));
    }

    #[test]
    fn transmit_times_round_up() {
        let bw = Bandwidth::from_bytes_per_sec(3).expect("rate");
        assert_eq!(bw.transmit_time(1), Duration::from_nanos(333_333_334));
        assert_eq!(bw.bytes_in(Duration::from_secs(2)), 6);
    }
}
