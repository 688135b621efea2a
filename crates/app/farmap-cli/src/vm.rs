//! `farmap vm`: a QEMU guest whose RAM is a file on a farmap mount, moved live between two
//! QEMU processes (issue 32, docs/vm.md, docs/design/vm.md §4).
//!
//! QEMU moves the device state (`x-ignore-shared`: never a byte of the shared RAM); farmap
//! moves the RAM with the mount's own migration (instant over a shared store, or pre-copy).
//! The source mount stops the guest through its suspend hook, `farmap vm suspend`, which asks
//! this driver: the driver starts QEMU's migration with `pause-before-switchover`, and answers
//! once the source's vCPUs are stopped (`pre-switchover`). farmap then writes the last dirty
//! pages back and hands the file over; the driver sends `migrate-continue` only after the
//! destination reports the hand-over, so the destination's vCPUs never run on a file that is
//! not yet theirs.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use farmap_migrate::agent::{Controller, FailKind, LeechRequest, Reply, Request, SeedRequest};
use farmap_vm::Qmp;
use serde_json::{json, Map, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};

use farmap_cli_kit::args::parse_duration;
use farmap_cli_kit::output;

const VM_HELP: &str = "\
A VM ON FARMAP:
  farmap mount /run/vm/src 'farmap://10.0.0.5:7000' --managed --agent /run/vm/src.agent \\
      --prepare 'farmap vm prepare --control /run/vm/ctl' \\
      --suspend 'farmap vm suspend --control /run/vm/ctl'
  qemu-system-x86_64 ... -object memory-backend-file,id=ram0,mem-path=/run/vm/src/region,\\
      size=1G,share=on,discard-data=off -machine pc,memory-backend=ram0 -qmp unix:/run/vm/src.qmp,server=on,wait=off
  farmap mount /run/vm/dst --agent /run/vm/dst.agent
  farmap vm migrate --src-qmp /run/vm/src.qmp --src-agent /run/vm/src.agent \\
      --dst-agent /run/vm/dst.agent --dst-ram /run/vm/dst/region \\
      --dst-qmp /run/vm/dst.qmp --dst-launch 'qemu-system-x86_64 ...same flags, dst paths... -incoming defer'

  The destination QEMU has the source's command line but for its paths and
  `-incoming defer`; the driver starts it once the destination mount has the file.";

#[derive(Debug, Subcommand)]
pub enum VmCommand {
    /// Move a running QEMU guest whose RAM is a farmap mount to another QEMU: QEMU moves the
    /// device state, farmap the RAM. Prints a JSON line (--json) or a summary.
    #[command(after_help = VM_HELP)]
    Migrate(Box<MigrateArgs>),
    /// The source mount's suspend hook (`farmap mount --suspend 'farmap vm suspend --control
    /// PATH'`): asks `farmap vm migrate` to stop the guest, and exits 0 once it is stopped.
    Suspend(SuspendArgs),
    /// The source mount's prepare hook (`farmap mount --prepare 'farmap vm prepare --control
    /// PATH'`): asks `farmap vm migrate` to start the destination QEMU, and exits 0 once it
    /// waits for the VM, so that the guest is stopped as soon as farmap asks.
    Prepare(SuspendArgs),
    /// Save a guest whose RAM is a farmap mount for a lazy start: its device state into
    /// --state (QEMU's stream without the RAM, tens of KB), its RAM flushed to the mount's
    /// store (a `versioned:` store keeps it as a version with the order the guest touched its
    /// pages). QEMU quits afterwards.
    #[command(after_help = SAVE_HELP)]
    Save(SaveArgs),
    /// Start a saved guest: a QEMU started with `-incoming defer` whose RAM is the file of a
    /// farmap mount of the saved store loads --state and runs at once; its pages come on
    /// touch, the working set read ahead.
    #[command(after_help = SAVE_HELP)]
    Restore(RestoreArgs),
}

const SAVE_HELP: &str = "\
A LAZY START:
  farmap mount /run/vm/a 'versioned:(dir:/srv/vms)/vm1?size=1GiB' --managed
  qemu-system-x86_64 ... -object memory-backend-file,id=ram0,mem-path=/run/vm/a/region,\\
      size=1G,share=on,discard-data=off -machine pc,memory-backend=ram0 -qmp unix:/run/vm/a.qmp,server=on,wait=off
  farmap vm save --qmp /run/vm/a.qmp --ram /run/vm/a/region --state /srv/vms/vm1.state
  # later, on a host that reaches /srv/vms (or a copy of it):
  farmap mount /run/vm/b 'versioned:(dir:/srv/vms)/vm1' --managed
  qemu-system-x86_64 ...same flags, /run/vm/b paths... -incoming defer
  farmap vm restore --qmp /run/vm/b.qmp --state /srv/vms/vm1.state

  The state refers to the RAM as it was saved: restore it over the version the save made
  (the latest, unless the region was written since; `farmap snapshot` names it).";

