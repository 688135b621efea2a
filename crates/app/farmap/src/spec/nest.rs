//! Specs inside specs: `(A)(B)?q` as the stages and the tiered store write their inner
//! specs, and the parse of one inner spec, which must print back to text that still reads
//! inside parentheses.

use super::model::StoreSpec;
use super::registry;

/// How deeply specs may nest (stages and tiers alike).
pub const MAX_DEPTH: usize = 8;

/// Splits `(A)(B)?q` into `["A", "B"]` and `Some("q")`; parentheses nest. The error is the
/// reason, for the caller's own error type.
pub(super) fn groups(rest: &str) -> Result<(Vec<&str>, Option<&str>), String> {
    let mut out = Vec::new();
    let mut s = rest;
    while s.starts_with('(') {
        let (inner, rest) = group(s).ok_or("a '(' is not closed")?;
        out.push(inner);
        s = rest;
    }
    let query = match s {
        "" => None,
        q => Some(
            q.strip_prefix('?')
                .ok_or_else(|| format!("{q:?} after the stores: options go after '?'"))?,
        ),
    };
    Ok((out, query))
}

/// Splits `(A)rest` into `A` and `rest`; `None` when `s` does not start with a closed group.
pub(super) fn group(s: &str) -> Option<(&str, &str)> {
    let body = s.strip_prefix('(')?;
    let end = closing(body)?;
    Some((&body[..end], &body[end + 1..]))
}

/// Where the `)` that closes an already open `(` is in `body`.
fn closing(body: &str) -> Option<usize> {
    let mut depth = 1usize;
    body.char_indices().find_map(|(i, c)| {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            _ => {}
        }
        (depth == 0).then_some(i)
    })
}

/// Whether every `(` in `s` is closed and no `)` closes one that is not open.
fn balanced(s: &str) -> bool {
    let mut depth = 0usize;
    for c in s.chars() {
        match c {
            '(' => depth += 1,
            ')' => match depth.checked_sub(1) {
                Some(d) => depth = d,
                None => return false,
            },
            _ => {}
        }
    }
    depth == 0
}

/// Refuses a spec with inner specs found `depth` deep when that is too deep; the error is
/// the reason.
pub(super) fn check_depth(depth: usize) -> Result<(), String> {
    if depth >= MAX_DEPTH {
        return Err(format!("stages and tiers nest at most {MAX_DEPTH} deep"));
    }
    Ok(())
}

/// Parses `text`, the spec inside a spec found `depth` deep.
pub(super) fn parse_inner(text: &str, depth: usize) -> Result<StoreSpec, InnerError> {
    let spec = registry::parse(text, depth + 1).map_err(InnerError::Spec)?;
    // The inner text is balanced, but what it parses to may not print so (an option given
    // twice keeps the last: `name=a(&name=b)` prints `name=b)`), and the outer spec's text
    // would then read back as something else.
    if !balanced(&spec.render(true)) || !balanced(&spec.render(false)) {
        return Err(InnerError::Reason(format!(
            "({text}) prints as ({}), whose parentheses do not pair: write each option once, \
             with its parentheses paired",
            spec.render(false)
        )));
    }
    Ok(spec)
}

/// Why an inner spec did not parse.
#[derive(Debug)]
pub(super) enum InnerError {
    /// The inner spec's own error.
    Spec(super::model::SpecError),
    /// It would not read back inside parentheses.
    Reason(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_split_and_nest() {
        let (g, q) = groups("(a:(b))(c)?x=1").unwrap();
        assert_eq!(g, ["a:(b)", "c"]);
        assert_eq!(q, Some("x=1"));
        assert!(groups("(a").is_err());
        assert!(groups("(a)x").is_err());
    }

    #[test]
    fn balance() {
        assert!(balanced("a(b(c))d"));
        assert!(!balanced("a)("));
        assert!(!balanced("(a"));
        assert!(!balanced("a)"));
    }

    /// The fuzzer's find: an option given twice inside a tier kept only the last, which
    /// closed a parenthesis the first had opened.
    #[test]
    fn an_inner_spec_that_would_not_read_back_is_refused() {
        let spec = "tier:(farmaps://h:2?ca=a&cert=c&key=k&name=a(farmaps://h:2&name=b)?x)";
        let err = spec.parse::<StoreSpec>().unwrap_err().to_string();
        assert!(err.contains("do not pair"), "{err}");
        let spec = "verified:(farmaps://h:2?ca=a&cert=c&key=k&name=a(&name=b))";
        let err = spec.parse::<StoreSpec>().unwrap_err().to_string();
        assert!(err.contains("do not pair"), "{err}");
    }

    #[test]
    fn nesting_is_bounded() {
        for scheme in ["tier", "verified"] {
            let deep = format!(
                "{}memory:1MiB{}",
                format!("{scheme}:(").repeat(20),
                ")".repeat(20)
            );
            let err = deep.parse::<StoreSpec>().unwrap_err().to_string();
            assert!(err.contains("nest at most"), "{scheme}: {err}");
        }
        let ok = format!("{}memory:1MiB{}", "tier:(".repeat(3), ")".repeat(3));
        ok.parse::<StoreSpec>().unwrap();
    }
}
