//! The async QMP client: one connection to one QEMU's QMP socket.

use std::collections::VecDeque;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;
use tokio::time::Instant;

use super::codec::{encode_command, parse_line, Event, Greeting, Message, MAX_LINE};
use super::error::{CodecError, QmpError};
use crate::version::QemuVersion;

/// How long a command waits for its reply unless told otherwise
/// ([`Qmp::set_command_timeout`]).
pub const DEFAULT_COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

/// Most events kept for later ([`Qmp::next_event`]); past it the oldest are dropped (and
/// logged), so a chatty QEMU that nobody listens to cannot grow memory without end.
pub const MAX_QUEUED_EVENTS: usize = 4096;

/// How often [`Qmp::connect`] tries again while the socket does not exist yet.
const CONNECT_RETRY: Duration = Duration::from_millis(10);

/// A QMP connection in command mode (the greeting read, `qmp_capabilities` done).
///
/// - Commands run one at a time (`&mut self`); each carries an `id`, and its reply is the one
///   with that `id`. Replies to an earlier command given up on (a timeout) are dropped.
/// - Events that arrive while a command waits for its reply are queued, in order, for
///   [`next_event`](Self::next_event) and [`wait_event`](Self::wait_event) (at most
///   [`MAX_QUEUED_EVENTS`]).
/// - Cancel-safe: a future dropped half-way through a line (a timeout) keeps what it read.
/// - After an error other than [`QmpError::Qemu`], [`QmpError::Timeout`] or
///   [`QmpError::MigrationEnded`], the connection is in an unknown state: drop it.
#[derive(Debug)]
pub struct Qmp {
    path: PathBuf,
    reader: BufReader<OwnedReadHalf>,
    /// The start of a line whose end has not arrived yet.
    partial: Vec<u8>,
    writer: OwnedWriteHalf,
    greeting: Greeting,
    next_id: u64,
    /// Queued events, each with its arrival number.
    pub(super) events: VecDeque<(u64, Event)>,
    /// The arrival number the next event gets.
    pub(super) event_seq: u64,
    /// Whether the migration `events` capability is on (as far as this connection set it).
    pub(super) migration_events: bool,
    command_timeout: Duration,
}

/// A point in time something awaited must arrive by, and the timeout it came from (for the
/// error message).
#[derive(Debug, Clone, Copy)]
pub(super) struct Deadline {
    pub(super) at: Instant,
    pub(super) timeout: Duration,
}

impl Deadline {
    pub(super) fn after(timeout: Duration) -> Self {
        Self {
            at: Instant::now() + timeout,
            timeout,
        }
    }
}

