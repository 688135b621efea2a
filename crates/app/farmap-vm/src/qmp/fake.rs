//! A scripted QMP server for the client's tests: it speaks as QEMU 7.2.22 does (CRLF line
//! ends, the recorded greeting), one line at a time, as the test says.

use std::path::{Path, PathBuf};

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixListener;

pub(crate) const GREETING: &str = "{\"QMP\": {\"version\": {\"qemu\": {\"micro\": 22, \"minor\": \
    2, \"major\": 7}, \"package\": \"Debian 1:7.2+dfsg-7+deb12u18+b3\"}, \"capabilities\": \
    [\"oob\"]}}";

/// One command as the fake received it.
#[derive(Debug)]
pub(crate) struct Command {
    pub(crate) name: String,
    pub(crate) args: Value,
    pub(crate) id: Value,
}

/// The server's end of one connection.
#[derive(Debug)]
pub(crate) struct FakeQemu {
    lines: Lines<BufReader<OwnedReadHalf>>,
    writer: OwnedWriteHalf,
}

/// A socket path in `dir` and a listener on it.
pub(crate) fn listen(dir: &Path) -> (PathBuf, UnixListener) {
    let path = dir.join("qmp.sock");
    let listener = UnixListener::bind(&path).unwrap();
    (path, listener)
}

impl FakeQemu {
    /// Accepts a client, greets it and answers its `qmp_capabilities`.
    pub(crate) async fn accept(listener: &UnixListener) -> Self {
        let (stream, _) = listener.accept().await.unwrap();
        let (read, writer) = stream.into_split();
        let mut fake = Self {
            lines: BufReader::new(read).lines(),
            writer,
        };
        fake.send(GREETING).await;
        let caps = fake.command().await;
        assert_eq!(caps.name, "qmp_capabilities");
        fake.reply(&caps.id, "{}").await;
        fake
    }

    /// The next command; panics at the end of the stream.
    pub(crate) async fn command(&mut self) -> Command {
        let line = self.lines.next_line().await.unwrap().expect("a command");
        let v: Value = serde_json::from_str(&line).unwrap();
        Command {
            name: v["execute"].as_str().unwrap().to_owned(),
            args: v.get("arguments").cloned().unwrap_or(Value::Null),
            id: v["id"].clone(),
        }
    }

    /// Sends one line (CRLF added).
    pub(crate) async fn send(&mut self, line: &str) {
        self.writer.write_all(line.as_bytes()).await.unwrap();
        self.writer.write_all(b"\r\n").await.unwrap();
    }

    /// Sends bytes as they are.
    pub(crate) async fn send_raw(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.writer.write_all(bytes).await
    }

    /// Sends a success reply with `id`; `value` is JSON text.
    pub(crate) async fn reply(&mut self, id: &Value, value: &str) {
        self.send(&format!("{{\"return\": {value}, \"id\": {id}}}"))
            .await;
    }

    /// Sends an event; `data` is JSON text, or empty for none.
    pub(crate) async fn event(&mut self, name: &str, data: &str) {
        let stamp = "\"timestamp\": {\"seconds\": 1796111742, \"microseconds\": 975775}";
        let line = match data {
            "" => format!("{{{stamp}, \"event\": \"{name}\"}}"),
            data => format!("{{{stamp}, \"event\": \"{name}\", \"data\": {data}}}"),
        };
        self.send(&line).await;
    }

    /// Sends a `MIGRATION` event with `status`.
    pub(crate) async fn migration(&mut self, status: &str) {
        self.event("MIGRATION", &format!("{{\"status\": \"{status}\"}}"))
            .await;
    }
}
