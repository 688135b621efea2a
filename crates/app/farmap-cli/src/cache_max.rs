//! `--cache-max SIZE|N%`: the bound on a managed front's local memory (`mount --managed`,
//! `serve --nbd --managed`).

/// `--cache-max`: a number of bytes, or a percentage of the region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheMax {
    /// Bytes.
    Bytes(u64),
    /// Percent of the region's size (1..=100).
    Percent(u8),
}

impl CacheMax {
    /// The bound in bytes for a region of `size` bytes.
    pub fn bytes(self, size: u64) -> u64 {
        match self {
            CacheMax::Bytes(b) => b,
            CacheMax::Percent(p) => (u128::from(size) * u128::from(p) / 100) as u64,
        }
    }
}

impl std::fmt::Display for CacheMax {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CacheMax::Bytes(b) => write!(f, "--cache-max {}", farmap::format_size(*b)),
            CacheMax::Percent(p) => write!(f, "--cache-max {p}%"),
        }
    }
}

/// Parses `--cache-max`: SIZE (binary suffixes) or N% (1..=100).
pub fn parse_cache_max(s: &str) -> Result<CacheMax, String> {
    if let Some(p) = s.trim().strip_suffix('%') {
        let p: u8 = p
            .trim()
            .parse()
            .map_err(|_| format!("{s:?}: a percentage is a whole number from 1 to 100"))?;
        if !(1..=100).contains(&p) {
            return Err(format!(
                "{s:?}: a percentage is a whole number from 1 to 100"
            ));
        }
        return Ok(CacheMax::Percent(p));
    }
    let b = farmap::parse_size(s).map_err(|e| e.to_string())?;
    if b == 0 {
        return Err("a cache max of 0 bytes holds nothing".into());
    }
    Ok(CacheMax::Bytes(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_max_parses_sizes_and_percentages() {
        assert_eq!(parse_cache_max("4MiB"), Ok(CacheMax::Bytes(4 << 20)));
        assert_eq!(parse_cache_max("30%"), Ok(CacheMax::Percent(30)));
        assert_eq!(CacheMax::Percent(25).bytes(64 << 20), 16 << 20);
        for bad in ["0", "0%", "101%", "x%", "-3%", "lots"] {
            assert!(parse_cache_max(bad).is_err(), "{bad}");
        }
    }
}
