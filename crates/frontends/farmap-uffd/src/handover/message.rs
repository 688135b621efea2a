//! The hand-over messages, version 1. No I/O here: encoding, decoding and limits.
//!
//! **Hello** (owner → handler), sent with `sendmsg`; its first bytes carry two file
//! descriptors as `SCM_RIGHTS`: the region's userfaultfd, then the owner's
//! `/proc/<pid>/pagemap` (the handler uses it to check whether a faulted page is really
//! missing). All integers little-endian.
//!
//! ```text
//! offset size field
//!      0    8 magic            "FARMAPUF"
//!      8    2 version          1 (0 is never valid)
//!     10    2 header length    64 (a later version may append fields; readers skip them)
//!     12    4 flags            bit 0: the handler runs a background pull
//!     16    8 base             the region's address in the owner
//!     24    8 length           bytes (a multiple of the page size)
//!     32    4 page size        must equal the handler's
//!     36    4 chunk size       a power of two from 4 KiB to 4 MiB, at least a page
//!     40    8 features         the UFFD_FEATURE_* bits enabled on the fd
//!     48    4 spec length S    at most 4096
//!     52    4 bitmap length B  exactly ceil(chunks / 8)
//!     56    1 fd count         2
//!     57    7 reserved         zero
//!     64    S store spec       UTF-8, e.g. "file:/data/disk.img?chunk=64KiB"
//!   64+S    B presence bitmap  bit i % 8 of byte i / 8: chunk i is fully installed
//! ```
//!
//! **Reply** (handler → owner), 16 bytes once the handler serves faults, or refuses:
//! magic "FARMAPOK", version u16, status u16 (0 serving, else a [`Refusal`] code), 4 bytes
//! reserved.
//!
//! Afterwards the owner may send one byte, `S`, to ask the handler to stop; the handler
//! stops reading faults and closes its end. The owner takes over when the socket reaches
//! end-of-file, whether the handler stopped or died.

use std::fmt;

use farmap_core::Geometry;

/// First bytes of a hello.
pub const HELLO_MAGIC: [u8; 8] = *b"FARMAPUF";
/// First bytes of a reply.
pub const REPLY_MAGIC: [u8; 8] = *b"FARMAPOK";
/// The version this code writes and reads.
pub const VERSION: u16 = 1;
/// Length of a version-1 hello header.
pub const HEADER_LEN: usize = 64;
/// Length of a reply.
pub const REPLY_LEN: usize = 16;
/// The end of the largest user address space (five-level paging).
const MAX_USER_ADDRESS: u64 = 1 << 57;
/// Longest store spec accepted.
pub const MAX_SPEC_LEN: usize = 4096;
/// Largest presence bitmap accepted (2^27 chunks: 8 PiB of 64 KiB chunks).
pub const MAX_BITMAP_LEN: usize = 16 << 20;
/// File descriptors sent with a hello.
pub const FD_COUNT: u8 = 2;
/// The one control byte: stop serving.
pub const STOP: u8 = b'S';
/// Hello flag: the handler pulls the absent chunks in the background.
pub const FLAG_PULL: u32 = 1;

/// A decoded hello, without its file descriptors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// `FLAG_*` bits.
    pub flags: u32,
    /// The region's address in the owner.
    pub base: u64,
    /// The region's length.
    pub len: u64,
    /// The owner's page size.
    pub page_size: u32,
    /// Chunk size.
    pub chunk_size: u32,
    /// Userfaultfd features enabled.
    pub features: u64,
    /// How to open the store.
    pub spec: String,
    /// One bit per chunk: fully installed.
    pub present: Vec<u8>,
}

/// Why a hello (or reply) is not acceptable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MessageError {
    /// Not a farmap hand-over message.
    #[error("bad magic {0:02x?}")]
    BadMagic([u8; 8]),
    /// A version this code does not speak (0 is never valid).
    #[error("unsupported version {0} (this side speaks {VERSION})")]
    BadVersion(u16),
    /// A field out of its limits.
    #[error("bad {field}: {value}")]
    BadField {
        /// Which field.
        field: &'static str,
        /// Its value.
        value: u64,
    },
    /// The spec is not UTF-8.
    #[error("the store spec is not UTF-8")]
    SpecNotUtf8,
}

