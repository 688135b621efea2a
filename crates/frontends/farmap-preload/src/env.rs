//! The environment `farmap run` sets, read from the `envp` the dynamic loader passes to
//! `.init_array` functions (never `std::env`, which allocates).

use core::ffi::{c_char, CStr};

use farmap_run_proto::TOKEN_LEN;

/// Path of the Unix stream socket to connect to; none: plain mode.
pub(crate) const SOCK: &[u8] = b"FARMAP_RUN_SOCK";
/// The session token, 64 hex digits.
pub(crate) const TOKEN: &[u8] = b"FARMAP_RUN_TOKEN";
/// `1`: a failed handshake falls back to plain memory instead of exiting.
pub(crate) const OPTIONAL: &[u8] = b"FARMAP_RUN_OPTIONAL";
/// `1`: print one stats line on stderr at exit.
pub(crate) const DEBUG: &[u8] = b"FARMAP_PRELOAD_DEBUG";
/// The lowest fd number for the session's long-lived fds (decimal; optional).
pub(crate) const FD_BASE: &[u8] = b"FARMAP_RUN_FD_BASE";
/// Bytes of heap in use at which the session opens (decimal; unset or 0: at start-up).
pub(crate) const OPEN_AT: &[u8] = b"FARMAP_RUN_OPEN_AT";

/// What the environment asks of this library.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Settings {
    /// `FARMAP_RUN_SOCK`.
    pub(crate) sock: Option<&'static CStr>,
    /// `FARMAP_RUN_TOKEN` as it is (parsed by [`parse_token`]).
    pub(crate) token: Option<&'static [u8]>,
    /// `FARMAP_RUN_OPTIONAL=1`.
    pub(crate) optional: bool,
    /// `FARMAP_PRELOAD_DEBUG=1`.
    pub(crate) debug: bool,
    /// `FARMAP_RUN_FD_BASE`, if it is a number from 3 to 1,000,000.
    pub(crate) fd_base: Option<i32>,
    /// `FARMAP_RUN_OPEN_AT`, if it is a decimal number of bytes (0 when unset or not one).
    pub(crate) open_at: u64,
}

/// The value of `name` in one `NAME=value` entry.
pub(crate) fn value_of<'a>(entry: &'a [u8], name: &[u8]) -> Option<&'a [u8]> {
    let rest = entry.strip_prefix(name)?;
    rest.strip_prefix(b"=")
}

/// The settings in `envp` (a null-terminated array of `NAME=value` strings, or null).
///
/// # Safety
/// `envp` is null or the process's environment array, whose strings live (unchanged) for
/// the rest of the process, as the loader's are.
pub(crate) unsafe fn read(envp: *const *const c_char) -> Settings {
    let mut s = Settings::default();
    if envp.is_null() {
        return s;
    }
    let mut i = 0;
    loop {
        // SAFETY: the array is null-terminated (the caller's contract); `i` stops at the null.
        let entry = unsafe { *envp.add(i) };
        if entry.is_null() {
            return s;
        }
        i += 1;
        // SAFETY: a NUL-terminated string of the environment that lives for the process.
        let entry: &'static CStr = unsafe { CStr::from_ptr(entry) };
        let bytes = entry.to_bytes();
        if let Some(v) = value_of(bytes, SOCK) {
            // The value is the entry's tail, NUL-terminated with it.
            let tail = &entry.to_bytes_with_nul()[bytes.len() - v.len()..];
            s.sock = CStr::from_bytes_with_nul(tail)
                .ok()
                .filter(|c| !c.is_empty());
        } else if let Some(v) = value_of(bytes, TOKEN) {
            s.token = Some(v);
        } else if let Some(v) = value_of(bytes, OPTIONAL) {
            s.optional = v == b"1";
        } else if let Some(v) = value_of(bytes, DEBUG) {
            s.debug = v == b"1";
        } else if let Some(v) = value_of(bytes, FD_BASE) {
            s.fd_base = parse_fd_base(v);
        } else if let Some(v) = value_of(bytes, OPEN_AT) {
            s.open_at = parse_bytes(v).unwrap_or(0);
        }
    }
}

/// An fd number from 3 to 1,000,000, in decimal.
pub(crate) fn parse_fd_base(v: &[u8]) -> Option<i32> {
    if v.is_empty() || v.len() > 7 || !v.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let n = v.iter().fold(0i32, |n, d| n * 10 + i32::from(d - b'0'));
    (3..=1_000_000).contains(&n).then_some(n)
}

