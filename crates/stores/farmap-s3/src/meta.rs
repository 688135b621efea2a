//! The region description object, `<prefix>/farmap-meta`: written when a region is created,
//! read (and checked against the spec) on every later open, so that `farmap info s3://...`
//! needs no `size=`.
//!
//! It is a few lines of text:
//! ```text
//! farmap-s3 region 1
//! size=268435456
//! chunk=65536
//! ```
//! The first line names the format and its version; a reader refuses any other first line,
//! a key it does not know, a missing or repeated key, and a geometry farmap would not create.

use farmap_core::Geometry;

/// The object's name under the prefix. It starts with a letter, so it sorts after every chunk
/// object (whose names are digits) and cannot be taken for one.
pub const META_NAME: &str = "farmap-meta";

/// The largest description object read (a real one is about 50 bytes).
pub const MAX_META_LEN: u64 = 4096;

const HEADER: &str = "farmap-s3 region 1";

/// The description of `g`.
pub(crate) fn encode(g: Geometry) -> String {
    format!("{HEADER}\nsize={}\nchunk={}\n", g.size(), g.chunk_size())
}

/// The geometry a description gives, or why it is not one.
pub(crate) fn decode(bytes: &[u8]) -> Result<Geometry, String> {
    let text = std::str::from_utf8(bytes).map_err(|_| "it is not UTF-8 text".to_owned())?;
    let mut lines = text.lines();
    match lines.next() {
        Some(HEADER) => {}
        Some(other) => {
            return Err(format!(
                "its first line is {:?}, not {HEADER:?}",
                other.chars().take(40).collect::<String>()
            ))
        }
        None => return Err("it is empty".to_owned()),
    }
    let (mut size, mut chunk) = (None, None);
    for line in lines.filter(|l| !l.is_empty()) {
        let (key, value) = line
            .split_once('=')
            .ok_or_else(|| format!("line {line:?} is not key=value"))?;
        let slot = match key {
            "size" => &mut size,
            "chunk" => &mut chunk,
            _ => return Err(format!("unknown key {key:?}")),
        };
        if slot.is_some() {
            return Err(format!("{key} is given twice"));
        }
        *slot = Some(
            value
                .parse::<u64>()
                .map_err(|_| format!("{key}={value:?} is not a whole number"))?,
        );
    }
    let size = size.ok_or("it has no size")?;
    let chunk = chunk.ok_or("it has no chunk")?;
    Geometry::new_bounded(size, chunk).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        for g in [
            Geometry::new(256 << 20, 65536).unwrap(),
            Geometry::new(7 * 4096 + 1000, 4096).unwrap(),
        ] {
            let text = encode(g);
            assert!(text.len() as u64 <= MAX_META_LEN);
            assert_eq!(decode(text.as_bytes()), Ok(g));
        }
    }

    #[test]
    fn refuses_what_it_does_not_understand() {
        for (text, want) in [
            ("", "empty"),
            ("farmap-s3 region 2\nsize=1\nchunk=4096\n", "first line"),
            ("farmap-s3 region 1\nsize=4096\n", "no chunk"),
            ("farmap-s3 region 1\nchunk=4096\n", "no size"),
            (
                "farmap-s3 region 1\nsize=4096\nsize=4096\nchunk=4096",
                "twice",
            ),
            (
                "farmap-s3 region 1\nsize=4096\nchunk=4096\ncolor=red",
                "unknown key",
            ),
            (
                "farmap-s3 region 1\nsize=-1\nchunk=4096",
                "not a whole number",
            ),
            ("farmap-s3 region 1\nsize=4096\nchunk=3000", "power of two"),
            (
                "farmap-s3 region 1\nsize=0\nchunk=4096",
                "greater than zero",
            ),
            ("farmap-s3 region 1\nsize 4096", "not key=value"),
        ] {
            let e = decode(text.as_bytes()).expect_err(text);
            assert!(e.contains(want), "{text:?}: {e}");
        }
        assert!(decode(&[0xff, 0xfe]).unwrap_err().contains("UTF-8"));
    }
}
