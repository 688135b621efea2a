//! The commands a migration driver runs, on [`Qmp`]: run state, migration set-up, start,
//! switchover and progress.

use std::time::Duration;

use serde_json::{json, Value};
use tokio::time::Instant;

use super::client::{Deadline, Qmp};
use super::error::QmpError;

/// How often [`Qmp::wait_migration_status`] asks `query-migrate` when `MIGRATION` events are
/// off, and [`Qmp::wait_status`] asks `query-status`.
pub const MIGRATION_POLL: Duration = Duration::from_millis(5);

/// With `MIGRATION` events on, how long [`Qmp::wait_migration_status`] waits for one before
/// it asks `query-migrate` anyway (in case another connection changed the capability).
const EVENTS_FALLBACK_POLL: Duration = Duration::from_millis(250);

/// The statuses a migration ends in.
const TERMINAL: [&str; 3] = ["completed", "failed", "cancelled"];

/// What `query-migrate` says, the fields a driver and a benchmark use. Every field is an
/// `Option`: QEMU fills them by status (`{}` before any migration; `downtime` only once
/// completed; only `status` on a destination).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MigrateInfo {
    /// `status`: `setup`, `active`, `pre-switchover`, `device`, `completed`, `failed`, ...;
    /// `None` before any migration.
    pub status: Option<String>,
    /// `total-time`: from the start, in ms (until completion once completed).
    pub total_time_ms: Option<u64>,
    /// `downtime`: how long the VM was stopped, in ms (completed migrations). At the source
    /// it includes a `pause-before-switchover` pause.
    pub downtime_ms: Option<u64>,
    /// `expected-downtime`: QEMU's estimate while the migration runs, in ms.
    pub expected_downtime_ms: Option<u64>,
    /// `setup-time`: the set-up's share of `total-time`, in ms.
    pub setup_time_ms: Option<u64>,
    /// `ram.transferred`: bytes of the migration stream so far.
    pub ram_transferred: Option<u64>,
    /// `ram.total`: bytes of guest RAM QEMU migrates (without blocks `x-ignore-shared` skips).
    pub ram_total: Option<u64>,
    /// `ram.remaining`: bytes still to send in this pass.
    pub ram_remaining: Option<u64>,
    /// `ram.dirty-sync-count`: dirty-bitmap syncs, i.e. passes.
    pub ram_dirty_sync_count: Option<u64>,
    /// `ram.mbps`: the stream's throughput, in megabits per second.
    pub ram_mbps: Option<f64>,
    /// `error-desc`: why a migration failed.
    pub error_desc: Option<String>,
    /// The whole reply, for the fields not above.
    pub raw: Value,
}

impl MigrateInfo {
    /// Reads a `query-migrate` return value. Fields missing or of another type are `None`.
    pub fn from_value(value: &Value) -> Self {
        let u = |key: &str| value.get(key).and_then(Value::as_u64);
        let ram = |key: &str| value.get("ram").and_then(|r| r.get(key));
        let s = |key: &str| value.get(key).and_then(Value::as_str).map(str::to_owned);
        Self {
            status: s("status"),
            total_time_ms: u("total-time"),
            downtime_ms: u("downtime"),
            expected_downtime_ms: u("expected-downtime"),
            setup_time_ms: u("setup-time"),
            ram_transferred: ram("transferred").and_then(Value::as_u64),
            ram_total: ram("total").and_then(Value::as_u64),
            ram_remaining: ram("remaining").and_then(Value::as_u64),
            ram_dirty_sync_count: ram("dirty-sync-count").and_then(Value::as_u64),
            ram_mbps: ram("mbps").and_then(Value::as_f64),
            error_desc: s("error-desc"),
            raw: value.clone(),
        }
    }
}

impl Qmp {
    /// The run state (`query-status`): `prelaunch`, `inmigrate`, `running`, `paused`,
    /// `finish-migrate`, `postmigrate`, `shutdown`, ...
    pub async fn status(&mut self) -> Result<String, QmpError> {
        let value = self.execute("query-status", None).await?;
        match value.get("status").and_then(Value::as_str) {
            Some(status) => Ok(status.to_owned()),
            None => Err(QmpError::Unexpected {
                path: self.path().into(),
                what: format!("query-status returned no status: {value}"),
            }),
        }
    }

