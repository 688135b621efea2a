//! `farmap __guest`: the data checks the kernel tests run inside their VM (no Python there).
//!
//! Each writes or checks the deterministic pattern of `farmap::pattern::pattern_bytes(SEED,
//! OFFSET, LEN)` at byte OFFSET of a block device or file, so that the host can check the
//! same bytes in the store afterwards:
//! - `pattern-write` writes with `pwrite` and `fsync`s; `pattern-check` drops the range from
//!   the page cache first (`POSIX_FADV_DONTNEED`), so it reads what the device returns;
//! - `mmap-write` maps the range `MAP_SHARED`, copies the pattern into the mapping and
//!   `msync`s it; `mmap-check` compares through a fresh mapping;
//! - `pattern-write --no-sync` leaves the written pages dirty in the page cache (for tests of
//!   a teardown that must flush them);
//! - `nbd-lib STORE OFFSET LEN SEED` drives the library's kernel NBD client
//!   (`farmap_nbd_kernel::NbdMount`) on STORE: the pattern `SEED` through `map()` (a
//!   `RegionSlice`), read back through the mapping, `open()` and `path()`; the pattern
//!   `SEED + 1` right after it through `open()` with no fsync, read back through `path()`;
//!   then `shutdown()`. (Closing the device's last file writes its page cache back, so the
//!   flush-first teardown is tested by the VM test's `mount --nbd` part, which holds the
//!   device open.)
//!
//! The mapping is a [`SharedMapping`], reached through volatile `RegionSlice` accesses.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use farmap_memory::SharedMapping;
use rustix::fs::{fadvise, Advice};

use farmap_cli_kit::args::parse_size_arg;

/// What `farmap __guest` does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum GuestOp {
    /// Write the pattern with pwrite, then fsync.
    PatternWrite,
    /// Read the range past the page cache and compare it with the pattern.
    PatternCheck,
    /// Write the pattern through a MAP_SHARED mapping, then msync.
    MmapWrite,
    /// Compare the range, read through a MAP_SHARED mapping, with the pattern.
    MmapCheck,
    /// Mount PATH (a store spec) with the library's kernel NBD client and write and check
    /// through its path, file and mapping.
    NbdLib,
}

#[derive(Debug, Args)]
pub struct GuestArgs {
    op: GuestOp,
    /// A block device or a file (created by the write operations when missing).
    path: PathBuf,
    /// Byte offset (binary suffixes allowed: 8MiB).
    #[arg(value_parser = parse_size_arg)]
    offset: u64,
    /// Length in bytes.
    #[arg(value_parser = parse_size_arg)]
    len: u64,
    /// The pattern's seed.
    seed: u64,
    /// pattern-write: no fsync (the pages stay dirty in the page cache).
    #[arg(long)]
    no_sync: bool,
}

/// Bytes written or compared at once.
const STEP: u64 = 1 << 20;

pub fn run(args: GuestArgs) -> anyhow::Result<ExitCode> {
    if args.op == GuestOp::NbdLib {
        nbd_lib(&args)?;
        println!("NbdLib on {}: ok", args.path.display());
        return Ok(ExitCode::SUCCESS);
    }
    let writes = matches!(args.op, GuestOp::PatternWrite | GuestOp::MmapWrite);
    let file = OpenOptions::new()
        .read(true)
        .write(writes || args.op == GuestOp::MmapCheck)
        .create(writes)
        .truncate(false)
        .custom_flags(libc::O_CLOEXEC)
        .open(&args.path)
        .with_context(|| format!("opening {}", args.path.display()))?;
    match args.op {
        GuestOp::PatternWrite => pattern_write(&file, &args)?,
        GuestOp::PatternCheck => pattern_check(&file, &args)?,
        GuestOp::MmapWrite => with_mapping(&file, &args, true)?,
        GuestOp::MmapCheck => with_mapping(&file, &args, false)?,
        GuestOp::NbdLib => unreachable!("handled above"),
    }
    println!(
        "{:?} {} bytes at {} of {} (seed {}): ok",
        args.op,
        args.len,
        args.offset,
        args.path.display(),
        args.seed
    );
    Ok(ExitCode::SUCCESS)
}

fn pattern_write(file: &File, a: &GuestArgs) -> anyhow::Result<()> {
    let mut done = 0;
    while done < a.len {
        let n = STEP.min(a.len - done);
        let data = farmap::pattern::pattern_bytes(a.seed, a.offset + done, n as usize);
        file.write_all_at(&data, a.offset + done)
            .with_context(|| format!("writing {n} bytes at {}", a.offset + done))?;
        done += n;
    }
    if !a.no_sync {
        file.sync_all().context("fsync")?;
    }
    Ok(())
}

