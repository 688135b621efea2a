//! The lines of the self-checking guest program (`scripts/vm/vmcheck.c`, docs/design/vm.md
//! §7) on its serial console: `VMCHECK KIND key=value ...`.

use std::collections::HashMap;

/// The guest program's rate limit, as its `ready` line gives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rate {
    /// As fast as it can (`rate_mibs=max`).
    Max,
    /// MiB per second.
    MibPerSec(u64),
}

/// A line of the self-checking guest program (`scripts/vm/vmcheck.c`). Fields are
/// `key=value` pairs; unknown keys are ignored, so the program may add some.
#[derive(Debug, Clone, PartialEq)]
pub enum VmcheckLine {
    /// `VMCHECK ready ws_mib=.. rate_mibs=..`: the working set is touched once, the loop
    /// starts.
    Ready {
        /// The working set, MiB.
        ws_mib: u64,
        /// The write rate.
        rate_mibs: Rate,
    },
    /// `VMCHECK t_ms=.. gen=.. pages=.. mibs=.. max_gap_us=.. mismatches=..`: the periodic
    /// report.
    Report {
        /// Guest time since the start, ms (guest clock: it stops with the VM under TCG).
        t_ms: u64,
        /// The current generation (full passes over the working set).
        gen: u64,
        /// Pages checked and rewritten so far.
        pages: u64,
        /// The write rate since the last report, MiB/s.
        mibs: f64,
        /// The largest gap between heartbeat batches, in guest time, µs.
        max_gap_us: u64,
        /// Pages whose content was not what the guest last wrote.
        mismatches: u64,
    },
    /// `VMCHECK MISMATCH page=.. word=.. want=.. got=..` (the first few only).
    Mismatch {
        /// The page in the working set.
        page: u64,
        /// The 8-byte word in the page.
        word: u64,
        /// What the guest wrote.
        want: u64,
        /// What it read.
        got: u64,
    },
    /// `VMCHECK done pages=.. mismatches=N`: the answer to `stop`, after a full check.
    Done {
        /// Pages checked.
        pages: u64,
        /// Pages that did not match.
        mismatches: u64,
    },
    /// A `VMCHECK` line of another kind, or with a field missing or unreadable.
    Other {
        /// The line from `VMCHECK` on.
        line: String,
    },
}

impl VmcheckLine {
    /// Reads a console line; `None` when it has no `VMCHECK ` in it. Text before `VMCHECK`
    /// (a kernel message's end on the same line) is ignored. Numbers are decimal, or hex
    /// with `0x`; `mibs` may have decimals.
    pub fn parse(line: &str) -> Option<Self> {
        let at = line.find("VMCHECK ")?;
        let text = line[at..].trim_end();
        let mut words = text.split_whitespace().skip(1).peekable();
        let kind = words.peek().filter(|w| !w.contains('=')).copied();
        let fields = Fields(words.filter_map(|w| w.split_once('=')).collect());
        let parsed = match kind {
            Some("ready") => fields.ready(),
            Some("MISMATCH") => fields.mismatch(),
            Some("done") => fields.done(),
            None => fields.report(),
            Some(_) => None,
        };
        Some(parsed.unwrap_or_else(|| Self::Other {
            line: text.to_owned(),
        }))
    }
}

/// The `key=value` fields of a `VMCHECK` line.
struct Fields<'a>(HashMap<&'a str, &'a str>);

impl Fields<'_> {
    fn num(&self, key: &str) -> Option<u64> {
        parse_u64(self.0.get(key)?)
    }

    fn ready(&self) -> Option<VmcheckLine> {
        let rate_mibs = match *self.0.get("rate_mibs")? {
            "max" => Rate::Max,
            v => Rate::MibPerSec(parse_u64(v)?),
        };
        Some(VmcheckLine::Ready {
            ws_mib: self.num("ws_mib")?,
            rate_mibs,
        })
    }

    fn report(&self) -> Option<VmcheckLine> {
        Some(VmcheckLine::Report {
            t_ms: self.num("t_ms")?,
            gen: self.num("gen")?,
            pages: self.num("pages")?,
            mibs: self.0.get("mibs")?.parse().ok()?,
            max_gap_us: self.num("max_gap_us")?,
            mismatches: self.num("mismatches")?,
        })
    }

    fn mismatch(&self) -> Option<VmcheckLine> {
        Some(VmcheckLine::Mismatch {
            page: self.num("page")?,
            word: self.num("word")?,
            want: self.num("want")?,
            got: self.num("got")?,
        })
    }

    fn done(&self) -> Option<VmcheckLine> {
        Some(VmcheckLine::Done {
            pages: self.num("pages")?,
            mismatches: self.num("mismatches")?,
        })
    }
}

/// A decimal number, or a hex one with `0x`.
fn parse_u64(text: &str) -> Option<u64> {
    match text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => text.parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vmcheck_lines() {
        use VmcheckLine::*;
        let p = |l: &str| VmcheckLine::parse(l).unwrap();
        assert_eq!(
            p("VMCHECK ready ws_mib=16 rate_mibs=32"),
            Ready {
                ws_mib: 16,
                rate_mibs: Rate::MibPerSec(32)
            }
        );
        assert_eq!(
            p("VMCHECK ready ws_mib=64 rate_mibs=max seed=7"),
            Ready {
                ws_mib: 64,
                rate_mibs: Rate::Max
            }
        );
        assert_eq!(
            p("VMCHECK t_ms=1500 gen=3 pages=12288 mibs=31.9 max_gap_us=812 mismatches=0"),
            Report {
                t_ms: 1500,
                gen: 3,
                pages: 12288,
                mibs: 31.9,
                max_gap_us: 812,
                mismatches: 0
            }
        );
        assert_eq!(
            p("VMCHECK MISMATCH page=17 word=0 want=0x9e3779b97f4a7c15 got=0x0"),
            Mismatch {
                page: 17,
                word: 0,
                want: 0x9e37_79b9_7f4a_7c15,
                got: 0
            }
        );
        assert_eq!(
            p("VMCHECK done pages=4096 mismatches=0"),
            Done {
                pages: 4096,
                mismatches: 0
            }
        );
    }

    #[test]
    fn vmcheck_lines_tolerate_additions_and_show_the_rest() {
        use VmcheckLine::*;
        let p = |l: &str| VmcheckLine::parse(l).unwrap();
        // A later field, a kernel message's end before it, trailing blanks.
        let report =
            "[ 3.1] x VMCHECK t_ms=1 gen=0 pages=1 mibs=0 max_gap_us=5 mismatches=2 disk_seq=4  ";
        assert!(matches!(p(report), Report { mismatches: 2, .. }));
        // Unknown kinds and missing or bad fields are kept as they are.
        let other = |line: &str| Other { line: line.into() };
        assert_eq!(p("VMCHECK hello world=1"), other("VMCHECK hello world=1"));
        assert_eq!(
            p("VMCHECK done pages=4096"),
            other("VMCHECK done pages=4096")
        );
        assert_eq!(
            p("VMCHECK ready ws_mib=x rate_mibs=1"),
            other("VMCHECK ready ws_mib=x rate_mibs=1")
        );
        assert_eq!(
            VmcheckLine::parse("[    0.000000] Linux version 6.12.95"),
            None
        );
        assert_eq!(VmcheckLine::parse("VMCHECKready"), None);
    }
}