    /// Waits until the run state is `wanted`, asking `query-status` every
    /// [`MIGRATION_POLL`]. The run state follows the migration status with a lag: at the
    /// source of a completed migration it is `finish-migrate` for a moment, then
    /// `postmigrate`.
    pub async fn wait_status(&mut self, timeout: Duration, wanted: &str) -> Result<(), QmpError> {
        let deadline = Instant::now() + timeout;
        let what = || format!("run state {wanted}");
        loop {
            let status = self.status().await.map_err(|e| retitle(e, what()))?;
            if status == wanted {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(QmpError::Timeout {
                    path: self.path().into(),
                    what: format!("{} (it is {status})", what()),
                    timeout,
                });
            }
            tokio::time::sleep_until((Instant::now() + MIGRATION_POLL).min(deadline)).await;
        }
    }

    /// Turns migration capabilities on or off (`migrate-set-capabilities`), e.g.
    /// `[("x-ignore-shared", true), ("events", true)]`. Must be done on both ends for the
    /// capabilities QEMU validates on both (`x-ignore-shared`), and before `migrate-incoming`
    /// at the destination.
    pub async fn set_capabilities(&mut self, caps: &[(&str, bool)]) -> Result<(), QmpError> {
        let caps: Vec<Value> = caps
            .iter()
            .map(|(name, on)| json!({"capability": name, "state": on}))
            .collect();
        let args = json!({ "capabilities": caps });
        self.execute("migrate-set-capabilities", Some(args))
            .await
            .map(drop)
    }

    /// Sets migration parameters (`migrate-set-parameters`), e.g.
    /// `json!({"downtime-limit": 30, "max-bandwidth": 1_000_000_000})`.
    pub async fn set_parameters(&mut self, params: Value) -> Result<(), QmpError> {
        self.execute("migrate-set-parameters", Some(params))
            .await
            .map(drop)
    }

    /// Starts an outgoing migration to `uri` (`tcp:HOST:PORT`, `unix:PATH`, `exec:CMD`).
    /// It returns once the migration has started; follow it with
    /// [`wait_migration_status`](Self::wait_migration_status).
    pub async fn migrate(&mut self, uri: &str) -> Result<(), QmpError> {
        self.execute("migrate", Some(json!({ "uri": uri })))
            .await
            .map(drop)
    }

    /// Starts listening for an incoming migration on `uri` (QEMU started with
    /// `-incoming defer`).
    pub async fn migrate_incoming(&mut self, uri: &str) -> Result<(), QmpError> {
        self.execute("migrate-incoming", Some(json!({ "uri": uri })))
            .await
            .map(drop)
    }

    /// Lets a migration paused in `state` go on (`migrate-continue`; `pre-switchover` with
    /// the `pause-before-switchover` capability).
    pub async fn migrate_continue(&mut self, state: &str) -> Result<(), QmpError> {
        self.execute("migrate-continue", Some(json!({ "state": state })))
            .await
            .map(drop)
    }

    /// The migration's status and figures (`query-migrate`).
    pub async fn query_migrate(&mut self) -> Result<MigrateInfo, QmpError> {
        let value = self.execute("query-migrate", None).await?;
        Ok(MigrateInfo::from_value(&value))
    }

    /// Starts the vCPUs (`cont`).
    pub async fn cont(&mut self) -> Result<(), QmpError> {
        self.execute("cont", None).await.map(drop)
    }

    /// Stops the vCPUs (`stop`).
    pub async fn stop(&mut self) -> Result<(), QmpError> {
        self.execute("stop", None).await.map(drop)
    }

