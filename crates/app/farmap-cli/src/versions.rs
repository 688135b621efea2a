//! `farmap snapshot SPEC NAME`, `farmap versions SPEC` and `farmap fork SPEC NEW...`: a
//! versioned region's history.
//!
//! `snapshot --json` prints one line: `spec`, `region`, `name`, `version`.
//! `versions --json` prints one line per version, oldest first: `version`, `epoch`,
//! `time_ms` (when it was written, milliseconds since the Unix epoch), `whole` (its
//! manifest lists every chunk, else the changes since the version before), `chunks` (chunks
//! its manifest lists), `size` (bytes), `names` (snapshot names that stand for it), and for
//! a fork's first version `from` (`REGION@VERSION`, the version it starts from).
//! `fork --json` prints one line per new region: `region`, `from`, `version` (the version it
//! starts from), `ms` (time to make all of them).
//! `gc --json` prints one line: `objects`, `dry_run`, `grace_ms`, `regions`, `versions`,
//! `referenced` (distinct chunks some version lists), `chunks` (chunks found), `trashed` and
//! `trashed_bytes` (moved to the trash by this run), `restored` (put back: a version written
//! since lists them), `deleted` and `deleted_bytes` (removed for good), `waiting` (in the
//! trash, younger than the grace), `ms`.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use farmap::spec::{open_objects, SpecKind};
use farmap::versions::{
    fork as fork_region, gc as collect, history, At, GcOptions, GcReport, Versioned,
    VersionedOptions,
};
use farmap::StoreSpec;
use farmap_cli_kit::args::parse_duration;
use serde::Serialize;

use crate::output;

