//! `--cache-max SIZE|N%`: the bound on a managed front's local memory (`mount --managed`,
//! `serve --nbd --managed`).

/// `--cache-max`: a number of bytes, or a percentage of the region.
pub type CacheMax = farmap::SizeOrPercent;

/// Parses `--cache-max`: SIZE (binary suffixes) or N% with N in (0, 100].
pub fn parse_cache_max(s: &str) -> Result<CacheMax, String> {
    s.parse()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_max_parses_sizes_and_percentages() {
        assert_eq!(parse_cache_max("4MiB"), Ok(CacheMax::Bytes(4 << 20)));
        assert_eq!(parse_cache_max("30%"), Ok(CacheMax::Percent(30.0)));
        assert_eq!(CacheMax::Percent(25.0).bytes_of(64 << 20), 16 << 20);
        for bad in ["0", "0%", "101%", "x%", "-3%", "lots"] {
            assert!(parse_cache_max(bad).is_err(), "{bad}");
        }
    }
}
