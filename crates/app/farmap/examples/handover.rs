//! Two processes, one region: this process maps a region over a file store and hands its
//! fault handling to a second process (itself, started again), which serves faults until
//! told to stop; then this process serves them again.
//!
//! ```text
//! cargo run -p farmap --example handover
//! ```

use std::error::Error;
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::{Command, Stdio};
use std::time::Duration;

use farmap::region::handover::{self, SendOptions, ServeOptions};
use farmap::{open_region, RegionMode, RegionOptions, StoreSpec};

/// Set in the handler process: the socket path to connect to.
const HANDLER_ENV: &str = "FARMAP_EXAMPLE_HANDLER";

fn main() -> Result<(), Box<dyn Error>> {
    if let Ok(path) = std::env::var(HANDLER_ENV) {
        return handler(&path);
    }
    // Says why if this machine has no usable userfaultfd.
    farmap::region::probe()?;
    let dir = tempfile::tempdir()?;
    let spec: StoreSpec = format!(
        "file:{}?size=16MiB",
        dir.path().join("region.img").display()
    )
    .parse()?;
    let opts = RegionOptions {
        mode: RegionMode::Direct,
        ..RegionOptions::default()
    };
    let region = open_region(&spec, opts)?;
    region.memory().write_from(0, b"before")?;
    region.sync()?;

    // Start the handler (this program again) and give it the region.
    let sock_path = dir.path().join("handler.sock");
    let listener = UnixListener::bind(&sock_path)?;
    // Run as a test, this program is the test binary: the handler is its ignored test.
    let child = Command::new(std::env::current_exe()?)
        .args(["--ignored", "--exact", "tests::handler", "--nocapture"])
        .env(HANDLER_ENV, &sock_path)
        .stdout(Stdio::piped())
        .spawn()?;
    let (sock, _) = listener.accept()?;
    let faults_before = region.stats().faults;
    handover::send(&region, sock, SendOptions::default())?;
    println!("[owner] handler: {:?}", region.handler());

    // Faults are now served by the other process; writes are still tracked here.
    let mb = 1 << 20;
    let mem = region.memory();
    let sum: u64 = (0..mem.len() / mb)
        .map(|c| mem.load_u8(c * mb + mb / 2).map(u64::from))
        .sum::<Result<u64, _>>()?;
    println!(
        "[owner] read 16 MiB through the other process (sum {sum}), faults served here: {}",
        region.stats().faults - faults_before
    );
    region.memory().write_from(7 * mb, b"remote")?;
    region.sync()?;

    handover::reclaim(&region, Duration::from_secs(10))?;
    println!("[owner] handler: {:?}", region.handler());
    let out = child.wait_with_output()?;
    assert!(out.status.success());
    // The handler's own lines only: run as a test, the child's test harness reports too, and
    // its "test result" line must not be counted as a test of this run.
    let handler_said = String::from_utf8_lossy(&out.stdout);
    for line in handler_said.lines().filter(|l| l.starts_with("[handler]")) {
        println!("{line}");
    }
    region.close()?;

    // The file holds both writes.
    let data = std::fs::read(dir.path().join("region.img"))?;
    assert_eq!(&data[..6], b"before");
    assert_eq!(&data[7 * mb..7 * mb + 6], b"remote");
    println!("[owner] the file holds both writes");
    Ok(())
}

/// The handler process: serves the region's faults until the owner says stop.
fn handler(path: &str) -> Result<(), Box<dyn Error>> {
    let sock = UnixStream::connect(path)?;
    let report = handover::serve(sock, ServeOptions::default())?;
    println!(
        "[handler] served {} faults, installed {} chunks",
        report.faults, report.chunks_fetched
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn runs() {
        if let Err(e) = farmap::region::probe() {
            farmap_testkit::skip("examples/handover.rs: runs", e);
            return;
        }
        super::main().unwrap();
    }

    /// The handler half of `runs`, started by it as a child process; not a test of its own.
    #[test]
    #[ignore = "the child process of tests::runs, which starts it"]
    fn handler() {
        let path = std::env::var(super::HANDLER_ENV).expect("started by tests::runs");
        super::handler(&path).unwrap();
    }
}
