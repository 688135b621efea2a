//! `farmap cp`: copy a whole region between two stores.

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Args;
use farmap::pipeline::Unaligned;
use farmap::spec::open_store_async;
use farmap::{format_size, is_zero, zero_chunk, Caps, ChunkStatus, Store, StoreSpec};
use futures::stream::{self, StreamExt, TryStreamExt};
use serde::Serialize;

use crate::output;

#[derive(Debug, Args)]
pub struct CpArgs {
    /// Where to copy from.
    src: StoreSpec,
    /// Where to copy to. If it does not exist yet it is created with the source's size.
    dst: StoreSpec,
    /// How many block copies run at once.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=4096))]
    workers: u32,
    /// Print one JSON object with the result instead of text.
    #[arg(long)]
    json: bool,
    /// No progress bar.
    #[arg(long, short)]
    quiet: bool,
}

#[derive(Debug, Serialize)]
struct CpReport {
    src: String,
    dst: String,
    size_bytes: u64,
    block_bytes: u64,
    copied_bytes: u64,
    zero_bytes_written: u64,
    skipped_zero_bytes: u64,
    elapsed_ms: f64,
    mb_per_s: f64,
    complete: bool,
}

/// Whether every chunk of `store` overlapping `offset..offset+len` is known to read as zeros.
async fn known_zero(store: &dyn Store, offset: u64, len: u64) -> anyhow::Result<bool> {
    if !store.caps().contains(Caps::STATUS) {
        return Ok(false);
    }
    let g = store.geometry();
    for idx in g.chunks_for(offset, len).iter() {
        if store.status(idx).await? != ChunkStatus::Zero {
            return Ok(false);
        }
    }
    Ok(true)
}

pub async fn run(mut args: CpArgs) -> anyhow::Result<ExitCode> {
    let (src, dst) = open_both(&mut args).await?;
    let size = src.geometry().size();
    // Copy in blocks of the larger chunk size: both are powers of two, so every block covers
    // whole chunks of both stores (but for a short last block).
    let block = u64::from(src.geometry().chunk_size().max(dst.geometry().chunk_size()));
    let blocks = size.div_ceil(block);
    let copy = BlockCopy {
        src_u: Unaligned::new(src.clone()),
        dst_u: Unaligned::new(dst.clone()),
        src,
        dst: dst.clone(),
        copied: AtomicU64::new(0),
        zeros_written: AtomicU64::new(0),
        skipped: AtomicU64::new(0),
    };
    let bar = output::byte_bar(size, "copying", args.quiet || args.json);
    let stop = stop_on_ctrl_c();
    let started = Instant::now();
    let result = stream::iter(0..blocks)
        .take_while(|_| std::future::ready(!stop.load(Ordering::SeqCst)))
        .map(|b| {
            let (copy, bar) = (&copy, &bar);
            async move {
                let offset = b * block;
                let len = block.min(size - offset);
                copy.block(offset, len).await?;
                bar.inc(len);
                anyhow::Ok(())
            }
        })
        .buffer_unordered(args.workers as usize)
        .try_collect::<()>()
        .await;
    // Whatever was written is made durable, even when the copy failed or was interrupted.
    let flushed = dst.flush().await.context("flushing the destination");
    let elapsed = started.elapsed();
    bar.finish_and_clear();
    result?;
    flushed?;
    let copied = copy.copied.into_inner();
    let skipped = copy.skipped.into_inner();
    let complete = copied + skipped == size;
    let report = CpReport {
        src: args.src.to_string(),
        dst: args.dst.to_string(),
        size_bytes: size,
        block_bytes: block,
        copied_bytes: copied,
        zero_bytes_written: copy.zeros_written.into_inner(),
        skipped_zero_bytes: skipped,
        elapsed_ms: output::round1(elapsed.as_secs_f64() * 1e3),
        mb_per_s: output::mb_per_s(copied + skipped, elapsed),
        complete,
    };
    if args.json {
        output::json_line(&report)?;
    } else {
        println!(
            "copied {} to {}: {} written, {} of zeros skipped, {:.1} MB/s in {:.2} s{}",
            report.src,
            report.dst,
            format_size(copied),
            format_size(skipped),
            report.mb_per_s,
            elapsed.as_secs_f64(),
            if complete {
                ""
            } else {
                " (INTERRUPTED: incomplete)"
            }
        );
    }
    Ok(if complete {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(130)
    })
}

/// Opens the source, then the destination (created with the source's size if new); both
/// must be as large, and the destination writable.
async fn open_both(args: &mut CpArgs) -> anyhow::Result<(Arc<dyn Store>, Arc<dyn Store>)> {
    let src = open_store_async(&args.src)
        .await
        .context("opening the source")?;
    let size = src.geometry().size();
    args.dst.default_size_for_new(size);
    let dst = open_store_async(&args.dst)
        .await
        .context("opening the destination")?;
    let dst_size = dst.geometry().size();
    if dst_size != size {
        bail!(
            "sizes differ: {} is {} ({size} bytes) but {} is {} ({dst_size} bytes); cp copies whole regions",
            args.src,
            format_size(size),
            args.dst,
            format_size(dst_size)
        );
    }
    if !dst.caps().contains(Caps::WRITE) {
        bail!("{} is read-only", args.dst);
    }
    Ok((src, dst))
}

/// A flag that Ctrl-C raises: the copy stops starting blocks, finishes those in flight and
/// flushes.
fn stop_on_ctrl_c() -> Arc<AtomicBool> {
    let stop = Arc::new(AtomicBool::new(false));
    let raised = stop.clone();
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            eprintln!("farmap: interrupted; finishing the copies in flight and flushing");
            raised.store(true, Ordering::SeqCst);
        }
    });
    stop
}

/// The copy's stores and what it has done so far.
struct BlockCopy {
    src: Arc<dyn Store>,
    dst: Arc<dyn Store>,
    src_u: Unaligned<Arc<dyn Store>>,
    dst_u: Unaligned<Arc<dyn Store>>,
    copied: AtomicU64,
    zeros_written: AtomicU64,
    skipped: AtomicU64,
}

impl BlockCopy {
    /// Copies `len` bytes at `offset` (zeros the destination already reads are skipped) and
    /// counts them.
    async fn block(&self, offset: u64, len: u64) -> anyhow::Result<()> {
        let data = if known_zero(self.src.as_ref(), offset, len).await? {
            zero_chunk(len as usize)
        } else {
            self.src_u
                .read_bytes(offset, len as usize)
                .await
                .with_context(|| format!("reading {len} bytes at offset {offset}"))?
        };
        if is_zero(&data) {
            if known_zero(self.dst.as_ref(), offset, len).await? {
                self.skipped.fetch_add(len, Ordering::Relaxed);
                return Ok(());
            }
            self.zeros_written.fetch_add(len, Ordering::Relaxed);
        }
        self.dst_u
            .write_bytes(offset, data)
            .await
            .with_context(|| format!("writing {len} bytes at offset {offset}"))?;
        self.copied.fetch_add(len, Ordering::Relaxed);
        Ok(())
    }
}
