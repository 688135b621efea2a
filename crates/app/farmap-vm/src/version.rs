//! A QEMU version: from the QMP greeting, or from `qemu-system-x86_64 --version`.

use std::fmt;

/// A QEMU release, `major.minor.micro` (`7.2.22`). Ordered, so `v >= QemuVersion::new(8, 1, 0)`
/// reads as "8.1 or later".
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct QemuVersion {
    /// The major number (7 in 7.2.22).
    pub major: u32,
    /// The minor number (2 in 7.2.22).
    pub minor: u32,
    /// The micro number (22 in 7.2.22).
    pub micro: u32,
}

impl QemuVersion {
    /// The version `major.minor.micro`.
    pub const fn new(major: u32, minor: u32, micro: u32) -> Self {
        Self {
            major,
            minor,
            micro,
        }
    }

    /// Reads the first line of `qemu-system-* --version`:
    /// `QEMU emulator version 7.2.22 (Debian 1:7.2+dfsg-7+deb12u18+b3)`. A missing micro
    /// number (`8.0`) reads as 0. `None` when the text does not start that way.
    pub fn parse_banner(text: &str) -> Option<Self> {
        let line = text.lines().next()?.trim();
        let rest = line.strip_prefix("QEMU emulator version ")?;
        let number = rest.split_whitespace().next()?;
        Self::parse(number)
    }

    /// Reads `7.2.22` or `8.0` (micro 0). Trailing text after the numbers (`7.2.22-rc1`) is
    /// not accepted.
    pub fn parse(number: &str) -> Option<Self> {
        let mut parts = number.split('.');
        let major = parts.next()?.parse().ok()?;
        let minor = parts.next()?.parse().ok()?;
        let micro = match parts.next() {
            Some(p) => p.parse().ok()?,
            None => 0,
        };
        if parts.next().is_some() {
            return None;
        }
        Some(Self::new(major, minor, micro))
    }
}

impl fmt::Display for QemuVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.micro)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn banner_of_debian_bookworm() {
        let out = "QEMU emulator version 7.2.22 (Debian 1:7.2+dfsg-7+deb12u18+b3)\n\
                   Copyright (c) 2003-2022 Fabrice Bellard and the QEMU Project developers\n";
        let v = QemuVersion::parse_banner(out).unwrap();
        assert_eq!(v, QemuVersion::new(7, 2, 22));
        assert_eq!(v.to_string(), "7.2.22");
        assert!(v < QemuVersion::new(8, 1, 0));
    }

    #[test]
    fn short_and_bad_versions() {
        assert_eq!(QemuVersion::parse("8.0"), Some(QemuVersion::new(8, 0, 0)));
        assert_eq!(
            QemuVersion::parse_banner("QEMU emulator version 10.0.2\n"),
            Some(QemuVersion::new(10, 0, 2))
        );
        assert_eq!(QemuVersion::parse("7.2.22-rc1"), None);
        assert_eq!(QemuVersion::parse("7"), None);
        assert_eq!(QemuVersion::parse("7.2.22.1"), None);
        assert_eq!(QemuVersion::parse_banner("qemu-img version 7.2.22"), None);
    }
}
