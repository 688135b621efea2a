//! Live migrations run for real by the CLI's tests: applications that hold a region with a
//! live, deterministic writer (`farmap __demo-node`, the demo's application, with its
//! migration agent), and the `farmap seed` and `farmap leech` commands that drive them.
//!
//! ```text
//! let mut a = DemoNode::start(&farmap, dir, "a", 16 << 20, 200, true, &[]);
//! let mut b = DemoNode::start(&farmap, dir, "b", 16 << 20, 200, false, &[]);
//! let seed = Seeder::start(&farmap, &a, &[]);
//! let (ok, out, err) = seed.leech(&farmap, &b, &["--mode", "postcopy"]).finish();
//! assert_eq!(a.verify(), None);           // the source no longer holds the region
//! assert!(b.verify().is_some());          // the destination's matches its history
//! ```

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;

use crate::cli::Cli;
use crate::process::Proc;

/// The bound on every wait for a demo node or a migration command.
pub const WAIT: Duration = Duration::from_secs(90);

/// An application with a region (or waiting for one) and its migration agent.
#[derive(Debug)]
pub struct DemoNode {
    /// The `farmap __demo-node` process.
    pub proc: Proc,
    agent: PathBuf,
}

impl DemoNode {
    /// Starts `farmap __demo-node` named `name`, its agent's socket in `dir`: a region of
    /// `size` bytes written `ops_per_sec` times a second once it holds one; `init`: it
    /// creates the region (a source), else it waits for one (a destination); `extra`: more
    /// arguments (`--store SPEC`: the region lives in that store).
    pub fn start(
        cli: &Cli,
        dir: &Path,
        name: &str,
        size: u64,
        ops_per_sec: u64,
        init: bool,
        extra: &[&str],
    ) -> DemoNode {
        let agent = dir.join(format!("{name}.agent"));
        let (size, ops) = (size.to_string(), ops_per_sec.to_string());
        let mut args = vec![
            "__demo-node",
            "--size",
            &size,
            "--seed",
            "7",
            "--ops-per-sec",
            &ops,
            "--agent",
            agent.to_str().expect("a UTF-8 path"),
        ];
        if init {
            args.push("--init");
        }
        args.extend_from_slice(extra);
        let mut proc = cli.proc(name, &args, WAIT);
        proc.event("ready");
        DemoNode { proc, agent }
    }

    /// Its migration agent's socket.
    pub fn agent(&self) -> &str {
        self.agent.to_str().expect("a UTF-8 path")
    }

    /// Stops the writer for a moment and compares the region with the image recomputed from
    /// the writer's seed and op count: `Some(ops)` if they match, `None` if this application
    /// holds no region.
    ///
    /// # Panics
    /// If the region differs from its history.
    pub fn verify(&mut self) -> Option<u64> {
        self.verify_command("verify")
    }

    /// [`verify`](Self::verify), leaving out the byte ranges `except` (chunks a migration
    /// rolled back to an older version, say).
    ///
    /// # Panics
    /// If the rest of the region differs from its history.
    pub fn verify_except(&mut self, except: &[std::ops::Range<u64>]) -> Option<u64> {
        let ranges: Vec<String> = except
            .iter()
            .map(|r| format!("{}-{}", r.start, r.end))
            .collect();
        self.verify_command(&format!("verify-except {}", ranges.join(",")))
    }

    fn verify_command(&mut self, command: &str) -> Option<u64> {
        self.proc.send(command);
        let v = self.proc.event("verified");
        if v["error"] == "no region here" {
            return None;
        }
        assert_eq!(
            v["ok"],
            true,
            "{}: region differs from its history: {v}",
            self.proc.name()
        );
        Some(v["ops"].as_u64().expect("an op count"))
    }
}

/// A `farmap seed --json` process waiting for (or serving) leechers, and the addresses it
/// announced.
#[derive(Debug)]
pub struct Seeder {
    /// The process.
    pub proc: Proc,
    /// Its control address.
    pub control: String,
    /// Its data plane's address.
    pub data: String,
}

impl Seeder {
    /// Starts `farmap seed` on `node`'s agent (listening on a free port of 127.0.0.1) with
    /// `extra` arguments, and waits for its addresses.
    pub fn start(cli: &Cli, node: &DemoNode, extra: &[&str]) -> Seeder {
        let mut args = vec![
            "seed",
            "--app",
            node.agent(),
            "--listen",
            "127.0.0.1:0",
            "--json",
        ];
        args.extend_from_slice(extra);
        let mut proc = cli.proc("seed", &args, WAIT);
        let l = proc.stderr_line("waiting for a leecher: control on ");
        let rest = l.split("control on ").nth(1).expect("the control address");
        let (control, data) = rest
            .split_once(", data plane on ")
            .expect("the data plane's address");
        Seeder {
            proc,
            control: control.trim().to_owned(),
            data: data.trim().to_owned(),
        }
    }

    /// Starts `farmap leech --json` on `node`'s agent from this seeder, with `extra`
    /// arguments.
    pub fn leech(&self, cli: &Cli, node: &DemoNode, extra: &[&str]) -> Proc {
        leech(cli, node, &self.control, &self.data, extra)
    }
}

/// Starts `farmap leech --json` on `node`'s agent from the seeder at `from` (control) and
/// `data` (its data plane, or a proxy of it), with `extra` arguments.
pub fn leech(cli: &Cli, node: &DemoNode, from: &str, data: &str, extra: &[&str]) -> Proc {
    let mut args = vec![
        "leech",
        "--app",
        node.agent(),
        "--from",
        from,
        "--data",
        data,
        "--json",
    ];
    args.extend_from_slice(extra);
    cli.proc("leech", &args, WAIT)
}

/// A `farmap proxy` process to `to` on 127.0.0.1:`port` (0 picks one), with `bandwidth`
/// per direction of each connection if given (`4MB/s`); and its address.
pub fn proxy(cli: &Cli, to: &str, port: u16, bandwidth: Option<&str>) -> (Proc, String) {
    let listen = format!("127.0.0.1:{port}");
    let mut args = vec!["proxy", "--listen", &listen, "--to", to];
    if let Some(b) = bandwidth {
        args.extend(["--bandwidth", b]);
    }
    let mut p = cli.proc("proxy", &args, WAIT);
    let l = p.stderr_line("listening on ");
    let addr = l.split("listening on ").nth(1).expect("an address");
    let addr = addr
        .split(',')
        .next()
        .expect("an address")
        .trim()
        .to_owned();
    (p, addr)
}

/// The last stdout line of a `--json` command, as JSON.
///
/// # Panics
/// If there is none, or it is not JSON.
pub fn json_of(out: &[String]) -> Value {
    let l = out.last().expect("a JSON result line on stdout");
    serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"))
}