#[derive(Debug, Args)]
pub struct SnapshotArgs {
    /// The region: `versioned:(dir:PATH)/REGION`.
    spec: StoreSpec,
    /// The name the latest version gets (1 to 128 of A-Z a-z 0-9 . _ -).
    name: String,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
pub struct VersionsArgs {
    /// The region: `versioned:(dir:PATH)/REGION`.
    spec: StoreSpec,
    /// One JSON object per version instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
pub struct ForkArgs {
    /// The region and version to fork: `versioned:(dir:PATH)/REGION[@VERSION]` (the latest
    /// when no version is given).
    spec: StoreSpec,
    /// The new regions (1 to 128 of A-Z a-z 0-9 . _ - each), kept beside REGION.
    #[arg(required = true)]
    new: Vec<String>,
    /// One JSON object per new region instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
pub struct GcArgs {
    /// Where the objects are: `dir:PATH`, `s3://BUCKET/PREFIX?...`, or any region kept there
    /// (`versioned:(dir:PATH)/REGION`: the whole object store is collected, not only it).
    spec: StoreSpec,
    /// The grace to keep when the object store has none yet (it is set once, by its first
    /// writer or collection; default 1h). A chunk moved to the trash is deleted at a run at
    /// least this much later. Hosts' clocks must agree to well within it.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    grace: Option<Duration>,
    /// Count what would be moved and deleted; change nothing (not even the grace).
    #[arg(long)]
    dry_run: bool,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// The object store and region name of a `versioned:` spec.
fn parts(spec: &StoreSpec) -> anyhow::Result<(&StoreSpec, &str, &At)> {
    match &spec.kind {
        SpecKind::Versioned {
            objects,
            region,
            at,
        } => Ok((objects, region, at)),
        _ => bail!("{spec} is not a versioned region: write versioned:(dir:PATH)/REGION"),
    }
}

#[derive(Debug, Serialize)]
struct Snapshot<'a> {
    spec: String,
    region: &'a str,
    name: &'a str,
    version: u64,
}

pub async fn snapshot(args: SnapshotArgs) -> anyhow::Result<ExitCode> {
    let (objects, region, at) = parts(&args.spec)?;
    if *at != At::Latest {
        bail!(
            "a snapshot names the latest version: leave @VERSION out of {}",
            args.spec
        );
    }
    let store = open_objects(objects).await?;
    // Read-only: the snapshot names what is saved, and takes nothing from a running writer.
    let v = Versioned::open(
        store,
        VersionedOptions {
            region: region.to_owned(),
            at: At::Latest,
            read_only: true,
            create: None,
            grace: None,
            read_ahead: true,
        },
    )
    .await
    .with_context(|| format!("opening {}", args.spec))?;
    let version = v.snapshot(&args.name).await?;
    let report = Snapshot {
        spec: args.spec.to_string(),
        region,
        name: &args.name,
        version,
    };
    if args.json {
        output::json_line(&report)?;
    } else {
        println!("{region}: version {version} is now {:?}", args.name);
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(Debug, Serialize)]
struct Version {
    version: u64,
    epoch: u64,
    time_ms: u64,
    whole: bool,
    chunks: u64,
    size: u64,
    names: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    from: Option<String>,
}

pub async fn versions(args: VersionsArgs) -> anyhow::Result<ExitCode> {
    let (objects, region, _) = parts(&args.spec)?;
    let store = open_objects(objects).await?;
    let list = history(&*store, region)
        .await
        .with_context(|| format!("reading the versions of {}", args.spec))?;
    if list.is_empty() {
        bail!("{region} has no versions in {objects}");
    }
    for v in list {
        let row = Version {
            version: v.seq,
            epoch: v.epoch,
            time_ms: v.time_ms,
            whole: v.whole,
            chunks: v.chunks,
            size: v.size,
            names: v.names,
            from: v.from,
        };
        if args.json {
            output::json_line(&row)?;
        } else {
            println!(
                "{:>8}  epoch {:<3} {:>8} chunks{}{}  {}",
                row.version,
                row.epoch,
                row.chunks,
                if row.whole { " (whole)" } else { "" },
                row.from
                    .as_ref()
                    .map(|f| format!(" (a fork of {f})"))
                    .unwrap_or_default(),
                row.names.join(", ")
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(Debug, Serialize)]
struct Forked<'a> {
    region: &'a str,
    from: &'a str,
    version: u64,
    ms: f64,
}

pub async fn fork(args: ForkArgs) -> anyhow::Result<ExitCode> {
    let (objects, region, at) = parts(&args.spec)?;
    let store = open_objects(objects).await?;
    let start = std::time::Instant::now();
    let version = fork_region(&*store, region, at, &args.new)
        .await
        .with_context(|| format!("forking {}", args.spec))?;
    let ms = output::round1(start.elapsed().as_secs_f64() * 1e3);
    for new in &args.new {
        if args.json {
            output::json_line(&Forked {
                region: new,
                from: region,
                version,
                ms,
            })?;
        } else {
            println!("{new}: a fork of {region} at version {version}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(Debug, Serialize)]
struct Collected {
    objects: String,
    dry_run: bool,
    grace_ms: u64,
    regions: u64,
    versions: u64,
    referenced: u64,
    chunks: u64,
    trashed: u64,
    trashed_bytes: u64,
    restored: u64,
    deleted: u64,
    deleted_bytes: u64,
    waiting: u64,
    ms: f64,
}

pub async fn gc(args: GcArgs) -> anyhow::Result<ExitCode> {
    let objects = match &args.spec.kind {
        SpecKind::Versioned { objects, .. } => {
            tracing::info!("collecting every region kept in {objects}");
            objects
        }
        _ => &args.spec,
    };
    if let Some(g) = args.grace {
        farmap::versions::gc::check_grace(g)?;
    }
    // A directory that is not there holds nothing to collect: only setting up a new object
    // store (a grace, not a dry run) makes it.
    if let SpecKind::Dir { path, .. } = &objects.kind {
        if !path.exists() && (args.grace.is_none() || args.dry_run) {
            bail!(
                "{} does not exist: there is nothing to collect (give --grace to set up a new \
                 object store there)",
                path.display()
            );
        }
    }
    let store = open_objects(objects).await?;
    let start = std::time::Instant::now();
    let opts = GcOptions {
        grace: args.grace,
        dry_run: args.dry_run,
    };
    let r: GcReport = collect(&*store, &opts)
        .await
        .with_context(|| format!("collecting the garbage of {objects}"))?;
    let row = Collected {
        objects: objects.to_string(),
        dry_run: args.dry_run,
        grace_ms: r.grace_ms,
        regions: r.regions,
        versions: r.versions,
        referenced: r.referenced,
        chunks: r.chunks,
        trashed: r.trashed,
        trashed_bytes: r.trashed_bytes,
        restored: r.restored,
        deleted: r.deleted,
        deleted_bytes: r.deleted_bytes,
        waiting: r.waiting,
        ms: output::round1(start.elapsed().as_secs_f64() * 1e3),
    };
    if args.json {
        output::json_line(&row)?;
    } else {
        let would = if args.dry_run {
            " (dry run: nothing changed)"
        } else {
            ""
        };
        println!(
            "{}: {} chunks, {} listed by {} versions of {} regions{would}",
            row.objects, row.chunks, row.referenced, row.versions, row.regions
        );
        println!(
            "  to the trash: {} ({} bytes); deleted for good: {} ({} bytes); put back: {}; \
             waiting for the grace ({} ms): {}",
            row.trashed,
            row.trashed_bytes,
            row.deleted,
            row.deleted_bytes,
            row.restored,
            row.grace_ms,
            row.waiting
        );
    }
    Ok(ExitCode::SUCCESS)
}