impl Qmp {
    /// Connects to QEMU's QMP socket, reads the greeting and enters command mode
    /// (`qmp_capabilities`, no QMP capability enabled).
    ///
    /// QEMU creates the socket at start-up, so a socket that does not exist yet (or does not
    /// accept yet) is tried again every 10 ms until `timeout`, which bounds the whole
    /// connection, greeting and negotiation included.
    pub async fn connect(path: impl AsRef<Path>, timeout: Duration) -> Result<Self, QmpError> {
        let path = path.as_ref().to_path_buf();
        let deadline = Deadline::after(timeout);
        let stream = connect_retrying(&path, deadline).await?;
        let (read, writer) = stream.into_split();
        let mut qmp = Self {
            path,
            reader: BufReader::new(read),
            partial: Vec::new(),
            writer,
            greeting: Greeting {
                version: QemuVersion::new(0, 0, 0),
                package: String::new(),
                capabilities: Vec::new(),
            },
            next_id: 1,
            events: VecDeque::new(),
            event_seq: 0,
            migration_events: false,
            command_timeout: DEFAULT_COMMAND_TIMEOUT,
        };
        match qmp.read_by(deadline, || "QEMU's greeting".into()).await? {
            Message::Greeting(g) => qmp.greeting = g,
            other => return Err(qmp.unexpected(format!("a greeting expected, got {other:?}"))),
        }
        qmp.execute_by("qmp_capabilities", None, deadline).await?;
        tracing::debug!(path = %qmp.path.display(), version = %qmp.greeting.version, "QMP connected");
        Ok(qmp)
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// QEMU's greeting.
    pub fn greeting(&self) -> &Greeting {
        &self.greeting
    }

    /// QEMU's version, from the greeting.
    pub fn version(&self) -> QemuVersion {
        self.greeting.version
    }

    /// Sets how long a command waits for its reply (default [`DEFAULT_COMMAND_TIMEOUT`]).
    pub fn set_command_timeout(&mut self, timeout: Duration) {
        self.command_timeout = timeout;
    }

    /// Runs a command and returns its `return` value, or QEMU's error as
    /// [`QmpError::Qemu`]. Events that arrive meanwhile are queued.
    pub async fn execute(&mut self, name: &str, args: Option<Value>) -> Result<Value, QmpError> {
        let deadline = Deadline::after(self.command_timeout);
        self.execute_by(name, args, deadline).await
    }

    /// The next event: the oldest queued one, else the next to arrive within `timeout`.
    pub async fn next_event(&mut self, timeout: Duration) -> Result<Event, QmpError> {
        if let Some((_, event)) = self.events.pop_front() {
            return Ok(event);
        }
        let deadline = Deadline::after(timeout);
        self.read_event_by(deadline, || "an event".into()).await
    }

    /// The first event for which `pred` holds: searched in the queue first (and taken out of
    /// it), then among the events that arrive within `timeout`. Events that do not match stay
    /// queued, in order.
    pub async fn wait_event(
        &mut self,
        timeout: Duration,
        mut pred: impl FnMut(&Event) -> bool,
    ) -> Result<Event, QmpError> {
        if let Some(pos) = self.events.iter().position(|(_, e)| pred(e)) {
            return Ok(self.events.remove(pos).expect("position in range").1);
        }
        let deadline = Deadline::after(timeout);
        loop {
            let event = self
                .read_event_by(deadline, || "a matching event".into())
                .await?;
            if pred(&event) {
                return Ok(event);
            }
            self.queue_event(event);
        }
    }

    /// Takes every queued event out of the queue, oldest first.
    pub fn take_events(&mut self) -> Vec<Event> {
        self.events.drain(..).map(|(_, e)| e).collect()
    }

    /// Asks QEMU to exit (`quit`). QEMU may close the socket before its reply arrives (7.2
    /// sends a `SHUTDOWN` event, then the reply, then closes, sometimes with a reset): the
    /// reply, a closed socket, and a QEMU already gone all count as success.
    pub async fn quit(mut self) -> Result<(), QmpError> {
        let deadline = Deadline::after(self.command_timeout);
        let id = self.take_id();
        let line = encode_command("quit", None, Some(Value::from(id)));
        match self.send(&line).await {
            Err(QmpError::Io { source, .. }) if gone(&source) => return Ok(()),
            other => other?,
        }
        loop {
            match self.read_by(deadline, || "the reply to quit".into()).await {
                Ok(Message::Return { id: Some(got), .. }) if got == id => return Ok(()),
                Ok(Message::Error {
                    id: got,
                    class,
                    desc,
                }) if got.is_none() || got == Some(Value::from(id)) => {
                    return Err(QmpError::Qemu {
                        command: "quit".into(),
                        class,
                        desc,
                    })
                }
                Ok(_) => continue,
                Err(QmpError::Closed { .. }) => return Ok(()),
                Err(QmpError::Io { source, .. }) if gone(&source) => return Ok(()),
                Err(e) => return Err(e),
            }
        }
    }

    /// [`execute`](Self::execute) with an explicit deadline.
    pub(super) async fn execute_by(
        &mut self,
        name: &str,
        args: Option<Value>,
        deadline: Deadline,
    ) -> Result<Value, QmpError> {
        let events_cap = match name {
            "migrate-set-capabilities" => events_capability(args.as_ref()),
            _ => None,
        };
        let id = self.take_id();
        self.send(&encode_command(name, args, Some(Value::from(id))))
            .await?;
        loop {
            let what = || format!("the reply to {name}");
            match self.read_by(deadline, what).await? {
                Message::Return {
                    id: Some(got),
                    value,
                } if got == id => {
                    if let Some(on) = events_cap {
                        self.migration_events = on;
                    }
                    return Ok(value);
                }
                // An error without an id is one QEMU raised before it could read the id: the
                // command just sent (commands are answered in order).
                Message::Error {
                    id: got,
                    class,
                    desc,
                } if got.is_none() || got == Some(Value::from(id)) => {
                    return Err(QmpError::Qemu {
                        command: name.into(),
                        class,
                        desc,
                    })
                }
                Message::Event(event) => self.queue_event(event),
                Message::Greeting(_) => return Err(self.unexpected("a second greeting".into())),
                stale => tracing::debug!(?stale, "dropping a QMP reply to an earlier command"),
            }
        }
    }

    /// Reads the next event from the socket (not the queue) by `deadline`; replies to
    /// earlier commands are dropped.
    pub(super) async fn read_event_by(
        &mut self,
        deadline: Deadline,
        what: impl Fn() -> String,
    ) -> Result<Event, QmpError> {
        loop {
            match self.read_by(deadline, &what).await? {
                Message::Event(event) => return Ok(event),
                Message::Greeting(_) => return Err(self.unexpected("a second greeting".into())),
                stale => tracing::debug!(?stale, "dropping a QMP reply to an earlier command"),
            }
        }
    }

    /// Queues an event, dropping the oldest past [`MAX_QUEUED_EVENTS`].
    pub(super) fn queue_event(&mut self, event: Event) {
        if self.events.len() >= MAX_QUEUED_EVENTS {
            if let Some((_, old)) = self.events.pop_front() {
                tracing::warn!(event = %old.name, "QMP event queue full: dropping the oldest event");
            }
        }
        self.events.push_back((self.event_seq, event));
        self.event_seq += 1;
    }

    fn take_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    fn unexpected(&self, what: String) -> QmpError {
        QmpError::Unexpected {
            path: self.path.clone(),
            what,
        }
    }

    async fn send(&mut self, line: &str) -> Result<(), QmpError> {
        self.writer
            .write_all(line.as_bytes())
            .await
            .map_err(|source| QmpError::Io {
                path: self.path.clone(),
                source,
            })
    }

    /// The next message, by `deadline`.
    async fn read_by(
        &mut self,
        deadline: Deadline,
        what: impl FnOnce() -> String,
    ) -> Result<Message, QmpError> {
        match tokio::time::timeout_at(deadline.at, self.read_message()).await {
            Ok(message) => message,
            Err(_) => Err(QmpError::Timeout {
                path: self.path.clone(),
                what: what(),
                timeout: deadline.timeout,
            }),
        }
    }

    /// The next message. Cancel-safe: the bytes of an unfinished line stay in `partial`.
    async fn read_message(&mut self) -> Result<Message, QmpError> {
        loop {
            let room = (MAX_LINE + 1).saturating_sub(self.partial.len()) as u64;
            let read = (&mut self.reader)
                .take(room)
                .read_until(b'\n', &mut self.partial)
                .await;
            let n = read.map_err(|source| QmpError::Io {
                path: self.path.clone(),
                source,
            })?;
            if self.partial.last() == Some(&b'\n') {
                let bytes = std::mem::take(&mut self.partial);
                return self.decode(bytes);
            }
            if self.partial.len() > MAX_LINE {
                let len = std::mem::take(&mut self.partial).len();
                let source = CodecError::TooLong { len, max: MAX_LINE };
                return Err(self.codec_error(source));
            }
            if n == 0 {
                return Err(QmpError::Closed {
                    path: self.path.clone(),
                });
            }
        }
    }

    fn decode(&self, bytes: Vec<u8>) -> Result<Message, QmpError> {
        let line = String::from_utf8(bytes).map_err(|_| self.codec_error(CodecError::NotUtf8))?;
        let message = parse_line(&line).map_err(|e| self.codec_error(e))?;
        tracing::trace!(path = %self.path.display(), line = line.trim_end(), "QMP in");
        Ok(message)
    }

    fn codec_error(&self, source: CodecError) -> QmpError {
        QmpError::Codec {
            path: self.path.clone(),
            source,
        }
    }
}

/// Connects to `path`, trying again while it does not exist or does not accept.
async fn connect_retrying(path: &Path, deadline: Deadline) -> Result<UnixStream, QmpError> {
    loop {
        let error = match tokio::time::timeout_at(deadline.at, UnixStream::connect(path)).await {
            Ok(Ok(stream)) => return Ok(stream),
            Ok(Err(e)) => e,
            Err(_) => io::Error::from(io::ErrorKind::TimedOut),
        };
        let retry = matches!(
            error.kind(),
            io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused | io::ErrorKind::TimedOut
        );
        if !retry {
            return Err(QmpError::Io {
                path: path.into(),
                source: error,
            });
        }
        if Instant::now() + CONNECT_RETRY > deadline.at {
            return Err(QmpError::ConnectTimeout {
                path: path.into(),
                timeout: deadline.timeout,
                source: error,
            });
        }
        tokio::time::sleep(CONNECT_RETRY).await;
    }
}

/// The state a `migrate-set-capabilities` gives the `events` capability, if it names it.
fn events_capability(args: Option<&Value>) -> Option<bool> {
    let caps = args?.get("capabilities")?.as_array()?;
    caps.iter()
        .filter(|c| c.get("capability").and_then(Value::as_str) == Some("events"))
        .filter_map(|c| c.get("state").and_then(Value::as_bool))
        .next_back()
}

/// Whether an I/O error means the peer has gone.
fn gone(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset | io::ErrorKind::NotConnected
    )
}