    /// Waits until the migration's status is `wanted` (`pre-switchover`, `completed`, ...).
    ///
    /// - It asks `query-migrate` first, so a status reached before the call counts.
    /// - With the `events` capability on (set through this connection), it then follows
    ///   `MIGRATION` events (and asks `query-migrate` again if none came for 250 ms); without
    ///   it, it asks `query-migrate` every [`MIGRATION_POLL`]. The events read stay queued.
    /// - A migration that ends (`completed`, `failed`, `cancelled`) in another status than
    ///   `wanted` is [`QmpError::MigrationEnded`], with QEMU's `error-desc`.
    pub async fn wait_migration_status(
        &mut self,
        timeout: Duration,
        wanted: &str,
    ) -> Result<(), QmpError> {
        let deadline = Deadline::after(timeout);
        let what = || format!("migration status {wanted}");
        // Events numbered from here on arrived after the wait began.
        let mut seen = self.event_seq;
        loop {
            let info = self.query_migrate().await.map_err(|e| retitle(e, what()))?;
            if let Some(verdict) = verdict(&info, wanted) {
                return verdict;
            }
            if Instant::now() >= deadline.at {
                return Err(QmpError::Timeout {
                    path: self.path().into(),
                    what: what(),
                    timeout,
                });
            }
            if !self.migration_events {
                let next = (Instant::now() + MIGRATION_POLL).min(deadline.at);
                tokio::time::sleep_until(next).await;
                continue;
            }
            let until = Deadline {
                at: (Instant::now() + EVENTS_FALLBACK_POLL).min(deadline.at),
                timeout,
            };
            if self.follow_events(&mut seen, until, wanted).await? {
                return Ok(());
            }
        }
    }

    /// Follows `MIGRATION` events until `until`: `true` when one says `wanted`; `false` at
    /// `until`, or as soon as one says the migration ended otherwise (the caller's
    /// `query-migrate` then reports it with its `error-desc`).
    async fn follow_events(
        &mut self,
        seen: &mut u64,
        until: Deadline,
        wanted: &str,
    ) -> Result<bool, QmpError> {
        loop {
            let fresh = self.events.iter().filter(|(seq, _)| *seq >= *seen);
            for (_, event) in fresh {
                match event.migration_status() {
                    Some(status) if status == wanted => return Ok(true),
                    Some(status) if TERMINAL.contains(&status) => return Ok(false),
                    _ => {}
                }
            }
            *seen = self.event_seq;
            match self.read_event_by(until, String::new).await {
                Ok(event) => self.queue_event(event),
                Err(QmpError::Timeout { .. }) => return Ok(false),
                Err(e) => return Err(e),
            }
        }
    }
}

/// `Some` when `info` ends the wait for `wanted`: reached, or ended otherwise.
fn verdict(info: &MigrateInfo, wanted: &str) -> Option<Result<(), QmpError>> {
    let status = info.status.as_deref()?;
    if status == wanted {
        return Some(Ok(()));
    }
    TERMINAL.contains(&status).then(|| {
        Err(QmpError::MigrationEnded {
            wanted: wanted.into(),
            status: status.into(),
            error_desc: info.error_desc.clone(),
        })
    })
}