/// Why a handler refused a region (the reply's status).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refusal {
    /// The hello was malformed or of another version.
    BadHello,
    /// The store could not be opened, or has another shape.
    Store,
    /// The handler could not set itself up (threads, pagemap...).
    Setup,
    /// The owner runs as another user than the handler (which would open the owner's store
    /// with its own privileges).
    Stranger,
    /// A status code this side does not know.
    Other(u16),
}

impl Refusal {
    /// The status code.
    pub fn code(self) -> u16 {
        match self {
            Refusal::BadHello => 1,
            Refusal::Store => 2,
            Refusal::Setup => 3,
            Refusal::Stranger => 4,
            Refusal::Other(c) => c,
        }
    }

    /// The refusal of a status code (0 is not a refusal).
    pub fn from_code(code: u16) -> Option<Refusal> {
        match code {
            0 => None,
            1 => Some(Refusal::BadHello),
            2 => Some(Refusal::Store),
            3 => Some(Refusal::Setup),
            4 => Some(Refusal::Stranger),
            c => Some(Refusal::Other(c)),
        }
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::BadHello => f.write_str("the hello was not understood"),
            Refusal::Store => f.write_str("the store could not be opened as described"),
            Refusal::Setup => f.write_str("the handler could not start"),
            Refusal::Stranger => f.write_str("the handler serves only its own user's regions"),
            Refusal::Other(c) => write!(f, "status {c}"),
        }
    }
}

/// The fixed part of a hello, decoded: the lengths of what follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HelloHeader {
    /// Header length (skip past it to the spec).
    pub header_len: usize,
    /// Spec length.
    pub spec_len: usize,
    /// Bitmap length.
    pub bitmap_len: usize,
    hello: (u32, u64, u64, u32, u32, u64),
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(b[at..at + 2].try_into().expect("2 bytes"))
}
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

