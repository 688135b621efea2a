//! `farmap info`: what a store is and how much of it holds data.

use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use std::sync::Arc;

use farmap::pipeline::Mirrored;
use farmap::spec::{open_mirror, open_store_async, SpecKind};
use farmap::{format_size, ChunkStatus, Store, StoreSpec};
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
    /// For `mirror:` specs: the stage's state after the scan.
    #[serde(skip_serializing_if = "Option::is_none")]
    mirror: Option<MirrorInfo>,
}

#[derive(Debug, Serialize)]
struct MirrorInfo {
    policy: &'static str,
    primary: &'static str,
    to_resync: u64,
    mirror_missing: u64,
    backlog: usize,
    failovers: u64,
}

pub async fn run(args: InfoArgs) -> anyhow::Result<ExitCode> {
    // Look, never change: a file or dir store opens read-only, so it takes no writer's lock
    // and leaves alone a directory that a running `farmap cp` or `serve` is writing.
    let mut spec = args.spec.clone();
    spec.set_read_only_where_possible();
    let mut mirrored: Option<Arc<Mirrored>> = None;
    let store: Arc<dyn Store> = match &spec.kind {
        SpecKind::Mirror {
            primary,
            mirror,
            options,
        } => {
            let m = Arc::new(open_mirror(&spec, primary, mirror, *options).await?);
            mirrored = Some(m.clone());
            m
        }
        _ => open_store_async(&spec).await?,
    };
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
        mirror: mirrored.map(|m| {
            let st = m.mirror_status();
            MirrorInfo {
                policy: st.policy.as_str(),
                primary: st.primary.as_str(),
                to_resync: st.to_resync,
                mirror_missing: st.mirror_missing,
                backlog: st.backlog,
                failovers: st.failovers,
            }
        }),
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
        if let Some(m) = &info.mirror {
            println!(
                "mirror:   policy {}, primary {}, {} chunk(s) to resync, {} missing from the mirror, {} queued",
                m.policy, m.primary, m.to_resync, m.mirror_missing, m.backlog
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}
