//! The process image: an object's memory may point into the executable (hashbrown's empty
//! table points its control bytes at a `static`), so every process of an arena runs the same
//! executable at the same address: address-space randomization off
//! ([`ensure_fixed_image`]) and the same build ([`BuildId`]).

use std::ffi::OsString;
use std::io;
use std::os::unix::fs::FileExt;
use std::os::unix::process::CommandExt;

use crate::error::ArenaError;

/// `ADDR_NO_RANDOMIZE` of `personality(2)`.
const ADDR_NO_RANDOMIZE: libc::c_ulong = 0x0040000;
/// `personality(0xffffffff)` reads the persona without changing it.
const QUERY: libc::c_ulong = 0xffff_ffff;
/// Set in the environment of the one re-execution, so that a kernel that ignores the flag
/// gives an error rather than a loop.
const REEXEC_ENV: &str = "FARMAP_ARENA_REEXEC";

/// Whether this process runs with address-space randomization off (`setarch -R`), so that
/// its executable and libraries sit where they sit in every other such process.
pub fn fixed_image() -> bool {
    persona().is_ok_and(|p| p & ADDR_NO_RANDOMIZE != 0)
}

fn persona() -> io::Result<libc::c_ulong> {
    // SAFETY: personality(2) with the query value changes nothing and touches no memory.
    let p = unsafe { libc::personality(QUERY) };
    if p < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(p as libc::c_ulong)
}

/// Makes sure this process runs with address-space randomization off: if it does not,
/// turns it off and executes `/proc/self/exe` again with the same arguments and
/// environment (what `setarch -R` does), so this returns only when the image is fixed or
/// on an error. Call it first thing in `main`, before threads are started.
///
/// The cost is ASLR for this program: its executable, libraries and stacks sit at the same
/// addresses in every run.
pub fn ensure_fixed_image() -> Result<(), ArenaError> {
    if fixed_image() {
        return Ok(());
    }
    let io_err = |what, source| ArenaError::Io { what, source };
    if std::env::var_os(REEXEC_ENV).is_some() {
        return Err(io_err(
            "turning address-space randomization off",
            io::Error::other("the kernel ignored ADDR_NO_RANDOMIZE across exec"),
        ));
    }
    let p = persona().map_err(|e| io_err("reading the personality", e))?;
    // SAFETY: personality(2) sets a flag of this process's persona; no memory is touched.
    if unsafe { libc::personality(p | ADDR_NO_RANDOMIZE) } < 0 {
        return Err(io_err(
            "setting ADDR_NO_RANDOMIZE",
            io::Error::last_os_error(),
        ));
    }
    let mut args = std::env::args_os();
    let argv0 = args.next().unwrap_or_else(|| OsString::from("farmap"));
    let err = std::process::Command::new("/proc/self/exe")
        .arg0(argv0)
        .args(args)
        .env(REEXEC_ENV, "1")
        .exec();
    Err(io_err("executing /proc/self/exe again without ASLR", err))
}

/// Which build of which executable a process runs: the ELF build id (`NT_GNU_BUILD_ID`),
/// or an XXH3-128 of the executable when it has none. Processes of one arena must agree.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BuildId(pub [u8; 32]);

impl BuildId {
    /// This process's executable's.
    pub fn of_self() -> Result<BuildId, ArenaError> {
        let file = std::fs::File::open("/proc/self/exe").map_err(|source| ArenaError::Io {
            what: "opening /proc/self/exe",
            source,
        })?;
        let read = |what| move |source| ArenaError::Io { what, source };
        match elf_build_id(&file).map_err(read("reading the executable's ELF notes"))? {
            Some(id) => Ok(id),
            None => {
                let bytes =
                    std::fs::read("/proc/self/exe").map_err(read("reading the executable"))?;
                let mut id = [0u8; 32];
                id[..16].copy_from_slice(&xxhash_rust::xxh3::xxh3_128(&bytes).to_be_bytes());
                id[31] = 0x7f; // not a build id: a hash of the file
                Ok(BuildId(id))
            }
        }
    }
}

impl std::fmt::Display for BuildId {
    /// Hexadecimal, without the zero padding after a shorter id (SHA-1 ids are 20 bytes).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let len = self.0.iter().rposition(|b| *b != 0).map_or(0, |i| i + 1);
        self.0[..len].iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

/// The `NT_GNU_BUILD_ID` note of a 64-bit little-endian ELF file, if it has one.
fn elf_build_id(file: &std::fs::File) -> io::Result<Option<BuildId>> {
    const PT_NOTE: u32 = 4;
    const NT_GNU_BUILD_ID: u32 = 3;
    const MAX_PHDRS: usize = 256;
    const MAX_NOTES: usize = 64 << 10;
    let mut eh = [0u8; 64];
    file.read_exact_at(&mut eh, 0)?;
    if &eh[..4] != b"\x7fELF" || eh[4] != 2 || eh[5] != 1 {
        return Ok(None); // not ELF64 little-endian
    }
    let u16_at = |b: &[u8], o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
    let u32_at = |b: &[u8], o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
    let u64_at = |b: &[u8], o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
    let phoff = u64_at(&eh, 0x20);
    let phentsize = usize::from(u16_at(&eh, 0x36));
    let phnum = usize::from(u16_at(&eh, 0x38)).min(MAX_PHDRS);
    if phentsize < 56 {
        return Ok(None);
    }
    let mut ph = vec![0u8; phentsize * phnum];
    file.read_exact_at(&mut ph, phoff)?;
    for h in ph.chunks_exact(phentsize) {
        if u32_at(h, 0) != PT_NOTE {
            continue;
        }
        let (off, len) = (u64_at(h, 8), (u64_at(h, 32) as usize).min(MAX_NOTES));
        let mut notes = vec![0u8; len];
        file.read_exact_at(&mut notes, off)?;
        let mut at = 0;
        while at + 12 <= notes.len() {
            let namesz = u32_at(&notes, at) as usize;
            let descsz = u32_at(&notes, at + 4) as usize;
            let kind = u32_at(&notes, at + 8);
            let name_at = at + 12;
            let desc_at = name_at + namesz.next_multiple_of(4);
            let end = desc_at.saturating_add(descsz.next_multiple_of(4));
            if end > notes.len() {
                break;
            }
            if kind == NT_GNU_BUILD_ID && notes[name_at..name_at + namesz] == *b"GNU\0" {
                let mut id = [0u8; 32];
                let n = descsz.min(32);
                id[..n].copy_from_slice(&notes[desc_at..desc_at + n]);
                return Ok(Some(BuildId(id)));
            }
            at = end;
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_test_binary_has_a_stable_build_id() {
        let a = BuildId::of_self().unwrap();
        assert_eq!(a, BuildId::of_self().unwrap());
        assert_ne!(a.0, [0u8; 32]);
        assert!(!a.to_string().is_empty());
    }
}