impl Hello {
    /// The whole message (header, spec, bitmap).
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(HEADER_LEN + self.spec.len() + self.present.len());
        b.extend_from_slice(&HELLO_MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&(HEADER_LEN as u16).to_le_bytes());
        b.extend_from_slice(&self.flags.to_le_bytes());
        b.extend_from_slice(&self.base.to_le_bytes());
        b.extend_from_slice(&self.len.to_le_bytes());
        b.extend_from_slice(&self.page_size.to_le_bytes());
        b.extend_from_slice(&self.chunk_size.to_le_bytes());
        b.extend_from_slice(&self.features.to_le_bytes());
        b.extend_from_slice(&(self.spec.len() as u32).to_le_bytes());
        b.extend_from_slice(&(self.present.len() as u32).to_le_bytes());
        b.push(FD_COUNT);
        b.extend_from_slice(&[0; 7]);
        debug_assert_eq!(b.len(), HEADER_LEN);
        b.extend_from_slice(self.spec.as_bytes());
        b.extend_from_slice(&self.present);
        b
    }

    /// Decodes and checks the fixed header (the first [`HEADER_LEN`] bytes); every length is
    /// capped before the caller allocates for it.
    pub fn decode_header(b: &[u8; HEADER_LEN]) -> Result<HelloHeader, MessageError> {
        let magic: [u8; 8] = b[0..8].try_into().expect("8 bytes");
        if magic != HELLO_MAGIC {
            return Err(MessageError::BadMagic(magic));
        }
        let version = u16_at(b, 8);
        if version != VERSION {
            return Err(MessageError::BadVersion(version));
        }
        let bad = |field, value: u64| MessageError::BadField { field, value };
        let header_len = usize::from(u16_at(b, 10));
        if !(HEADER_LEN..=4096).contains(&header_len) {
            return Err(bad("header length", header_len as u64));
        }
        let (flags, base, len) = (u32_at(b, 12), u64_at(b, 16), u64_at(b, 24));
        let (page_size, chunk_size, features) = (u32_at(b, 32), u32_at(b, 36), u64_at(b, 40));
        let (spec_len, bitmap_len) = (u32_at(b, 48) as usize, u32_at(b, 52) as usize);
        if b[56] != FD_COUNT {
            return Err(bad("fd count", u64::from(b[56])));
        }
        if !page_size.is_power_of_two() || page_size < 4096 {
            return Err(bad("page size", u64::from(page_size)));
        }
        let geometry = Geometry::new(len, u64::from(chunk_size))
            .map_err(|_| bad("chunk size or length", u64::from(chunk_size)))?;
        if chunk_size < page_size {
            return Err(bad("chunk size", u64::from(chunk_size)));
        }
        if base % u64::from(page_size) != 0 || len % u64::from(page_size) != 0 {
            return Err(bad("alignment of base or length", base));
        }
        // A region lies in a user address space: below 2^57 (five-level paging) and not
        // wrapping, so that `base + len` and every address in it fit a `usize`.
        if base == 0
            || base
                .checked_add(len)
                .is_none_or(|end| end > MAX_USER_ADDRESS)
        {
            return Err(bad("region address", base));
        }
        if spec_len == 0 || spec_len > MAX_SPEC_LEN {
            return Err(bad("spec length", spec_len as u64));
        }
        let want_bitmap = geometry.chunk_count().div_ceil(8);
        if bitmap_len as u64 != want_bitmap || bitmap_len > MAX_BITMAP_LEN {
            return Err(bad("bitmap length", bitmap_len as u64));
        }
        Ok(HelloHeader {
            header_len,
            spec_len,
            bitmap_len,
            hello: (flags, base, len, page_size, chunk_size, features),
        })
    }

    /// The whole hello, from its header and the `spec_len + bitmap_len` bytes after the
    /// header.
    pub fn from_parts(header: &HelloHeader, rest: &[u8]) -> Result<Hello, MessageError> {
        assert_eq!(rest.len(), header.spec_len + header.bitmap_len);
        let (spec, present) = rest.split_at(header.spec_len);
        let spec = std::str::from_utf8(spec).map_err(|_| MessageError::SpecNotUtf8)?;
        let (flags, base, len, page_size, chunk_size, features) = header.hello;
        Ok(Hello {
            flags,
            base,
            len,
            page_size,
            chunk_size,
            features,
            spec: spec.to_owned(),
            present: present.to_vec(),
        })
    }

    /// Whether chunk `i` is fully installed per the bitmap.
    pub fn is_present(&self, i: u64) -> bool {
        self.present
            .get((i / 8) as usize)
            .is_some_and(|b| b & (1 << (i % 8)) != 0)
    }
}

/// A reply: `None` for "serving", or the refusal.
pub fn encode_reply(refusal: Option<Refusal>) -> [u8; REPLY_LEN] {
    let mut b = [0u8; REPLY_LEN];
    b[0..8].copy_from_slice(&REPLY_MAGIC);
    b[8..10].copy_from_slice(&VERSION.to_le_bytes());
    b[10..12].copy_from_slice(&refusal.map_or(0, Refusal::code).to_le_bytes());
    b
}

/// Decodes a reply: `Ok(None)` means the handler serves faults.
pub fn decode_reply(b: &[u8; REPLY_LEN]) -> Result<Option<Refusal>, MessageError> {
    let magic: [u8; 8] = b[0..8].try_into().expect("8 bytes");
    if magic != REPLY_MAGIC {
        return Err(MessageError::BadMagic(magic));
    }
    let version = u16_at(b, 8);
    if version != VERSION {
        return Err(MessageError::BadVersion(version));
    }
    Ok(Refusal::from_code(u16_at(b, 10)))
}