#[derive(Debug, Args)]
pub struct SaveArgs {
    /// The guest's QMP socket.
    #[arg(long, value_name = "PATH")]
    qmp: PathBuf,
    /// The guest's RAM file on a farmap mount (DIR/region): left out of the state, and
    /// synced once the guest is stopped. Without it the whole guest is saved into --state.
    #[arg(long, value_name = "PATH")]
    ram: Option<PathBuf>,
    /// Where the state goes (written beside it, then renamed into place).
    #[arg(long, value_name = "PATH")]
    state: PathBuf,
    /// Keep QEMU (its guest stopped) instead of quitting it.
    #[arg(long)]
    keep: bool,
    /// How long the save may take.
    #[arg(long, default_value = "120s", value_parser = parse_duration)]
    timeout: Duration,
    /// Print the result as one JSON line.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
pub struct RestoreArgs {
    /// The QMP socket of a QEMU started with `-incoming defer`.
    #[arg(long, value_name = "PATH")]
    qmp: PathBuf,
    /// The state `farmap vm save` wrote.
    #[arg(long, value_name = "PATH")]
    state: PathBuf,
    /// The state holds the whole guest (saved without --ram).
    #[arg(long)]
    whole: bool,
    /// How long the restore may take.
    #[arg(long, default_value = "120s", value_parser = parse_duration)]
    timeout: Duration,
    /// Print the result as one JSON line.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
pub struct MigrateArgs {
    /// The source QEMU's QMP socket.
    #[arg(long, value_name = "PATH")]
    src_qmp: PathBuf,
    /// The source mount's migration agent (`farmap mount --agent`).
    #[arg(long, value_name = "PATH")]
    src_agent: PathBuf,
    /// The destination mount's migration agent (a `farmap mount DIR --agent` without a
    /// store).
    #[arg(long, value_name = "PATH")]
    dst_agent: PathBuf,
    /// The file the destination QEMU maps (DIR/region of the destination mount): the driver
    /// starts QEMU once it exists.
    #[arg(long, value_name = "PATH")]
    dst_ram: PathBuf,
    /// The destination QEMU's command (run with `sh -c`): the source's command line with the
    /// destination's paths and `-incoming defer`.
    #[arg(long, value_name = "CMD")]
    dst_launch: String,
    /// The destination QEMU's QMP socket (as in --dst-launch).
    #[arg(long, value_name = "PATH")]
    dst_qmp: PathBuf,
    /// How the RAM moves: instant (the mount's store is shared: only where each chunk is
    /// travels), precopy (the RAM is copied while the guest runs) or postcopy (the guest
    /// moves at once and its RAM follows, faulted pages first).
    #[arg(long, default_value = "instant", value_parser = parse_mode)]
    mode: farmap_migrate::Mode,
    /// Instant mode: the shared store the destination mount opens (the source mount's spec,
    /// as this host reaches it).
    #[arg(long, value_name = "SPEC")]
    store: Option<String>,
    /// Where the source mount's suspend hook reaches this driver (its `--control`).
    #[arg(long, value_name = "PATH")]
    control: PathBuf,
    /// Where QEMU's device state travels (the destination listens): tcp:HOST:PORT or
    /// unix:PATH. Default: unix:<dst-qmp>.incoming.
    #[arg(long, value_name = "URI")]
    incoming: Option<String>,
    /// The seeder's control address (the leecher connects to it).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
    /// Pre-copy's downtime budget for farmap's last round.
    #[arg(long, default_value = "10ms", value_parser = parse_duration)]
    max_downtime: Duration,
    /// How long each step may take (QEMU starting, the stop, the device state).
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    timeout: Duration,
    /// The migration key file (as for `farmap seed`).
    #[arg(long, value_name = "PATH")]
    key_file: Option<PathBuf>,
    /// Print the result as one JSON line.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
pub struct SuspendArgs {
    /// The driver's control socket (`farmap vm migrate --control`).
    #[arg(long, value_name = "PATH")]
    control: PathBuf,
    /// How long to wait for the driver's answer.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    timeout: Duration,
}

fn parse_mode(s: &str) -> Result<farmap_migrate::Mode, String> {
    s.parse()
}

pub async fn run(cmd: VmCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        VmCommand::Migrate(args) => migrate(*args).await,
        VmCommand::Suspend(args) => hook(args, "suspend").await,
        VmCommand::Prepare(args) => hook(args, "prepare").await,
        VmCommand::Save(args) => save(args).await,
        VmCommand::Restore(args) => restore(args).await,
    }
}

/// Milliseconds, to the microsecond.
fn secs_ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

async fn save(args: SaveArgs) -> anyhow::Result<ExitCode> {
    if let Some(ram) = &args.ram {
        std::fs::metadata(ram)
            .with_context(|| format!("the guest's RAM file {}", ram.display()))?;
    }
    let mut qmp = Qmp::connect(&args.qmp, Duration::from_secs(10))
        .await
        .context("the guest's QMP")?;
    let t0 = Instant::now();
    let saved = farmap_vm::save(&mut qmp, &args.state, args.ram.as_deref(), args.timeout)
        .await
        .context("saving the guest")?;
    if !args.keep {
        qmp.quit().await.context("stopping QEMU after the save")?;
    }
    let report = json!({
        "vm": "save",
        "state": args.state,
        "state_bytes": saved.state_bytes,
        "save_ms": secs_ms(saved.save),
        "flush_ms": saved.flush.map(secs_ms),
        "total_ms": secs_ms(t0.elapsed()),
    });
    if args.json {
        output::json_line(&report)?;
    } else {
        println!(
            "saved: {} ({} bytes of state) in {} ms",
            args.state.display(),
            saved.state_bytes,
            report["total_ms"]
        );
    }
    Ok(ExitCode::SUCCESS)
}

async fn restore(args: RestoreArgs) -> anyhow::Result<ExitCode> {
    let mut qmp = Qmp::connect(&args.qmp, Duration::from_secs(10))
        .await
        .context("the guest's QMP")?;
    let took = farmap_vm::restore(&mut qmp, &args.state, !args.whole, args.timeout)
        .await
        .context("restoring the guest")?;
    let report = json!({
        "vm": "restore",
        "state": args.state,
        "restore_ms": secs_ms(took),
    });
    if args.json {
        output::json_line(&report)?;
    } else {
        println!("restored: the guest runs ({} ms)", report["restore_ms"]);
    }
    Ok(ExitCode::SUCCESS)
}

/// The hooks: one line out (`prepare` or `suspend`), one line back (`ok` or `error: ...`).
async fn hook(args: SuspendArgs, word: &str) -> anyhow::Result<ExitCode> {
    let work = async {
        let stream = UnixStream::connect(&args.control).await.with_context(|| {
            format!(
                "connecting to farmap vm migrate at {} (is a migration running?)",
                args.control.display()
            )
        })?;
        let (read, mut write) = stream.into_split();
        write.write_all(format!("{word}\n").as_bytes()).await?;
        let mut line = String::new();
        BufReader::new(read).read_line(&mut line).await?;
        anyhow::Ok(line.trim().to_string())
    };
    let what = match word {
        "prepare" => "start the destination QEMU",
        _ => "stop the guest",
    };
    let answer = tokio::time::timeout(args.timeout, work)
        .await
        .with_context(|| format!("farmap vm migrate did not {what} within {:?}", args.timeout))??;
    if answer == "ok" {
        return Ok(ExitCode::SUCCESS);
    }
    bail!(
        "farmap vm migrate did not {what}: {}",
        answer.strip_prefix("error: ").unwrap_or(&answer)
    )
}

/// What the driver measured.
#[derive(Debug, Default)]
struct Times {
    start: Option<Instant>,
    prepare_asked: Option<Instant>,
    prepared: Option<Instant>,
    stop_asked: Option<Instant>,
    stopped: Option<Instant>,
    handed_over: Option<Instant>,
    resumed: Option<Instant>,
}

fn ms(from: Option<Instant>, to: Option<Instant>) -> Value {
    match (from, to) {
        (Some(a), Some(b)) => json!(secs_ms(b.saturating_duration_since(a))),
        _ => Value::Null,
    }
}

async fn migrate(args: MigrateArgs) -> anyhow::Result<ExitCode> {
    if args.mode == farmap_migrate::Mode::Instant && args.store.is_none() {
        bail!("--mode instant needs --store SPEC: the shared store the destination mount opens");
    }
    let key = crate::migrate::key_secret(args.key_file.clone(), true, "farmap vm migrate")?;
    let incoming = args
        .incoming
        .clone()
        .unwrap_or_else(|| format!("unix:{}.incoming", args.dst_qmp.display()));
    let _ = std::fs::remove_file(&args.control);
    let control = UnixListener::bind(&args.control)
        .with_context(|| format!("listening on {}", args.control.display()))?;
    // Whoever reaches it can stop the VM: this user only, whatever the umask.
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&args.control, std::fs::Permissions::from_mode(0o600))
            .with_context(|| format!("making {} private", args.control.display()))?;
    }
    let _unlink = Unlink(args.control.clone());
    let mut src = Qmp::connect(&args.src_qmp, args.timeout)
        .await
        .context("the source QEMU's QMP")?;
    let status = src.status().await?;
    if status != "running" {
        bail!("the source VM is {status}, not running");
    }
    let mut times = Times {
        start: Some(Instant::now()),
        ..Times::default()
    };
    let mut seeder = Controller::connect(&args.src_agent)
        .await
        .with_context(|| format!("the source mount's agent {}", args.src_agent.display()))?;
    seeder
        .send(&Request::Seed(SeedRequest {
            listen: args.listen.clone(),
            data_listen: "127.0.0.1:0".into(),
            tls: None,
            reconnect_ms: 30_000,
            pull: Default::default(),
            push_budget_ms: 2_000,
            key: Some(key.clone()),
        }))
        .await?;
    let from = loop {
        match next(&mut seeder, "source").await? {
            Reply::Listening { control, .. } => break control,
            Reply::Error { message, .. } => bail!("the source mount refused to seed: {message}"),
            _ => {}
        }
    };
    let mut leecher = Controller::connect(&args.dst_agent)
        .await
        .with_context(|| format!("the destination mount's agent {}", args.dst_agent.display()))?;
    leecher
        .send(&Request::Leech(LeechRequest {
            from,
            data: None,
            tls: None,
            max_downtime_us: args.max_downtime.as_micros() as u64,
            max_rounds: 30,
            workers: 16,
            connections: 4,
            reconnect_ms: 30_000,
            pull: Default::default(),
            mode: args.mode,
            store: args.store.clone(),
            key: Some(key),
        }))
        .await?;
    let mut driver = Driver {
        args: &args,
        incoming,
        dst_qemu: None,
        dst: None,
        migrating: false,
    };
    let result = driver
        .follow(&mut src, &mut seeder, &mut leecher, &control, &mut times)
        .await;
    match result {
        Ok((seed_report, leech_report)) => {
            finish(&args, src, driver, times, seed_report, leech_report).await
        }
        Err(e) => {
            driver.abandon(src, times.handed_over.is_some()).await;
            Err(e)
        }
    }
}