/// A command's timeout, reworded as the wait it belonged to.
fn retitle(e: QmpError, what: String) -> QmpError {
    match e {
        QmpError::Timeout { path, timeout, .. } => QmpError::Timeout {
            path,
            what,
            timeout,
        },
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::qmp::fake::{listen, FakeQemu};
    use crate::qmp::{parse_line, Message};

    const LONG: Duration = Duration::from_secs(10);

    // query-migrate replies of QEMU 7.2.22 (x-ignore-shared, 64 MiB of shared RAM, no devices).
    const AT_PRE_SWITCHOVER: &str = "{\"return\": {\"expected-downtime\": 300, \"status\": \
        \"pre-switchover\", \"setup-time\": 1, \"total-time\": 5, \"ram\": {\"total\": 532480, \
        \"postcopy-requests\": 0, \"dirty-sync-count\": 1, \"multifd-bytes\": 0, \
        \"pages-per-second\": 0, \"downtime-bytes\": 0, \"page-size\": 4096, \"remaining\": 0, \
        \"postcopy-bytes\": 0, \"mbps\": 0, \"transferred\": 206005, \
        \"dirty-sync-missed-zero-copy\": 0, \"precopy-bytes\": 206005, \"duplicate\": 80, \
        \"dirty-pages-rate\": 0, \"skipped\": 0, \"normal-bytes\": 204800, \"normal\": 50}}}\r\n";
    const COMPLETED: &str = "{\"return\": {\"status\": \"completed\", \"setup-time\": 1, \
        \"downtime\": 4, \"total-time\": 8, \"ram\": {\"total\": 532480, \"postcopy-requests\": 0, \
        \"dirty-sync-count\": 2, \"multifd-bytes\": 0, \"pages-per-second\": 0, \
        \"downtime-bytes\": 0, \"page-size\": 4096, \"remaining\": 0, \"postcopy-bytes\": 0, \
        \"mbps\": 363.61828571428572, \"transferred\": 206005, \
        \"dirty-sync-missed-zero-copy\": 0, \"precopy-bytes\": 206005, \"duplicate\": 80, \
        \"dirty-pages-rate\": 0, \"skipped\": 0, \"normal-bytes\": 204800, \"normal\": 50}}}\r\n";
    const FAILED: &str = "{\"status\": \"failed\", \"error-desc\": \"Failed to connect to \
        '127.0.0.1:1': Connection refused\"}";

    fn info(line: &str) -> MigrateInfo {
        match parse_line(line).unwrap() {
            Message::Return { value, .. } => MigrateInfo::from_value(&value),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn query_migrate_transcripts() {
        let paused = info(AT_PRE_SWITCHOVER);
        assert_eq!(paused.status.as_deref(), Some("pre-switchover"));
        assert_eq!(paused.expected_downtime_ms, Some(300));
        assert_eq!(paused.downtime_ms, None);
        assert_eq!(paused.ram_transferred, Some(206005));
        let done = info(COMPLETED);
        assert_eq!(done.status.as_deref(), Some("completed"));
        assert_eq!(
            (done.downtime_ms, done.total_time_ms, done.setup_time_ms),
            (Some(4), Some(8), Some(1))
        );
        assert_eq!(
            (done.ram_transferred, done.ram_total, done.ram_remaining),
            (Some(206005), Some(532480), Some(0))
        );
        assert_eq!(done.ram_dirty_sync_count, Some(2));
        assert!((done.ram_mbps.unwrap() - 363.618).abs() < 0.001);
        assert_eq!(done.raw["ram"]["page-size"], 4096);
        // Before any migration, and at a destination.
        assert_eq!(
            info("{\"return\": {}}\r\n"),
            MigrateInfo::from_value(&json!({}))
        );
        assert_eq!(info("{\"return\": {}}").status, None);
        let failed = MigrateInfo::from_value(&serde_json::from_str(FAILED).unwrap());
        assert!(failed.error_desc.unwrap().contains("Connection refused"));
    }

    /// A fake QEMU that answers `query-migrate` with `statuses` in turn, then expects
    /// `query-status`; returns how many `query-migrate` it answered.
    async fn answer_polls(qemu: &mut FakeQemu, statuses: &[&str]) -> usize {
        let mut polls = 0;
        for status in statuses {
            let c = qemu.command().await;
            assert_eq!(c.name, "query-migrate");
            qemu.reply(&c.id, &format!("{{\"status\": \"{status}\"}}"))
                .await;
            polls += 1;
        }
        let c = qemu.command().await;
        assert_eq!(
            c.name, "query-status",
            "no query-migrate after the status came"
        );
        qemu.reply(&c.id, "{\"status\": \"postmigrate\"}").await;
        polls
    }

    #[tokio::test]
    async fn without_events_the_status_is_polled() {
        let dir = tempfile::tempdir().unwrap();
        let (path, listener) = listen(dir.path());
        let server = tokio::spawn(async move {
            let mut qemu = FakeQemu::accept(&listener).await;
            answer_polls(&mut qemu, &["setup", "active", "active", "pre-switchover"]).await
        });
        let mut qmp = Qmp::connect(&path, LONG).await.unwrap();
        qmp.wait_migration_status(LONG, "pre-switchover")
            .await
            .unwrap();
        assert_eq!(qmp.status().await.unwrap(), "postmigrate");
        assert_eq!(server.await.unwrap(), 4);
    }

    #[tokio::test]
    async fn with_events_the_events_are_followed() {
        let dir = tempfile::tempdir().unwrap();
        let (path, listener) = listen(dir.path());
        let server = tokio::spawn(async move {
            let mut qemu = FakeQemu::accept(&listener).await;
            let c = qemu.command().await;
            assert_eq!(c.name, "migrate-set-capabilities");
            assert_eq!(
                c.args["capabilities"][1],
                json!({"capability": "events", "state": true})
            );
            qemu.reply(&c.id, "{}").await;
            let c = qemu.command().await;
            qemu.reply(&c.id, "{\"status\": \"active\"}").await;
            qemu.event("MIGRATION_PASS", "{\"pass\": 1}").await;
            qemu.event("STOP", "").await;
            qemu.migration("pre-switchover").await;
            answer_polls(&mut qemu, &[]).await
        });
        let mut qmp = Qmp::connect(&path, LONG).await.unwrap();
        let caps = [("x-ignore-shared", true), ("events", true)];
        qmp.set_capabilities(&caps).await.unwrap();
        qmp.wait_migration_status(LONG, "pre-switchover")
            .await
            .unwrap();
        assert_eq!(qmp.status().await.unwrap(), "postmigrate");
        let names: Vec<String> = qmp.take_events().into_iter().map(|e| e.name).collect();
        assert_eq!(
            names,
            ["MIGRATION_PASS", "STOP", "MIGRATION"],
            "events stay queued"
        );
        server.await.unwrap();
    }

    #[tokio::test]
    async fn an_event_that_overtakes_the_reply_counts() {
        let dir = tempfile::tempdir().unwrap();
        let (path, listener) = listen(dir.path());
        let server = tokio::spawn(async move {
            let mut qemu = FakeQemu::accept(&listener).await;
            let c = qemu.command().await;
            qemu.reply(&c.id, "{}").await;
            let c = qemu.command().await;
            qemu.migration("pre-switchover").await;
            qemu.reply(&c.id, "{\"status\": \"active\"}").await;
            answer_polls(&mut qemu, &[]).await
        });
        let mut qmp = Qmp::connect(&path, LONG).await.unwrap();
        qmp.set_capabilities(&[("events", true)]).await.unwrap();
        qmp.wait_migration_status(LONG, "pre-switchover")
            .await
            .unwrap();
        assert_eq!(qmp.status().await.unwrap(), "postmigrate");
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_failed_migration_ends_the_wait_with_qemus_reason() {
        let dir = tempfile::tempdir().unwrap();
        let (path, listener) = listen(dir.path());
        let server = tokio::spawn(async move {
            let mut qemu = FakeQemu::accept(&listener).await;
            let c = qemu.command().await;
            qemu.reply(&c.id, "{}").await;
            let c = qemu.command().await;
            qemu.reply(&c.id, "{\"status\": \"setup\"}").await;
            qemu.migration("failed").await;
            let c = qemu.command().await;
            assert_eq!(c.name, "query-migrate");
            qemu.reply(&c.id, FAILED).await;
        });
        let mut qmp = Qmp::connect(&path, LONG).await.unwrap();
        qmp.set_capabilities(&[("events", true)]).await.unwrap();
        let err = qmp
            .wait_migration_status(LONG, "completed")
            .await
            .unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, QmpError::MigrationEnded { .. }), "{err:?}");
        assert!(
            text.contains("failed") && text.contains("Connection refused"),
            "{text}"
        );
        server.await.unwrap();
    }

    #[tokio::test]
    async fn the_run_state_is_polled() {
        let dir = tempfile::tempdir().unwrap();
        let (path, listener) = listen(dir.path());
        let server = tokio::spawn(async move {
            let mut qemu = FakeQemu::accept(&listener).await;
            for status in ["finish-migrate", "finish-migrate", "postmigrate", "running"] {
                let c = qemu.command().await;
                assert_eq!(c.name, "query-status");
                qemu.reply(
                    &c.id,
                    &format!("{{\"status\": \"{status}\", \"running\": false}}"),
                )
                .await;
            }
        });
        let mut qmp = Qmp::connect(&path, LONG).await.unwrap();
        qmp.wait_status(LONG, "postmigrate").await.unwrap();
        // A zero timeout still asks once.
        let err = qmp.wait_status(Duration::ZERO, "paused").await.unwrap_err();
        assert!(
            err.to_string().contains("run state paused (it is running)"),
            "{err}"
        );
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_status_that_never_comes_times_out_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let (path, listener) = listen(dir.path());
        let server = tokio::spawn(async move {
            let mut qemu = FakeQemu::accept(&listener).await;
            loop {
                let c = qemu.command().await;
                if c.name == "quit" {
                    break;
                }
                qemu.reply(&c.id, "{\"status\": \"active\"}").await;
            }
        });
        let mut qmp = Qmp::connect(&path, LONG).await.unwrap();
        let err = qmp
            .wait_migration_status(Duration::from_millis(30), "completed")
            .await
            .unwrap_err();
        assert!(matches!(err, QmpError::Timeout { .. }), "{err:?}");
        assert!(
            err.to_string().contains("migration status completed"),
            "{err}"
        );
        qmp.quit().await.unwrap();
        server.await.unwrap();
    }
}
