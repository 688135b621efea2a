//! Reading a region's history: a version's chunk map, snapshot names, the list of versions.

use std::collections::HashMap;

use farmap_core::{ErrorKind, Objects, StoreError, StoreResult};

use crate::manifest::{Manifest, Parent, MAX_DEPTH};
use crate::page::{Map, PageCache};
use crate::{bases_dir, check_name, tags_dir, version_key, versions_dir, At, MAX_CHAIN};

/// Reads version `seq` of `region`, checking that it is the manifest it claims to be.
pub(crate) async fn manifest(
    objects: &dyn Objects,
    region: &str,
    seq: u64,
) -> StoreResult<Manifest> {
    let key = version_key(region, seq);
    let bytes = objects.get(&key).await?.ok_or_else(|| {
        StoreError::new(
            ErrorKind::NotFound,
            format!(
                "region {region:?} has no version {seq} in {}",
                objects.location()
            ),
        )
    })?;
    let m = Manifest::decode(&bytes)
        .map_err(|e| StoreError::new(e.kind(), format!("{key} in {}: {e}", objects.location())))?;
    if m.seq != seq {
        return Err(StoreError::new(
            ErrorKind::Corrupt,
            format!(
                "{key} in {} says it is version {}",
                objects.location(),
                m.seq
            ),
        ));
    }
    Ok(m)
}

/// Manifests a chain's reading asks for at once.
const CHAIN_READS: usize = 16;

/// Version `seq` of `region` and its chunk map: the pages of the whole manifest its chain
/// starts from (or, for a fork, the map of the version it started from), then each delta up
/// to `seq` over them. No page is read.
pub(crate) async fn load(
    objects: &dyn Objects,
    region: &str,
    seq: u64,
) -> StoreResult<(Manifest, Map)> {
    load_hinted(objects, region, seq, None).await
}

/// [`load`], told where the chain of `seq` starts if a snapshot's name said so (`base`): the
/// manifests of the chain are then read together with `seq`'s, one round trip in all. A
/// wrong hint costs a second round trip, never a wrong map: the chain is `seq`'s own.
pub(crate) async fn load_hinted(
    objects: &dyn Objects,
    region: &str,
    seq: u64,
    base: Option<u64>,
) -> StoreResult<(Manifest, Map)> {
    load_within(objects, region, seq, base, MAX_DEPTH).await
}

/// Versions `from..to` of `region`, read [`CHAIN_READS`] at a time, in order.
async fn manifests(
    objects: &dyn Objects,
    region: &str,
    seqs: std::ops::Range<u64>,
) -> StoreResult<Vec<Manifest>> {
    use futures::{StreamExt, TryStreamExt};
    futures::stream::iter(seqs)
        .map(|s| manifest(objects, region, s))
        .buffered(CHAIN_READS)
        .try_collect()
        .await
}

/// [`load`], following at most `forks` parents.
fn load_within<'a>(
    objects: &'a dyn Objects,
    region: &'a str,
    seq: u64,
    hint: Option<u64>,
    forks: u32,
) -> farmap_core::BoxFuture<'a, StoreResult<(Manifest, Map)>> {
    Box::pin(async move {
        // A hint past the chain's limit is not followed (it would read too much).
        let hint = hint.filter(|&b| b <= seq && seq - b <= MAX_CHAIN);
        let (top, guessed) = match hint {
            Some(b) => {
                let (top, guessed) = futures::join!(
                    manifest(objects, region, seq),
                    manifests(objects, region, b..seq)
                );
                (top?, guessed.ok())
            }
            None => (manifest(objects, region, seq).await?, None),
        };
        // A chain longer than a writer makes is refused: it would be read whole at every open.
        if seq - top.base > MAX_CHAIN {
            return Err(StoreError::new(
            ErrorKind::Corrupt,
            format!("region {region:?}: version {seq} starts from version {}, more than {MAX_CHAIN} back", top.base),
        ));
        }
        let mut chain = match guessed {
            Some(chain) if hint == Some(top.base) => chain,
            _ => manifests(objects, region, top.base..seq).await?,
        };
        chain.push(top.clone());
        let geometry = top.geometry()?;
        let mut map = Map::empty(geometry);
        for (s, m) in (top.base..=seq).zip(chain) {
            let starts = m.whole || m.from.is_some();
            if (m.size, m.chunk_size) != (top.size, top.chunk_size) || (s == top.base) != starts {
                return Err(StoreError::new(
                    ErrorKind::Corrupt,
                    format!(
                        "region {region:?}: version {s} does not fit the chain of version {seq}"
                    ),
                ));
            }
            if let Some(p) = &m.from {
                if forks == 0 || p.region == region {
                    return Err(StoreError::new(
                        ErrorKind::Corrupt,
                        format!(
                            "region {region:?}: its forks go more than {MAX_DEPTH} deep, or round"
                        ),
                    ));
                }
                let (parent, pmap) =
                    load_within(objects, &p.region, p.seq, None, forks - 1).await?;
                if (parent.size, parent.chunk_size) != (m.size, m.chunk_size) {
                    return Err(StoreError::new(
                        ErrorKind::Corrupt,
                        format!(
                            "region {region:?} is a fork of {}@{}, which has another shape",
                            p.region, p.seq
                        ),
                    ));
                }
                map = pmap;
            }
            if !m.pages.is_empty() {
                map = Map::paged(m.page_chunks, m.pages);
            } else if m.whole {
                map = Map::of_entries(geometry, m.entries);
            } else {
                map.apply(m.entries);
            }
        }
        Ok((top, map))
    })
}