/// Removes a socket file when dropped.
struct Unlink(PathBuf);

impl Drop for Unlink {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

async fn next(c: &mut Controller, side: &str) -> anyhow::Result<Reply> {
    c.next()
        .await
        .with_context(|| format!("reading the {side} mount's agent"))?
        .with_context(|| format!("the {side} mount's agent closed the connection"))
}

struct Driver<'a> {
    args: &'a MigrateArgs,
    incoming: String,
    dst_qemu: Option<tokio::process::Child>,
    dst: Option<Qmp>,
    migrating: bool,
}

impl Driver<'_> {
    /// Follows both agents, the hook and QEMU to the end; the two agents' reports.
    async fn follow(
        &mut self,
        src: &mut Qmp,
        seeder: &mut Controller,
        leecher: &mut Controller,
        control: &UnixListener,
        times: &mut Times,
    ) -> anyhow::Result<(Map<String, Value>, Map<String, Value>)> {
        let (mut seed_done, mut leech_done) = (None, None);
        let mut hook: Option<tokio::net::unix::OwnedWriteHalf> = None;
        // At most CALLERS callers are heard at a time; more are dropped at once.
        const CALLERS: usize = 8;
        let (heard_tx, mut heard_rx) = tokio::sync::mpsc::channel(CALLERS);
        let hearing = std::sync::Arc::new(tokio::sync::Semaphore::new(CALLERS));
        let wait_ram = tokio::time::sleep(Duration::ZERO);
        tokio::pin!(wait_ram);
        while seed_done.is_none() || leech_done.is_none() {
            tokio::select! {
                r = next(seeder, "source"), if seed_done.is_none() => match r? {
                    Reply::Done { report } => seed_done = Some(report),
                    Reply::Error { kind, message } => bail!(failure("source", kind, &message)),
                    _ => {}
                },
                r = next(leecher, "destination"), if leech_done.is_none() => match r? {
                    Reply::HandedOver => {
                        times.handed_over = Some(Instant::now());
                        self.continue_source(src, times).await?;
                    }
                    Reply::Done { report } => leech_done = Some(report),
                    Reply::Error { kind, message } => bail!(failure("destination", kind, &message)),
                    _ => {}
                },
                conn = control.accept() => {
                    let (stream, _) = conn.context("accepting the suspend hook")?;
                    // Each caller's line is read on a task of its own: a caller that never
                    // speaks (or never ends its line) is dropped after 5 s or 64 bytes, and
                    // holds nothing meanwhile.
                    let heard = heard_tx.clone();
                    let Ok(pass) = hearing.clone().try_acquire_owned() else {
                        continue;
                    };
                    tokio::spawn(async move {
                        let _pass = pass;
                        let (read, write) = stream.into_split();
                        let mut line = String::new();
                        let read = tokio::time::timeout(
                            Duration::from_secs(5),
                            BufReader::new(read).take(64).read_line(&mut line),
                        )
                        .await;
                        if matches!(read, Ok(Ok(_))) && line.ends_with('\n') {
                            let _ = heard.send((line, write)).await;
                        }
                    });
                }
                Some((line, mut write)) = heard_rx.recv() => {
                    match line.trim() {
                        "suspend" => {}
                        "prepare" => {
                            times.prepare_asked = Some(Instant::now());
                            let ready = self.ensure_destination().await;
                            times.prepared = Some(Instant::now());
                            let answer = match &ready {
                                Ok(()) => "ok\n".to_string(),
                                Err(e) => format!("error: {e:#}\n"),
                            };
                            let _ = write.write_all(answer.as_bytes()).await;
                            ready?;
                            continue;
                        }
                        _ => continue,
                    }
                    times.stop_asked = Some(Instant::now());
                    match self.stop_source(src).await {
                        Ok(()) => {
                            times.stopped = Some(Instant::now());
                            write.write_all(b"ok\n").await?;
                            hook = Some(write);
                        }
                        Err(e) => {
                            let _ = write.write_all(format!("error: {e:#}\n").as_bytes()).await;
                            return Err(e);
                        }
                    }
                }
                () = &mut wait_ram, if self.dst_qemu.is_none() => {
                    if self.args.dst_ram.exists() {
                        self.start_destination().await?;
                    } else {
                        wait_ram.as_mut().reset(tokio::time::Instant::now() + Duration::from_millis(5));
                    }
                }
            }
        }
        drop(hook);
        Ok((
            seed_done.unwrap_or_default(),
            leech_done.unwrap_or_default(),
        ))
    }

    /// Starts the destination QEMU and has it listen for the device state.
    async fn start_destination(&mut self) -> anyhow::Result<()> {
        let _ = std::fs::remove_file(&self.args.dst_qmp);
        let child = tokio::process::Command::new("sh")
            .arg("-c")
            .arg(&self.args.dst_launch)
            .stdin(std::process::Stdio::null())
            // It outlives this command: stdout (the result's channel) must not stay open.
            .stdout(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .context("starting the destination QEMU (--dst-launch)")?;
        self.dst_qemu = Some(child);
        let mut dst = Qmp::connect(&self.args.dst_qmp, self.args.timeout)
            .await
            .context("the destination QEMU's QMP (--dst-qmp)")?;
        dst.set_capabilities(&[("x-ignore-shared", true), ("events", true)])
            .await?;
        dst.migrate_incoming(&self.incoming).await?;
        self.dst = Some(dst);
        Ok(())
    }

    /// Returns once the destination QEMU listens for the device state (started as soon as
    /// the destination mount has the file).
    async fn ensure_destination(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + self.args.timeout;
        while self.dst.is_none() {
            if Instant::now() > deadline {
                bail!("the destination QEMU was not ready to receive the VM");
            }
            if self.args.dst_ram.exists() && self.dst_qemu.is_none() {
                self.start_destination().await?;
            } else {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        Ok(())
    }

    /// Starts QEMU's migration and returns once the source's vCPUs are stopped.
    async fn stop_source(&mut self, src: &mut Qmp) -> anyhow::Result<()> {
        self.ensure_destination().await?;
        src.set_capabilities(&[
            ("x-ignore-shared", true),
            ("events", true),
            ("pause-before-switchover", true),
        ])
        .await?;
        src.migrate(&self.incoming).await?;
        self.migrating = true;
        src.wait_migration_status(self.args.timeout, "pre-switchover")
            .await
            .context("waiting for the source VM to stop")?;
        // For the test of a destination lost before the hand-over (vm_migrate.rs).
        if std::env::var("FARMAP_VM_TEST_KILL").as_deref() == Ok("dst-at-pre-switchover") {
            if let Some(child) = self.dst_qemu.as_mut() {
                let _ = child.kill().await;
            }
        }
        // The file is handed over only to a destination that can still take the VM.
        if let Some(child) = self.dst_qemu.as_mut() {
            if let Some(status) = child.try_wait()? {
                bail!("the destination QEMU exited ({status}) before the hand-over");
            }
        }
        Ok(())
    }

    /// After the hand-over: QEMU sends the device state; the destination VM runs.
    async fn continue_source(&mut self, src: &mut Qmp, times: &mut Times) -> anyhow::Result<()> {
        src.migrate_continue("pre-switchover").await?;
        src.wait_migration_status(self.args.timeout, "completed")
            .await
            .context("QEMU moving the device state")?;
        let dst = self.dst.as_mut().context("no destination QEMU")?;
        dst.wait_status(self.args.timeout, "running")
            .await
            .context("the destination VM starting")?;
        times.resumed = Some(Instant::now());
        Ok(())
    }

    /// A failed migration: before the hand-over the source VM runs on (QEMU restarts it when
    /// its migration is cancelled); after it, the source QEMU must never run again.
    async fn abandon(&mut self, mut src: Qmp, handed_over: bool) {
        if let Some(mut child) = self.dst_qemu.take() {
            let _ = child.kill().await;
        }
        if handed_over {
            let _ = src.quit().await;
        } else if self.migrating {
            let _ = src.execute("migrate_cancel", None).await;
        }
    }
}

fn failure(side: &str, kind: FailKind, message: &str) -> String {
    match kind {
        FailKind::AfterHandOver => {
            format!("the {side} mount failed after the hand-over: {message}")
        }
        _ => format!("aborted by the {side} mount (the source VM runs on): {message}"),
    }
}

async fn finish(
    args: &MigrateArgs,
    mut src: Qmp,
    mut driver: Driver<'_>,
    times: Times,
    seed: Map<String, Value>,
    leech: Map<String, Value>,
) -> anyhow::Result<ExitCode> {
    let info = src.query_migrate().await?;
    src.quit().await.context("stopping the source QEMU")?;
    // The destination QEMU outlives this command.
    if let Some(child) = driver.dst_qemu.take() {
        std::mem::forget(child);
    }
    let report = json!({
        "vm": "migrate",
        "mode": args.mode.to_string(),
        "qemu_downtime_ms": info.downtime_ms,
        "qemu_total_ms": info.total_time_ms,
        "qemu_bytes": info.ram_transferred,
        "prepare_ms": ms(times.prepare_asked, times.prepared),
        "prepared_to_stop_ms": ms(times.prepared, times.stop_asked),
        "stop_ms": ms(times.stop_asked, times.stopped),
        "handover_ms": ms(times.stopped, times.handed_over),
        "paused_ms": ms(times.stopped, times.resumed),
        "total_ms": ms(times.start, Some(Instant::now())),
        "farmap_downtime_ms": leech.get("downtime_ms"),
        "bytes_before_resume": leech.get("bytes_before_resume"),
        "farmap_bytes": leech.get("bytes_precopy").and_then(Value::as_u64).unwrap_or(0)
            + leech.get("bytes_postcopy").and_then(Value::as_u64).unwrap_or(0),
        "leech": leech,
        "seed": seed,
    });
    if args.json {
        output::json_line(&report)?;
    } else {
        println!(
            "migrated ({}): the VM was paused {} ms (QEMU's downtime {} ms; farmap's hand-over {} ms), total {} ms",
            report["mode"].as_str().unwrap_or(""),
            report["paused_ms"],
            report["qemu_downtime_ms"],
            report["handover_ms"],
            report["total_ms"]
        );
    }
    Ok(ExitCode::SUCCESS)
}
