//! `farmap verify`: scrub a verified region (`verified:(SPEC)`): read every chunk, check it
//! against its checksum, report the bad ones.
//!
//! With `--json`, one line with these keys:
//! - `spec`: the store, as given (a plain spec is read as `verified:(SPEC)`);
//! - `chunks`: chunks in the verified region; `checked`: chunks read (all of them);
//! - `bad_chunks`: how many were refused as corrupt; `bad`: their indices (at most 1000,
//!   lowest first); `bad_meta_chunks`: checksum chunks that failed their own check (their
//!   chunks count as bad too);
//! - `ok`: `bad_chunks == 0`.
//!
//! Exit status: 0 when every chunk is good, 2 when some are bad, 1 when the scrub could not
//! run (the store cannot be opened or read).

use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use farmap::pipeline::Verified;
use farmap::spec::{open_store_async, SpecKind};
use farmap::{ErrorKind, Store, StoreSpec};
use futures::StreamExt;
use serde::Serialize;

use crate::output;

/// Chunks read at once.
const IN_FLIGHT: usize = 64;
/// Bad chunk indices listed.
const LISTED: usize = 1000;

#[derive(Debug, Args)]
pub struct VerifyArgs {
    /// The store: `verified:(SPEC)`, or the SPEC under it.
    spec: StoreSpec,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct Report {
    spec: String,
    chunks: u64,
    checked: u64,
    bad_chunks: u64,
    bad: Vec<u64>,
    bad_meta_chunks: u64,
    ok: bool,
}

pub async fn run(args: VerifyArgs) -> anyhow::Result<ExitCode> {
    let mut inner = match &args.spec.kind {
        SpecKind::Verified { inner } => (**inner).clone(),
        _ => args.spec.clone(),
    };
    // A scrub only reads: file and dir stores open read-only.
    inner.set_read_only_where_possible();
    let store = open_store_async(&inner).await?;
    let verified = Verified::open(store, None)
        .await
        .with_context(|| format!("opening {} as a verified region", args.spec))?;
    let g = verified.geometry();
    let mut reads = futures::stream::iter(g.all().iter())
        .map(|idx| {
            let v = &verified;
            async move { (idx, v.read(idx).await) }
        })
        .buffer_unordered(IN_FLIGHT);
    let (mut checked, mut bad) = (0u64, Vec::new());
    while let Some((idx, res)) = reads.next().await {
        checked += 1;
        match res {
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::Corrupt => bad.push(idx.0),
            Err(e) => return Err(e).with_context(|| format!("reading {idx}")),
        }
    }
    bad.sort_unstable();
    let report = Report {
        spec: args.spec.to_string(),
        chunks: g.chunk_count(),
        checked,
        bad_chunks: bad.len() as u64,
        bad_meta_chunks: verified.stats().bad_meta_chunks,
        ok: bad.is_empty(),
        bad: bad.iter().copied().take(LISTED).collect(),
    };
    if args.json {
        output::json_line(&report)?;
    } else {
        println!("store:    {}", report.spec);
        println!("checked:  {} of {} chunks", report.checked, report.chunks);
        if report.ok {
            println!("result:   every chunk matches its checksum");
        } else {
            let shown: Vec<String> = report.bad.iter().take(20).map(u64::to_string).collect();
            println!(
                "result:   {} bad chunk(s): {}{}",
                report.bad_chunks,
                shown.join(", "),
                if report.bad_chunks > 20 { ", ..." } else { "" }
            );
            if report.bad_meta_chunks > 0 {
                println!(
                    "          {} checksum chunk(s) failed their own check",
                    report.bad_meta_chunks
                );
            }
        }
    }
    Ok(if report.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(2)
    })
}