/// Version `seq` of `region`'s manifest, and how many forks deep it is (0: it starts from
/// nothing), from the manifest its chain starts from.
async fn with_depth(objects: &dyn Objects, region: &str, seq: u64) -> StoreResult<(Manifest, u32)> {
    let top = manifest(objects, region, seq).await?;
    let depth = if top.base == seq {
        top.from.as_ref().map_or(0, |p| p.depth)
    } else {
        let base = manifest(objects, region, top.base).await?;
        base.from.map_or(0, |p| p.depth)
    };
    Ok((top, depth))
}

/// The version number `at` stands for in `region`.
pub async fn resolve(objects: &dyn Objects, region: &str, at: &At) -> StoreResult<u64> {
    Ok(resolve_hinted(objects, region, at).await?.0)
}

/// The version number `at` stands for in `region`, and where its chain starts when a
/// snapshot's name says so (a hint for [`load_hinted`]).
pub(crate) async fn resolve_hinted(
    objects: &dyn Objects,
    region: &str,
    at: &At,
) -> StoreResult<(u64, Option<u64>)> {
    match at {
        At::Latest => latest(objects, region)
            .await?
            .map(|s| (s, None))
            .ok_or_else(|| {
                StoreError::new(
                    ErrorKind::NotFound,
                    format!(
                        "region {region:?} has no versions in {}",
                        objects.location()
                    ),
                )
            }),
        At::Seq(n) => Ok((*n, None)),
        At::Tag(name) => {
            check_name("snapshot", name).map_err(StoreError::invalid)?;
            let key = format!("{}/{name}", tags_dir(region));
            let hint_key = format!("{}/{name}", bases_dir(region));
            // The hint is read with the name; it is only a hint: unreadable, it is none.
            let (text, hint) = futures::join!(objects.get(&key), objects.get(&hint_key));
            let text = text?.ok_or_else(|| {
                StoreError::new(
                    ErrorKind::NotFound,
                    format!("region {region:?} has no snapshot named {name:?}"),
                )
            })?;
            let seq = parse_number(&text).ok_or_else(|| {
                StoreError::new(
                    ErrorKind::Corrupt,
                    format!("{key} does not hold a version number"),
                )
            })?;
            let base = hint.ok().flatten().and_then(|b| parse_number(&b));
            Ok((seq, base))
        }
    }
}

/// A version number as a snapshot's name (and its hint) hold it: decimal, a newline after.
pub(crate) fn number_text(n: u64) -> String {
    format!("{n}\n")
}

fn parse_number(text: &[u8]) -> Option<u64> {
    std::str::from_utf8(text).ok()?.trim().parse().ok()
}

/// One version, as `farmap versions` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VersionInfo {
    /// Its number.
    pub seq: u64,
    /// Its writer's epoch.
    pub epoch: u64,
    /// When it was written, milliseconds since the Unix epoch.
    pub time_ms: u64,
    /// Whether its manifest lists every chunk.
    pub whole: bool,
    /// Chunks its manifest lists.
    pub chunks: u64,
    /// The region's size.
    pub size: u64,
    /// Snapshot names that stand for it.
    pub names: Vec<String>,
    /// A fork's version 0: the version it starts from, `REGION@SEQ`.
    pub from: Option<String>,
}

