//! The destination of object migrations: a listener that takes objects into this process's
//! arena, at the same address.

use std::sync::Arc;
use std::time::{Duration, Instant};

use farmap_arena::{Arena, SlotState};
use farmap_migrate::channel::{Channel, ControlListener};
use farmap_migrate::msg::MAX_PAYLOAD;
use farmap_migrate::{auth, monotonic_ns};
use farmap_net::auth::Key;
use farmap_net::ListenAddr;

use crate::error::SlopeError;
use crate::link::{abort, recv_within, send};
use crate::msg::{check_runs, ArenaShape, ObjMsg};

/// An object that arrived: attach it with [`Obj::attach`](farmap_arena::Obj::attach).
#[derive(Debug, Clone, PartialEq)]
pub struct Arrival {
    /// Its slot (the same as at the source).
    pub slot: u32,
    /// Its type's tag.
    pub tag: u64,
    /// Pages installed (page set and rounds).
    pub pages_installed: u64,
    /// From `Hello` to ownership.
    pub elapsed_ms: f64,
    /// From writes stopped at the source to ownership here.
    pub no_owner_us: f64,
}

/// Listens for object migrations into this process's arena.
pub struct ObjListener {
    rt: tokio::runtime::Runtime,
    listener: ControlListener,
    keys: auth::SeederKeys,
    handshake_limit: Duration,
    idle_limit: Duration,
}

/// How long a connection may take to prove the key ([`ObjListener::set_limits`]).
pub const HANDSHAKE_LIMIT: Duration = Duration::from_secs(10);
/// How long a migration may go without a message from its source.
pub const IDLE_LIMIT: Duration = Duration::from_secs(30);

impl std::fmt::Debug for ObjListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjListener")
            .field("listener", &self.listener)
            .finish_non_exhaustive()
    }
}

impl ObjListener {
    /// Listens at `addr` (TCP: bind loopback unless the peers are on other hosts; a Unix
    /// socket path is made private); peers must prove `key`.
    pub fn bind(addr: &ListenAddr, key: Key) -> Result<ObjListener, SlopeError> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(SlopeError::io("starting a runtime"))?;
        let listener = rt
            .block_on(ControlListener::bind(addr, None))
            .map_err(SlopeError::io("binding the object listener"))?;
        Ok(ObjListener {
            rt,
            listener,
            keys: auth::SeederKeys::new(key),
            handshake_limit: HANDSHAKE_LIMIT,
            idle_limit: IDLE_LIMIT,
        })
    }

    /// Where it listens (with the port a TCP port 0 picked).
    pub fn local_addr(&self) -> Result<ListenAddr, SlopeError> {
        self.listener
            .local_addr()
            .map_err(SlopeError::io("reading the listener's address"))
    }

    /// How long a connection may take to prove the key, and a migration may go without a
    /// message (default [`HANDSHAKE_LIMIT`], [`IDLE_LIMIT`]): a peer that never speaks or
    /// stops is cut off, and the slot it had is free again.
    pub fn set_limits(&mut self, handshake: Duration, idle: Duration) {
        self.handshake_limit = handshake;
        self.idle_limit = idle;
    }

    /// Takes the next object migrating into `arena`; blocks until it is this process's (or
    /// the migration failed, and then the slot is free again and nothing of it is left).
    pub fn accept(&self, arena: &Arc<Arena>) -> Result<Arrival, SlopeError> {
        self.rt.block_on(async {
            let accepted = self
                .listener
                .accept_raw()
                .await
                .map_err(SlopeError::io("accepting"))?;
            let proven = tokio::time::timeout(self.handshake_limit, async {
                let mut ch = accepted
                    .handshake()
                    .await
                    .map_err(|e| SlopeError::Protocol(format!("handshake: {e}")))?;
                auth::seeder(&mut ch, &self.keys)
                    .await
                    .map_err(SlopeError::Auth)?;
                Ok(ch)
            })
            .await;
            let mut ch = proven.unwrap_or_else(|_| {
                Err(SlopeError::Auth(format!(
                    "the peer did not prove the key within {:?}",
                    self.handshake_limit
                )))
            })?;
            // Proven: the pages may come in big frames now.
            ch.accept_payloads_up_to(MAX_PAYLOAD);
            let mut slot = None;
            let r = receive(arena, &mut ch, &mut slot, self.idle_limit).await;
            if r.is_err() {
                if let Some(s) = slot {
                    arena.discard_slot(s);
                    let _ = arena
                        .slots()
                        .transition(s, SlotState::Inbound, SlotState::Free)
                        || arena
                            .slots()
                            .transition(s, SlotState::Installed, SlotState::Free);
                }
            }
            match r {
                Err(e @ (SlopeError::Refused(_) | SlopeError::Io { .. })) => Err(e),
                Err(e) => Err(abort(&mut ch, e).await),
                Ok(a) => Ok(a),
            }
        })
    }
}