/// A byte count in decimal, at most 2^50.
pub(crate) fn parse_bytes(v: &[u8]) -> Option<u64> {
    if v.is_empty() || v.len() > 16 || !v.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let n = v.iter().fold(0u64, |n, d| n * 10 + u64::from(d - b'0'));
    (n <= 1 << 50).then_some(n)
}

/// A token from exactly 64 hex digits (either case).
pub(crate) fn parse_token(hex: &[u8]) -> Option<[u8; TOKEN_LEN]> {
    if hex.len() != 2 * TOKEN_LEN {
        return None;
    }
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    };
    let mut out = [0u8; TOKEN_LEN];
    for (i, pair) in hex.chunks_exact(2).enumerate() {
        out[i] = (digit(pair[0])? << 4) | digit(pair[1])?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_64_hex_digits() {
        let hex = format!("00fF10Ab{}01", "0".repeat(54));
        let hex = hex.as_bytes();
        let t = parse_token(hex).unwrap();
        assert_eq!(&t[..4], &[0x00, 0xff, 0x10, 0xab]);
        assert_eq!(t[31], 0x01);
        assert_eq!(parse_token(&hex[..63]), None, "too short");
        assert_eq!(parse_token(b""), None);
        let mut long = hex.to_vec();
        long.extend_from_slice(b"00");
        assert_eq!(parse_token(&long), None, "too long");
        let mut bad = hex.to_vec();
        bad[10] = b'g';
        assert_eq!(parse_token(&bad), None, "not hex");
        bad[10] = b' ';
        assert_eq!(parse_token(&bad), None, "space");
    }

    #[test]
    fn fd_bases_are_small_decimal_numbers() {
        assert_eq!(parse_fd_base(b"900"), Some(900));
        assert_eq!(parse_fd_base(b"3"), Some(3));
        assert_eq!(parse_fd_base(b"2"), None);
        assert_eq!(parse_fd_base(b""), None);
        assert_eq!(parse_fd_base(b"-5"), None);
        assert_eq!(parse_fd_base(b"9x"), None);
        assert_eq!(parse_fd_base(b"1000001"), None);
        assert_eq!(parse_fd_base(b"99999999999"), None);
    }

    #[test]
    fn byte_counts_are_decimal_and_bounded() {
        assert_eq!(parse_bytes(b"1048576"), Some(1 << 20));
        assert_eq!(parse_bytes(b"0"), Some(0));
        assert_eq!(parse_bytes(b""), None);
        assert_eq!(parse_bytes(b"1MiB"), None);
        assert_eq!(parse_bytes(b"-1"), None);
        assert_eq!(parse_bytes(b"99999999999999999"), None);
        assert_eq!(parse_bytes(b"9999999999999999"), None, "above 2^50");
    }

    #[test]
    fn entries_match_whole_names() {
        assert_eq!(value_of(b"FARMAP_RUN_SOCK=/a/b", SOCK), Some(&b"/a/b"[..]));
        assert_eq!(value_of(b"FARMAP_RUN_SOCK=", SOCK), Some(&b""[..]));
        assert_eq!(value_of(b"FARMAP_RUN_SOCKET=/a", SOCK), None);
        assert_eq!(value_of(b"XFARMAP_RUN_SOCK=/a", SOCK), None);
        assert_eq!(value_of(b"FARMAP_RUN_SOCK", SOCK), None);
    }

    #[test]
    fn the_environment_array_is_read_to_its_end() {
        let entries: Vec<std::ffi::CString> = [
            "PATH=/bin",
            "FARMAP_RUN_SOCK=/tmp/x/s",
            "FARMAP_RUN_TOKEN=abc",
            "FARMAP_RUN_OPTIONAL=1",
            "FARMAP_PRELOAD_DEBUG=0",
        ]
        .iter()
        .map(|s| std::ffi::CString::new(*s).unwrap())
        .collect();
        let entries: &'static [std::ffi::CString] = Box::leak(entries.into_boxed_slice());
        let mut ptrs: Vec<*const c_char> = entries.iter().map(|c| c.as_ptr()).collect();
        ptrs.push(core::ptr::null());
        // SAFETY: a null-terminated array of leaked (hence 'static) strings.
        let s = unsafe { read(ptrs.as_ptr()) };
        assert_eq!(s.sock.unwrap().to_bytes(), b"/tmp/x/s");
        assert_eq!(s.token, Some(&b"abc"[..]));
        assert!(s.optional);
        assert!(!s.debug);
        // SAFETY: null is allowed.
        let none = unsafe { read(core::ptr::null()) };
        assert!(none.sock.is_none() && !none.optional);
    }
}