#[cfg(test)]
mod tests {
    use serde_json::json;
    use tokio::io::AsyncWriteExt;

    use super::*;
    use crate::qmp::fake::{listen, FakeQemu};

    const LONG: Duration = Duration::from_secs(10);

    #[tokio::test]
    async fn connect_waits_for_the_socket_to_appear() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("qmp.sock");
        let bind_at = path.clone();
        let server = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let listener = tokio::net::UnixListener::bind(&bind_at).unwrap();
            FakeQemu::accept(&listener).await
        });
        let qmp = Qmp::connect(&path, LONG).await.unwrap();
        assert_eq!(qmp.version(), QemuVersion::new(7, 2, 22));
        assert_eq!(qmp.greeting().capabilities, ["oob"]);
        assert_eq!(qmp.path(), path);
        server.await.unwrap();
    }

    #[tokio::test]
    async fn connect_timeout_names_the_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("absent.sock");
        let err = Qmp::connect(&path, Duration::from_millis(50))
            .await
            .unwrap_err();
        assert!(matches!(err, QmpError::ConnectTimeout { .. }), "{err:?}");
        assert!(err.to_string().contains("absent.sock"), "{err}");
    }

    #[tokio::test]
    async fn a_first_line_that_is_not_a_greeting_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (path, listener) = listen(dir.path());
        let server = tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            stream.write_all(b"{\"return\": {}}\r\n").await.unwrap();
            stream
        });
        let err = Qmp::connect(&path, LONG).await.unwrap_err();
        assert!(matches!(err, QmpError::Unexpected { .. }), "{err:?}");
        drop(server.await.unwrap());
    }

    #[tokio::test]
    async fn replies_match_ids_and_events_wait_in_the_queue() {
        let dir = tempfile::tempdir().unwrap();
        let (path, listener) = listen(dir.path());
        let server = tokio::spawn(async move {
            let mut qemu = FakeQemu::accept(&listener).await;
            let c = qemu.command().await;
            assert_eq!(c.name, "query-status");
            qemu.event("STOP", "").await;
            qemu.reply(&json!(999), "{\"status\": \"stale\"}").await;
            qemu.reply(&c.id, "{\"status\": \"paused\", \"running\": false}")
                .await;
            let c = qemu.command().await;
            let err = "{\"class\": \"CommandNotFound\", \"desc\": \"The command bogus has not been found\"}";
            qemu.send(&format!("{{\"id\": {}, \"error\": {err}}}", c.id))
                .await;
            qemu.event("POWERDOWN", "").await;
            qemu.event("RESUME", "").await;
            qemu
        });
        let mut qmp = Qmp::connect(&path, LONG).await.unwrap();
        let status = qmp.execute("query-status", None).await.unwrap();
        assert_eq!(status["status"], "paused");
        let err = qmp.execute("bogus", Some(json!({}))).await.unwrap_err();
        assert_eq!(err.qemu_class(), Some("CommandNotFound"));
        assert!(err.to_string().contains("bogus"), "{err}");
        let resume = qmp.wait_event(LONG, |e| e.name == "RESUME").await.unwrap();
        assert_eq!(resume.name, "RESUME");
        assert_eq!(qmp.next_event(LONG).await.unwrap().name, "STOP");
        assert_eq!(qmp.next_event(LONG).await.unwrap().name, "POWERDOWN");
        assert!(qmp.take_events().is_empty());
        let _qemu = server.await.unwrap();
    }

    #[tokio::test]
    async fn quit_takes_a_closed_socket_for_success() {
        let dir = tempfile::tempdir().unwrap();
        let (path, listener) = listen(dir.path());
        let server = tokio::spawn(async move {
            let mut qemu = FakeQemu::accept(&listener).await;
            assert_eq!(qemu.command().await.name, "quit");
            qemu.event(
                "SHUTDOWN",
                "{\"guest\": false, \"reason\": \"host-qmp-quit\"}",
            )
            .await;
        });
        let qmp = Qmp::connect(&path, LONG).await.unwrap();
        qmp.quit().await.unwrap();
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_closed_socket_and_a_silent_qemu_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let (path, listener) = listen(dir.path());
        let server = tokio::spawn(async move {
            let mut qemu = FakeQemu::accept(&listener).await;
            assert_eq!(qemu.command().await.name, "query-status");
            assert_eq!(qemu.command().await.name, "stop");
        });
        let mut qmp = Qmp::connect(&path, LONG).await.unwrap();
        qmp.set_command_timeout(Duration::from_millis(50));
        let err = qmp.execute("query-status", None).await.unwrap_err();
        assert!(matches!(err, QmpError::Timeout { .. }), "{err:?}");
        assert!(
            err.to_string().contains("the reply to query-status"),
            "{err}"
        );
        let err = qmp.execute("stop", None).await.unwrap_err();
        server.await.unwrap();
        let err = match err {
            QmpError::Timeout { .. } => qmp.execute("cont", None).await.unwrap_err(),
            other => other,
        };
        assert!(matches!(err, QmpError::Closed { .. }), "{err:?}");
        let text = err.to_string();
        assert!(text.starts_with("QEMU closed the QMP socket") && text.contains("qmp.sock"));
    }

    #[tokio::test]
    async fn a_line_past_the_limit_is_refused_without_storing_it() {
        let dir = tempfile::tempdir().unwrap();
        let (path, listener) = listen(dir.path());
        let server = tokio::spawn(async move {
            let mut qemu = FakeQemu::accept(&listener).await;
            qemu.command().await;
            // The client stops reading at the limit and hangs up: the write fails.
            let _ = qemu.send_raw("a".repeat(2 * MAX_LINE).as_bytes()).await;
        });
        let mut qmp = Qmp::connect(&path, LONG).await.unwrap();
        let err = qmp.execute("query-status", None).await.unwrap_err();
        match &err {
            QmpError::Codec {
                source: CodecError::TooLong { len, max },
                ..
            } => assert_eq!((*len, *max), (MAX_LINE + 1, MAX_LINE)),
            other => panic!("{other:?}"),
        }
        drop(qmp);
        server.await.unwrap();
    }
}