/// Reads `data` as the handler reads a hello (the fixed header, then the spec and the
/// presence bitmap at the header's length) and as the owner reads a reply: neither may
/// panic, and a hello that decodes must encode to bytes that decode to the same hello.
/// Panics (a bug) when that fails. For the fuzz target and its stable-toolchain test; not
/// part of the stable API.
#[doc(hidden)]
pub fn fuzz_hello(data: &[u8]) {
    if let Some(r) = data.get(..REPLY_LEN) {
        let _ = decode_reply(r.try_into().expect("reply length"));
    }
    let Some(h) = data.get(..HEADER_LEN) else {
        return;
    };
    let Ok(header) = Hello::decode_header(h.try_into().expect("header length")) else {
        return;
    };
    let Some(rest) = data
        .get(header.header_len..)
        .and_then(|r| r.get(..header.spec_len + header.bitmap_len))
    else {
        return;
    };
    let Ok(hello) = Hello::from_parts(&header, rest) else {
        return;
    };
    let bytes = hello.encode();
    let again = Hello::decode_header(bytes[..HEADER_LEN].try_into().expect("header length"))
        .expect("an encoded hello's header decodes");
    let back = Hello::from_parts(&again, &bytes[again.header_len..]).expect("it decodes");
    assert_eq!(back, hello, "the hello survives a round trip");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello() -> Hello {
        Hello {
            flags: FLAG_PULL,
            base: 0x7f00_0000_0000,
            len: 1 << 20,
            page_size: 4096,
            chunk_size: 65536,
            features: 0xa008,
            spec: "file:/tmp/x.img".into(),
            present: vec![0b1010_0001, 0x80],
        }
    }

    fn header_of(b: &[u8]) -> [u8; HEADER_LEN] {
        b[..HEADER_LEN].try_into().unwrap()
    }

    #[test]
    fn round_trip() {
        let h = hello();
        let b = h.encode();
        assert_eq!(&b[0..8], b"FARMAPUF");
        assert_eq!(b.len(), HEADER_LEN + 15 + 2);
        let hdr = Hello::decode_header(&header_of(&b)).unwrap();
        assert_eq!((hdr.spec_len, hdr.bitmap_len), (15, 2));
        let back = Hello::from_parts(&hdr, &b[HEADER_LEN..]).unwrap();
        assert_eq!(back, h);
        assert!(back.is_present(0) && back.is_present(5) && back.is_present(15));
        assert!(!back.is_present(1) && !back.is_present(16));
        assert_eq!(decode_reply(&encode_reply(None)).unwrap(), None);
        let r = encode_reply(Some(Refusal::Store));
        assert_eq!(decode_reply(&r).unwrap(), Some(Refusal::Store));
    }

    #[test]
    fn bad_headers_are_refused_before_allocating() {
        let good = hello().encode();
        let mutate = |at: usize, bytes: &[u8]| {
            let mut b = header_of(&good);
            b[at..at + bytes.len()].copy_from_slice(bytes);
            Hello::decode_header(&b)
        };
        assert!(matches!(
            mutate(0, b"NOTFARMA"),
            Err(MessageError::BadMagic(_))
        ));
        assert_eq!(
            mutate(8, &0u16.to_le_bytes()),
            Err(MessageError::BadVersion(0))
        );
        assert_eq!(
            mutate(8, &2u16.to_le_bytes()),
            Err(MessageError::BadVersion(2))
        );
        let field = |r: Result<HelloHeader, MessageError>| match r {
            Err(MessageError::BadField { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        assert_eq!(field(mutate(48, &u32::MAX.to_le_bytes())), "spec length");
        assert_eq!(field(mutate(52, &u32::MAX.to_le_bytes())), "bitmap length");
        assert_eq!(field(mutate(52, &3u32.to_le_bytes())), "bitmap length");
        assert_eq!(
            field(mutate(36, &3000u32.to_le_bytes())),
            "chunk size or length"
        );
        assert_eq!(field(mutate(32, &1000u32.to_le_bytes())), "page size");
        assert_eq!(field(mutate(56, &[1])), "fd count");
        assert_eq!(
            field(mutate(16, &1u64.to_le_bytes())),
            "alignment of base or length"
        );
        // A base near 2^64 (base + len wraps) or past the user address space, or 0.
        for base in [u64::MAX - 4095, 1 << 57, 0] {
            assert_eq!(field(mutate(16, &base.to_le_bytes())), "region address");
        }
        let mut b = good.clone();
        b[HEADER_LEN] = 0xff;
        let hdr = Hello::decode_header(&header_of(&b)).unwrap();
        assert_eq!(
            Hello::from_parts(&hdr, &b[HEADER_LEN..]),
            Err(MessageError::SpecNotUtf8)
        );
    }
}
