//! The QMP line codec, sans I/O: one JSON object per line in each direction.
//!
//! What QEMU sends (docs/interop/qmp-spec in QEMU's tree; every server line ends with CRLF):
//!
//! - first, a greeting: `{"QMP": {"version": {"qemu": {..}, "package": ".."}, "capabilities": [..]}}`;
//! - a reply per command: `{"return": VALUE, "id": ID}` or
//!   `{"error": {"class": "..", "desc": ".."}, "id": ID}`, where `id` is the command's own (and
//!   missing when QEMU could not read the command far enough to see it);
//! - events, at any time between replies:
//!   `{"event": "NAME", "data": {..}, "timestamp": {"seconds": S, "microseconds": U}}`, `data`
//!   optional, the timestamp `-1, -1` when QEMU could not read the clock.
//!
//! A line is checked whole before anything of it is used, and a line longer than [`MAX_LINE`]
//! is refused before it is parsed (the reader refuses it before it is even stored).

use serde_json::{Map, Value};

use super::error::CodecError;
use crate::version::QemuVersion;

/// The longest QMP line accepted, in bytes, its line end included. QEMU's largest replies
/// (`query-qmp-schema`, about 200 KiB in 7.2) fit several times over.
pub const MAX_LINE: usize = 1 << 20;

/// One message from QEMU.
#[derive(Debug, Clone, PartialEq)]
pub enum Message {
    /// The first line of a connection.
    Greeting(Greeting),
    /// A command's success.
    Return {
        /// The command's `id`, when it had one.
        id: Option<Value>,
        /// What the command returned (`{}` when it returns nothing).
        value: Value,
    },
    /// A command's failure.
    Error {
        /// The command's `id`; `None` also when QEMU failed before reading it.
        id: Option<Value>,
        /// The error class (`GenericError`, `CommandNotFound`, ...).
        class: String,
        /// A description for people; not to be parsed.
        desc: String,
    },
    /// An asynchronous event.
    Event(Event),
}

/// QEMU's greeting: its version and the QMP capabilities it offers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Greeting {
    /// The QEMU version.
    pub version: QemuVersion,
    /// The distribution's package string (`Debian 1:7.2+dfsg-7+deb12u18+b3`), maybe empty.
    pub package: String,
    /// The QMP capabilities offered (`oob`); none is enabled unless asked for.
    pub capabilities: Vec<String>,
}

/// An asynchronous event (`STOP`, `RESUME`, `MIGRATION`, `SHUTDOWN`, ...).
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// The event's name.
    pub name: String,
    /// Its data, `Value::Null` when it has none.
    pub data: Value,
    /// When QEMU emitted it: seconds and microseconds since the Unix epoch (both -1 when
    /// QEMU could not read its clock).
    pub timestamp: (i64, i64),
}

impl Event {
    /// The status of a `MIGRATION` event (`setup`, `active`, `pre-switchover`, `device`,
    /// `completed`, `failed`, `cancelled`, ...); `None` for other events.
    pub fn migration_status(&self) -> Option<&str> {
        if self.name != "MIGRATION" {
            return None;
        }
        self.data.get("status")?.as_str()
    }
}

/// Parses one line from QEMU (with or without its line end).
pub fn parse_line(line: &str) -> Result<Message, CodecError> {
    if line.len() > MAX_LINE {
        return Err(CodecError::TooLong {
            len: line.len(),
            max: MAX_LINE,
        });
    }
    let value: Value = serde_json::from_str(line.trim_end()).map_err(CodecError::Json)?;
    let Value::Object(obj) = value else {
        return Err(malformed("not a JSON object"));
    };
    let kinds = ["QMP", "return", "error", "event"];
    let mut present = kinds.iter().filter(|k| obj.contains_key(**k));
    let (Some(kind), None) = (present.next(), present.next()) else {
        return Err(malformed(
            "not exactly one of the members QMP, return, error, event",
        ));
    };
    match *kind {
        "QMP" => parse_greeting(&obj["QMP"]).map(Message::Greeting),
        "return" => Ok(Message::Return {
            id: obj.get("id").cloned(),
            value: obj["return"].clone(),
        }),
        "error" => {
            let err = &obj["error"];
            Ok(Message::Error {
                id: obj.get("id").cloned(),
                class: str_member(err, "class").ok_or(malformed("error without a class"))?,
                desc: str_member(err, "desc").ok_or(malformed("error without a desc"))?,
            })
        }
        _ => parse_event(&obj).map(Message::Event),
    }
}

