//! `farmap info`: what a store is and how much of it holds data.

use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use farmap::spec::open_store_async;
use farmap::{format_size, ChunkStatus, StoreSpec};
use futures::StreamExt;
use serde::Serialize;

/// Status requests in flight at once.
const STATUS_IN_FLIGHT: usize = 256;

use crate::output;

#[derive(Debug, Args)]
pub struct InfoArgs {
    /// The store, as a spec (see below).
    spec: StoreSpec,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct Info {
    spec: String,
    size_bytes: u64,
    chunk_bytes: u32,
    chunks: u64,
    caps: Vec<&'static str>,
    zero_chunks: u64,
    data_chunks: u64,
    unknown_chunks: u64,
}

pub async fn run(args: InfoArgs) -> anyhow::Result<ExitCode> {
    // Look, never change: a file or dir store opens read-only, so it takes no writer's lock
    // and leaves alone a directory that a running `farmap cp` or `serve` is writing.
    let mut spec = args.spec.clone();
    if spec.path().is_some() {
        spec.read_only = true;
    }
    let store = open_store_async(&spec).await?;
    let g = store.geometry();
    let (mut zero, mut data, mut unknown) = (0, 0, 0);
    // Many asked at once: a remote store pipelines them over its connections, so a region
    // behind a slow link costs a few round trips, not one per chunk.
    let mut statuses = futures::stream::iter(g.all().iter())
        .map(|idx| {
            let store = &store;
            async move {
                store
                    .status(idx)
                    .await
                    .with_context(|| format!("reading the status of {idx}"))
            }
        })
        .buffer_unordered(STATUS_IN_FLIGHT);
    while let Some(status) = statuses.next().await {
        match status? {
            ChunkStatus::Zero => zero += 1,
            ChunkStatus::Data => data += 1,
            ChunkStatus::Unknown => unknown += 1,
        }
    }
    let info = Info {
        spec: args.spec.to_string(),
        size_bytes: g.size(),
        chunk_bytes: g.chunk_size(),
        chunks: g.chunk_count(),
        caps: store.caps().names().collect(),
        zero_chunks: zero,
        data_chunks: data,
        unknown_chunks: unknown,
    };
    if args.json {
        output::json_line(&info)?;
    } else {
        println!("store:    {}", info.spec);
        println!("size:     {} ({} bytes)", format_size(g.size()), g.size());
        println!(
            "chunks:   {} of {}",
            g.chunk_count(),
            format_size(u64::from(g.chunk_size()))
        );
        println!("caps:     {}", store.caps());
        println!("data:     {data} chunks hold data, {zero} are known zero, {unknown} unknown");
    }
    Ok(ExitCode::SUCCESS)
}