/// Checks a `Hello` against this arena and, if it can be taken, claims its slot (`Free` →
/// `Inbound`); otherwise says why not, and changes nothing.
fn claim_slot(arena: &Arena, slot: u32, build_id: &[u8; 32], shape: &ArenaShape) -> Option<String> {
    let cfg = arena.config();
    let page = arena.region().page_size() as u32;
    let ours = ArenaShape {
        base: cfg.base as u64,
        size: cfg.size as u64,
        slot_shift: cfg.slot_shift,
        chunk: cfg.chunk,
        page,
    };
    if *shape != ours {
        return Some(format!(
            "the arenas differ: the source's is {shape:?}, this one's {ours:?}"
        ));
    }
    let (ours_id, fixed) = arena.image();
    if ours_id.0 != *build_id {
        return Some(format!(
            "the executables differ (this one is build {ours_id})"
        ));
    }
    if !fixed {
        return Some(
            "this process runs with ASLR on (call farmap_arena::ensure_fixed_image)".into(),
        );
    }
    if slot >= cfg.slots() {
        return Some(format!("slot {slot} is outside the arena"));
    }
    if arena.leases().holds_slot(slot) {
        return Some(format!("slot {slot} is in a lease this process holds"));
    }
    if !arena
        .slots()
        .transition(slot, SlotState::Free, SlotState::Inbound)
    {
        return Some(format!("slot {slot} is not free here"));
    }
    None
}

async fn receive(
    arena: &Arc<Arena>,
    ch: &mut Channel,
    taken: &mut Option<u32>,
    idle: Duration,
) -> Result<Arrival, SlopeError> {
    let started = Instant::now();
    let (slot, tag) = match recv_within(ch, idle).await? {
        ObjMsg::Hello {
            slot,
            tag,
            build_id,
            arena: shape,
        } => {
            if let Some(why) = claim_slot(arena, slot, &build_id, &shape) {
                // `accept` tells the source (an error that is not the peer's own `Abort`).
                return Err(SlopeError::Incompatible(why));
            }
            *taken = Some(slot);
            (slot, tag)
        }
        m => {
            return Err(SlopeError::Protocol(format!(
                "expected Hello, got {}",
                m.name()
            )))
        }
    };
    send(ch, &ObjMsg::Welcome).await?;
    let page = arena.region().page_size();
    let slot_pages = arena.slot_pages(slot).end - arena.slot_pages(slot).start;
    let slot_off = arena.slot_addrs(slot).start - arena.config().base;
    let install = |runs: &[std::ops::Range<u64>], data: &[u8]| -> Result<u64, SlopeError> {
        let n = check_runs(runs, data.len(), slot_pages, page)
            .map_err(|e| SlopeError::Protocol(e.into()))?;
        let mut at = 0;
        for r in runs {
            let len = (r.end - r.start) as usize * page;
            arena
                .region()
                .write_at(slot_off + r.start as usize * page, &data[at..at + len])?;
            at += len;
        }
        Ok(n)
    };
    let mut pages = 0;
    let writes_stopped_ns = loop {
        match recv_within(ch, idle).await? {
            ObjMsg::Pages { runs, data, .. } => pages += install(&runs, &data)?,
            ObjMsg::Flush { round } => send(ch, &ObjMsg::Flushed { round }).await?,
            ObjMsg::HandOver {
                runs,
                data,
                writes_stopped_ns,
            } => {
                let t = monotonic_ns();
                pages += install(&runs, &data)?;
                tracing::debug!(
                    slot,
                    received_us = t.saturating_sub(writes_stopped_ns) / 1000,
                    install_us = (monotonic_ns() - t) / 1000,
                    "object hand-over installed"
                );
                break writes_stopped_ns;
            }
            m => {
                return Err(SlopeError::Protocol(format!(
                    "expected Pages or HandOver, got {}",
                    m.name()
                )))
            }
        }
    };
    arena
        .slots()
        .transition(slot, SlotState::Inbound, SlotState::Installed);
    send(
        ch,
        &ObjMsg::Installed {
            installed_ns: monotonic_ns(),
        },
    )
    .await?;
    match recv_within(ch, idle).await? {
        ObjMsg::Released { .. } => {}
        m => {
            return Err(SlopeError::Protocol(format!(
                "expected Released, got {}",
                m.name()
            )))
        }
    }
    arena
        .slots()
        .transition(slot, SlotState::Installed, SlotState::Local);
    let owned_ns = monotonic_ns();
    *taken = None;
    let received_bytes = ch.received().load(std::sync::atomic::Ordering::Relaxed);
    let _ = send(
        ch,
        &ObjMsg::Done {
            owned_ns,
            received_bytes,
        },
    )
    .await;
    Ok(Arrival {
        slot,
        tag,
        pages_installed: pages,
        elapsed_ms: started.elapsed().as_secs_f64() * 1e3,
        no_owner_us: owned_ns.saturating_sub(writes_stopped_ns) as f64 / 1e3,
    })
}