/// One command as a line for QEMU, its `\n` included: `{"execute": NAME, "arguments": ARGS,
/// "id": ID}`, without the members that are `None`.
pub fn encode_command(name: &str, args: Option<Value>, id: Option<Value>) -> String {
    let mut obj = Map::new();
    obj.insert("execute".into(), Value::String(name.into()));
    if let Some(args) = args {
        obj.insert("arguments".into(), args);
    }
    if let Some(id) = id {
        obj.insert("id".into(), id);
    }
    let mut line = Value::Object(obj).to_string();
    line.push('\n');
    line
}

fn malformed(what: &'static str) -> CodecError {
    CodecError::Malformed { what }
}

fn str_member(v: &Value, key: &str) -> Option<String> {
    v.get(key)?.as_str().map(str::to_owned)
}

fn u32_member(v: &Value, key: &str) -> Option<u32> {
    v.get(key)?.as_u64()?.try_into().ok()
}

fn parse_greeting(qmp: &Value) -> Result<Greeting, CodecError> {
    let version = qmp
        .get("version")
        .ok_or(malformed("greeting without a version"))?;
    let qemu = version
        .get("qemu")
        .ok_or(malformed("greeting without a QEMU version"))?;
    let number = |key| u32_member(qemu, key).ok_or(malformed("greeting's version is not numbers"));
    let version_numbers = QemuVersion::new(number("major")?, number("minor")?, number("micro")?);
    let package = match version.get("package") {
        None => String::new(),
        Some(p) => p
            .as_str()
            .ok_or(malformed("greeting's package is not a string"))?
            .to_owned(),
    };
    let capabilities = qmp
        .get("capabilities")
        .and_then(Value::as_array)
        .ok_or(malformed("greeting without a capabilities list"))?
        .iter()
        .map(|c| c.as_str().map(str::to_owned))
        .collect::<Option<Vec<_>>>()
        .ok_or(malformed("greeting's capabilities are not strings"))?;
    Ok(Greeting {
        version: version_numbers,
        package,
        capabilities,
    })
}