/// Every version of `region`, oldest first.
pub async fn history(objects: &dyn Objects, region: &str) -> StoreResult<Vec<VersionInfo>> {
    check_name("region", region).map_err(StoreError::invalid)?;
    let mut names: HashMap<u64, Vec<String>> = HashMap::new();
    for tag in objects.list(&tags_dir(region)).await? {
        let seq = resolve(objects, region, &At::Tag(tag.clone())).await?;
        names.entry(seq).or_default().push(tag);
    }
    let mut seqs: Vec<u64> = objects
        .list(&versions_dir(region))
        .await?
        .iter()
        .filter_map(|n| n.parse().ok())
        .collect();
    seqs.sort_unstable();
    let mut out = Vec::with_capacity(seqs.len());
    for seq in seqs {
        let m = manifest(objects, region, seq).await?;
        out.push(VersionInfo {
            seq,
            epoch: m.epoch,
            time_ms: m.time_ms,
            whole: m.whole,
            chunks: m.chunks(),
            size: m.size,
            names: names.remove(&seq).unwrap_or_default(),
            from: m.from.map(|p| format!("{}@{}", p.region, p.seq)),
        });
    }
    Ok(out)
}

/// The latest version of `region`, `None` when it has none.
pub(crate) async fn latest(objects: &dyn Objects, region: &str) -> StoreResult<Option<u64>> {
    let names = objects.list(&versions_dir(region)).await?;
    Ok(names.iter().filter_map(|n| n.parse::<u64>().ok()).max())
}

/// Writes `name`'s version 0; false if it exists.
async fn create_first(objects: &dyn Objects, name: &str, bytes: bytes::Bytes) -> StoreResult<bool> {
    objects.create(&version_key(name, 0), bytes).await
}

/// Makes each of `into` a new region whose version 0 is version `at` of `region`: every
/// chunk is shared, and each fork is written independently from then on. A fork's version 0
/// names the version it starts from (a small manifest, whatever the region's size), unless
/// that one is already [`MAX_DEPTH`] forks deep: then it lists every chunk. Refuses a name
/// that already has versions, before making any.
///
/// Round trips, whatever the region's size: the new names are looked up while the source
/// version is resolved, then the forks are written, 16 of each at a time.
pub async fn fork(
    objects: &dyn Objects,
    region: &str,
    at: &At,
    into: &[String],
) -> StoreResult<u64> {
    use futures::{StreamExt, TryStreamExt};

    check_name("region", region).map_err(StoreError::invalid)?;
    for name in into {
        check_name("region", name).map_err(StoreError::invalid)?;
    }
    let taken = futures::stream::iter(0..into.len())
        .map(|i| latest(objects, &into[i]))
        .buffered(CHAIN_READS)
        .try_collect::<Vec<_>>();
    let source = async {
        let seq = resolve(objects, region, at).await?;
        let (top, deep) = with_depth(objects, region, seq).await?;
        Ok::<_, StoreError>((seq, top, deep))
    };
    let (taken, (seq, top, deep)) = futures::try_join!(taken, source)?;
    if let Some((name, _)) = into.iter().zip(&taken).find(|(_, v)| v.is_some()) {
        return Err(StoreError::invalid(format!(
            "region {name:?} already exists in {}",
            objects.location()
        )));
    }
    let first = if deep < MAX_DEPTH {
        let parent = Parent {
            region: region.to_owned(),
            seq,
            depth: deep + 1,
        };
        Manifest::fork_of(top.size, top.chunk_size, parent)
    } else {
        let (_, map) = load(objects, region, seq).await?;
        let (pages, store) = map.fold(objects, &PageCache::default()).await?;
        for (hash, bytes) in store {
            objects.create(&crate::chunk::key(&hash), bytes).await?;
        }
        Manifest::first(top.size, top.chunk_size, map.page_chunks(), pages)
    };
    let bytes = bytes::Bytes::from(first.encode());
    let made = futures::stream::iter(0..into.len())
        .map(|i| create_first(objects, &into[i], bytes.clone()))
        .buffered(CHAIN_READS)
        .try_collect::<Vec<_>>()
        .await?;
    if let Some((name, _)) = into.iter().zip(&made).find(|(_, created)| !**created) {
        return Err(StoreError::invalid(format!(
            "region {name:?} was created by someone else meanwhile"
        )));
    }
    Ok(seq)
}