/// `nbd-lib`: see the module's docs. The mount's server runs on a runtime of its own; the
/// device is used from this (other) thread, as the library requires.
fn nbd_lib(a: &GuestArgs) -> anyhow::Result<()> {
    use farmap_nbd_kernel::{NbdMount, NbdMountOptions};
    let spec: farmap::StoreSpec = a
        .path
        .to_str()
        .context("the store spec is not UTF-8")?
        .parse()?;
    let (off, len) = (a.offset, a.len as usize);
    let spec2 = spec.clone();
    let a_seed = a.seed;
    std::thread::spawn(move || -> anyhow::Result<()> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let store = rt
            .block_on(farmap::spec::open_store_async(&spec2))
            .with_context(|| format!("opening {spec2}"))?;
        let opts = NbdMountOptions {
            connections: 2,
            ..NbdMountOptions::default()
        };
        let mount = rt
            .block_on(NbdMount::start(store, &opts))
            .context("NbdMount::start")?;
        println!("nbd-lib: {} is ready", mount.path().display());
        let at = usize::try_from(off)?;
        // The slice mount: write through the mapping, sync, read back through it.
        {
            let map = mount.map()?;
            let want = farmap::pattern::pattern_bytes(a_seed, off, len);
            map.memory()
                .write_from(at, &want)
                .context("writing through the mapping")?;
            map.sync().context("msync + fsync of the mapping")?;
            let mut got = vec![0u8; len];
            map.memory()
                .read_into(at, &mut got)
                .context("reading through the mapping")?;
            compare(&got, a_seed, off).context("read back through the mapping")?;
        }
        // The file mount: read what the mapping wrote, past the page cache.
        let file = mount.open()?;
        fadvise(&file, 0, None, Advice::DontNeed).context("posix_fadvise(DONTNEED)")?;
        let mut got = vec![0u8; len];
        file.read_exact_at(&mut got, off)?;
        compare(&got, a_seed, off).context("read back through open()")?;
        // ... and write the next pattern right after it, leaving it in the page cache.
        let off2 = off + len as u64;
        file.write_all_at(&farmap::pattern::pattern_bytes(a_seed + 1, off2, len), off2)?;
        drop(file);
        // The path mount: any program can open it.
        let by_path = File::open(mount.path())?;
        by_path.read_exact_at(&mut got, off2)?;
        compare(&got, a_seed + 1, off2).context("read back through path()")?;
        drop(by_path);
        rt.block_on(mount.shutdown())
            .context("NbdMount::shutdown")?;
        Ok(())
    })
    .join()
    .map_err(|_| anyhow::anyhow!("the nbd-lib thread panicked"))?
}

fn pattern_check(file: &File, a: &GuestArgs) -> anyhow::Result<()> {
    // Clean pages are dropped, so the reads below go to the device.
    fadvise(
        file,
        a.offset,
        std::num::NonZeroU64::new(a.len),
        Advice::DontNeed,
    )
    .context("posix_fadvise(DONTNEED)")?;
    let mut done = 0;
    let mut buf = vec![0u8; STEP as usize];
    while done < a.len {
        let n = STEP.min(a.len - done) as usize;
        let at = a.offset + done;
        file.read_exact_at(&mut buf[..n], at)
            .with_context(|| format!("reading {n} bytes at {at}"))?;
        compare(&buf[..n], a.seed, at)?;
        done += n as u64;
    }
    Ok(())
}

fn compare(got: &[u8], seed: u64, at: u64) -> anyhow::Result<()> {
    let want = farmap::pattern::pattern_bytes(seed, at, got.len());
    if let Some(i) = got.iter().zip(&want).position(|(g, w)| g != w) {
        bail!(
            "byte {} differs from the pattern: {:#04x}, expected {:#04x}",
            at + i as u64,
            got[i],
            want[i]
        );
    }
    Ok(())
}

/// Maps the pages covering the range `MAP_SHARED`, then writes the pattern into the mapping
/// and msyncs (`write`), or compares the mapping with the pattern.
fn with_mapping(file: &File, a: &GuestArgs, write: bool) -> anyhow::Result<()> {
    let page = rustix::param::page_size() as u64;
    let start = a.offset / page * page;
    let skip = (a.offset - start) as usize;
    let len = usize::try_from(a.offset + a.len - start).context("range too large to map")?;
    if a.len == 0 {
        return Ok(());
    }
    let file = file
        .try_clone()
        .context("duplicating the file's descriptor")?;
    let map = SharedMapping::new_at(file, start, len, true, "the guest's range")
        .with_context(|| format!("mmap of {len} bytes at {start}"))?;
    let memory = map.memory();
    let mut done = 0usize;
    let mut buf = vec![0u8; STEP as usize];
    while (done as u64) < a.len {
        let n = (STEP as usize).min(a.len as usize - done);
        let at = a.offset + done as u64;
        if write {
            let data = farmap::pattern::pattern_bytes(a.seed, at, n);
            memory.write_from(skip + done, &data)?;
        } else {
            memory.read_into(skip + done, &mut buf[..n])?;
            compare(&buf[..n], a.seed, at)?;
        }
        done += n;
    }
    if write {
        // msync, then fsync of the file.
        map.sync().context("msync and fsync")?;
    }
    Ok(())
}