fn parse_event(obj: &Map<String, Value>) -> Result<Event, CodecError> {
    let name = obj["event"]
        .as_str()
        .ok_or(malformed("event name is not a string"))?;
    let stamp = obj
        .get("timestamp")
        .ok_or(malformed("event without a timestamp"))?;
    let part = |key| {
        stamp
            .get(key)
            .and_then(Value::as_i64)
            .ok_or(malformed("event timestamp is not two integers"))
    };
    Ok(Event {
        name: name.to_owned(),
        data: obj.get("data").cloned().unwrap_or(Value::Null),
        timestamp: (part("seconds")?, part("microseconds")?),
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    // Lines as QEMU 7.2.22 (Debian bookworm) sent them, CRLF included.
    const GREETING: &str = "{\"QMP\": {\"version\": {\"qemu\": {\"micro\": 22, \"minor\": 2, \
        \"major\": 7}, \"package\": \"Debian 1:7.2+dfsg-7+deb12u18+b3\"}, \"capabilities\": \
        [\"oob\"]}}\r\n";

    fn event(line: &str) -> Event {
        match parse_line(line).unwrap() {
            Message::Event(e) => e,
            other => panic!("not an event: {other:?}"),
        }
    }

    #[test]
    fn greeting_of_7_2_22() {
        let Message::Greeting(g) = parse_line(GREETING).unwrap() else {
            panic!("not a greeting");
        };
        assert_eq!(g.version, QemuVersion::new(7, 2, 22));
        assert_eq!(g.package, "Debian 1:7.2+dfsg-7+deb12u18+b3");
        assert_eq!(g.capabilities, ["oob"]);
    }

    #[test]
    fn returns_with_and_without_id() {
        assert_eq!(
            parse_line("{\"return\": {}}\r\n").unwrap(),
            Message::Return {
                id: None,
                value: json!({})
            }
        );
        let status = "{\"return\": {\"status\": \"prelaunch\", \"singlestep\": false, \
                      \"running\": false}, \"id\": 1}\r\n";
        let Message::Return { id, value } = parse_line(status).unwrap() else {
            panic!("not a return");
        };
        assert_eq!(id, Some(json!(1)));
        assert_eq!(value["status"], "prelaunch");
    }

    #[test]
    fn errors() {
        let refused = "{\"id\": \"x\", \"error\": {\"class\": \"CommandNotFound\", \"desc\": \
                       \"The command bogus has not been found\"}}\r\n";
        assert_eq!(
            parse_line(refused).unwrap(),
            Message::Error {
                id: Some(json!("x")),
                class: "CommandNotFound".into(),
                desc: "The command bogus has not been found".into(),
            }
        );
        let generic = "{\"error\": {\"class\": \"GenericError\", \"desc\": \"Migration not \
                       in expected state: none\"}}\r\n";
        let Message::Error { id, class, .. } = parse_line(generic).unwrap() else {
            panic!("not an error");
        };
        assert_eq!((id, class.as_str()), (None, "GenericError"));
    }

    #[test]
    fn events_stop_resume_migration() {
        let stop = event(
            "{\"timestamp\": {\"seconds\": 1796111742, \"microseconds\": 975775}, \
             \"event\": \"STOP\"}\r\n",
        );
        assert_eq!(stop.name, "STOP");
        assert_eq!(stop.data, Value::Null);
        assert_eq!(stop.timestamp, (1796111742, 975775));
        assert_eq!(stop.migration_status(), None);
        let resume = event(
            "{\"timestamp\": {\"seconds\": 1796111742, \"microseconds\": 980852}, \
             \"event\": \"RESUME\"}\r\n",
        );
        assert_eq!(resume.name, "RESUME");
        let mig = event(
            "{\"timestamp\": {\"seconds\": 1796111742, \"microseconds\": 976826}, \
             \"event\": \"MIGRATION\", \"data\": {\"status\": \"pre-switchover\"}}\r\n",
        );
        assert_eq!(mig.migration_status(), Some("pre-switchover"));
        let pass = event(
            "{\"timestamp\": {\"seconds\": 1796111742, \"microseconds\": 974780}, \
             \"event\": \"MIGRATION_PASS\", \"data\": {\"pass\": 1}}\r\n",
        );
        assert_eq!(
            (pass.data["pass"].as_u64(), pass.migration_status()),
            (Some(1), None)
        );
        let no_clock = event(
            "{\"timestamp\": {\"seconds\": -1, \"microseconds\": -1}, \"event\": \"SHUTDOWN\", \
             \"data\": {\"guest\": false, \"reason\": \"host-qmp-quit\"}}",
        );
        assert_eq!(no_clock.timestamp, (-1, -1));
        assert_eq!(no_clock.data["reason"], "host-qmp-quit");
    }

    #[test]
    fn malformed_lines_are_errors() {
        for line in [
            "[1, 2]",
            "{}",
            "{\"return\": {}, \"event\": \"STOP\"}",
            "{\"error\": {\"desc\": \"no class\"}}",
            "{\"event\": \"STOP\"}",
            "{\"event\": 7, \"timestamp\": {\"seconds\": 1, \"microseconds\": 2}}",
            "{\"QMP\": {\"version\": {\"qemu\": {\"major\": 7}}, \"capabilities\": []}}",
            "{\"QMP\": {\"version\": {\"qemu\": {\"major\": 7, \"minor\": 2, \"micro\": 22}}}}",
        ] {
            assert!(
                matches!(parse_line(line), Err(CodecError::Malformed { .. })),
                "{line}"
            );
        }
        assert!(matches!(
            parse_line("{\"return\": "),
            Err(CodecError::Json(_))
        ));
    }

    #[test]
    fn a_long_line_is_refused_before_parsing() {
        let long = format!("{{\"return\": \"{}\"}}", "a".repeat(MAX_LINE));
        let err = parse_line(&long).unwrap_err();
        assert!(
            matches!(err, CodecError::TooLong { max: MAX_LINE, .. }),
            "{err}"
        );
    }

    #[test]
    fn commands() {
        assert_eq!(
            encode_command("qmp_capabilities", None, None),
            "{\"execute\":\"qmp_capabilities\"}\n"
        );
        let line = encode_command(
            "migrate-continue",
            Some(json!({"state": "pre-switchover"})),
            Some(json!(7)),
        );
        assert!(line.ends_with('\n') && !line[..line.len() - 1].contains('\n'));
        let back: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(
            back,
            json!({"execute": "migrate-continue", "arguments": {"state": "pre-switchover"}, "id": 7})
        );
    }
}
