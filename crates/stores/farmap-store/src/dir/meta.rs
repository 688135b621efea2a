//! The metadata file of a [`DirStore`](super::DirStore): what region the directory holds.

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::Path;

use farmap_core::{format_size, ErrorKind, Geometry, StoreError, StoreResult};

/// Name of the metadata file in the store's directory.
pub(super) const META_FILE: &str = "farmap-dir.meta";
/// Name the metadata file is written under before being renamed into place.
pub(super) const META_TEMP: &str = "farmap-dir.meta.tmp";
/// First line of the metadata file: format name and version.
const MAGIC: &str = "farmap-dir 1";

/// The region a directory holds, as its metadata file says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Meta {
    pub(super) size: u64,
    pub(super) chunk_size: u64,
}

impl Meta {
    /// The file's text: `farmap-dir 1`, then `size=` and `chunk=` lines.
    pub(super) fn render(&self) -> String {
        format!("{MAGIC}\nsize={}\nchunk={}\n", self.size, self.chunk_size)
    }

    /// Reads the text of a metadata file; the error is a sentence saying what is wrong.
    pub(super) fn parse(text: &str) -> Result<Meta, String> {
        let mut lines = text.lines();
        match lines.next() {
            Some(MAGIC) => {}
            Some(l) if l.starts_with("farmap-dir ") => {
                return Err(format!("has unsupported format version {l:?}"))
            }
            _ => return Err(format!("does not start with {MAGIC:?}")),
        }
        let (mut size, mut chunk_size) = (None, None);
        for line in lines.filter(|l| !l.trim().is_empty()) {
            let (key, value) = line
                .split_once('=')
                .ok_or_else(|| format!("has a line without '=': {line:?}"))?;
            let value: u64 = value
                .trim()
                .parse()
                .map_err(|_| format!("has a non-numeric value in {line:?}"))?;
            let slot = match key.trim() {
                "size" => &mut size,
                "chunk" => &mut chunk_size,
                _ => return Err(format!("has an unknown key in {line:?}")),
            };
            if slot.replace(value).is_some() {
                return Err(format!("repeats the key in {line:?}"));
            }
        }
        Ok(Meta {
            size: size.ok_or("has no size= line")?,
            chunk_size: chunk_size.ok_or("has no chunk= line")?,
        })
    }

    /// The geometry this metadata describes.
    pub(super) fn geometry(&self) -> Result<Geometry, farmap_core::GeometryError> {
        Geometry::new(self.size, self.chunk_size)
    }

    /// Refuses a size or chunk size asked for that disagrees with this metadata, naming both.
    pub(super) fn check_matches(
        &self,
        dir: &Path,
        size: Option<u64>,
        chunk_size: Option<u32>,
    ) -> StoreResult<()> {
        if let Some(size) = size.filter(|&s| s != self.size) {
            return Err(StoreError::invalid(format!(
                "{} holds a region of size={} but size={} was asked for",
                dir.display(),
                format_size(self.size),
                format_size(size)
            )));
        }
        if let Some(chunk) = chunk_size.filter(|&c| u64::from(c) != self.chunk_size) {
            return Err(StoreError::invalid(format!(
                "{} holds chunks of {} but chunk={} was asked for",
                dir.display(),
                format_size(self.chunk_size),
                format_size(u64::from(chunk))
            )));
        }
        Ok(())
    }
}

/// Reads `dir`'s metadata file; `None` when there is none.
pub(super) fn read(dir: &Path) -> StoreResult<Option<Meta>> {
    let path = dir.join(META_FILE);
    let text = match fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(StoreError::io(format!("cannot read {}", path.display()), e)),
    };
    Meta::parse(&text)
        .map(Some)
        .map_err(|why| StoreError::new(ErrorKind::Corrupt, format!("{} {why}", path.display())))
}

/// Writes `dir`'s metadata file atomically: a temporary file, synced, renamed into place, and
/// the directory synced, so a crash leaves either no metadata or all of it.
pub(super) fn write(dir: &Path, meta: &Meta) -> StoreResult<()> {
    let temp = dir.join(META_TEMP);
    let path = dir.join(META_FILE);
    let err = |e| StoreError::io(format!("cannot write {}", path.display()), e);
    let mut f = File::create(&temp).map_err(err)?;
    f.write_all(meta.render().as_bytes()).map_err(err)?;
    f.sync_all().map_err(err)?;
    fs::rename(&temp, &path).map_err(err)?;
    sync_dir(dir)
}

/// Makes the entries of directory `dir` (creations, renames, removals) durable.
pub(super) fn sync_dir(dir: &Path) -> StoreResult<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| StoreError::io(format!("cannot sync directory {}", dir.display()), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_refusals() {
        let m = Meta {
            size: 1 << 30,
            chunk_size: 65536,
        };
        assert_eq!(Meta::parse(&m.render()), Ok(m));
        assert_eq!(
            Meta::parse("farmap-dir 1\nchunk=4096\n\nsize=8192\n"),
            Ok(Meta {
                size: 8192,
                chunk_size: 4096
            })
        );
        for bad in [
            "",
            "farmap-dir 2\nsize=1\nchunk=4096\n",
            "something else\n",
            "farmap-dir 1\nsize=1\n",
            "farmap-dir 1\nsize=x\nchunk=4096\n",
            "farmap-dir 1\nsize=1\nsize=2\nchunk=4096\n",
            "farmap-dir 1\nsize=1\nchunk=4096\ncolour=blue\n",
        ] {
            assert!(Meta::parse(bad).is_err(), "{bad:?} must be refused");
        }
    }

    /// The `dir_meta` fuzz target's property on a few awkward inputs.
    #[test]
    fn fuzz_entry_accepts_anything_without_panicking() {
        for data in [
            &b""[..],
            b"farmap-dir 1\nsize=0\nchunk=0\n",
            b"farmap-dir 1\nsize=18446744073709551615\nchunk=4096\n",
            b"farmap-dir 1\n size = 1 \n chunk = 4096 \n",
            b"farmap-dir 1\r\nsize=1\r\nchunk=4096\r\n",
            b"\xff\xfe",
        ] {
            crate::fuzz_dir_meta(data);
        }
    }

    #[test]
    fn conflicts_name_both_values() {
        let m = Meta {
            size: 1 << 30,
            chunk_size: 65536,
        };
        let dir = Path::new("/data/region");
        assert!(m.check_matches(dir, Some(1 << 30), Some(65536)).is_ok());
        assert!(m.check_matches(dir, None, None).is_ok());
        let e = m.check_matches(dir, Some(2 << 30), None).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput);
        assert_eq!(
            e.context(),
            "/data/region holds a region of size=1GiB but size=2GiB was asked for"
        );
        let e = m.check_matches(dir, None, Some(4096)).unwrap_err();
        assert!(e.context().contains("64KiB") && e.context().contains("chunk=4KiB"));
    }
}
