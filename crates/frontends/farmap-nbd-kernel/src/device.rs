//! [`NbdMount`]: `/dev/nbdN` over a store, with farmap's NBD server in this process.

use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use farmap_core::option::check_range;
use farmap_core::{Geometry, Store};
use farmap_nbd::{serve_nbd, Export, NbdServeOptions, NbdServer};
use farmap_nbd_proto::consts::tflag;
use farmap_nbd_proto::{ClientConfig, ClientHandshake, ClientStep, ExportDetails};
use farmap_net::{ListenAddr, Listener};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

use crate::error::NbdKernelError;
use crate::genl::{self, consts::*};
use crate::mapping::MappedDevice;
use crate::netlink::{GenlSocket, NetlinkError};

/// How a kernel NBD device is set up.
#[derive(Debug, Clone)]
pub struct NbdMountOptions {
    /// Sockets between the kernel and the in-process server (requests are spread over them).
    pub connections: usize,
    /// A request the server has not answered within this time fails (the kernel's
    /// `NBD_ATTR_TIMEOUT`; whole seconds, rounded up).
    pub io_timeout: Duration,
    /// Refuse writes (the device is read-only).
    pub read_only: bool,
    /// Ask for `/dev/nbd<index>`; by default the kernel picks a free device.
    pub index: Option<u32>,
    /// How long to wait for the device to show its size and node after connecting.
    pub ready_timeout: Duration,
}

impl Default for NbdMountOptions {
    /// 4 connections, a 30 s I/O timeout, read-write, any free device, 10 s to be ready.
    fn default() -> Self {
        Self {
            connections: 4,
            io_timeout: Duration::from_secs(30),
            read_only: false,
            index: None,
            ready_timeout: Duration::from_secs(10),
        }
    }
}

/// The most sockets per device (the kernel takes any number; more do not help).
pub const MAX_CONNECTIONS: usize = 64;

/// The id of generic netlink family `name`, or `None` when the kernel does not know it.
pub fn genl_family_id(name: &str) -> Result<Option<u16>, NetlinkError> {
    let mut sock = GenlSocket::open()?;
    family_id(&mut sock, name)
}

fn family_id(sock: &mut GenlSocket, name: &str) -> Result<Option<u16>, NetlinkError> {
    let seq = sock.next_seq();
    match sock.request(seq, &genl::get_family(seq, name)) {
        Err(NetlinkError::Kernel(rustix::io::Errno::NOENT)) => Ok(None),
        Err(e) => Err(e),
        Ok(answer) => {
            for (cmd, attrs) in &answer.messages {
                if *cmd == CTRL_CMD_NEWFAMILY {
                    return Ok(Some(genl::family_reply(attrs)?.id));
                }
            }
            Err(genl::DecodeError {
                what: "the controller acknowledged without describing the family",
                at: 0,
            }
            .into())
        }
    }
}

/// The kernel's nbd family, resolved once per device.
fn nbd_family() -> Result<(GenlSocket, u16), NbdKernelError> {
    let what = "resolving the kernel's \"nbd\" generic netlink family";
    let mut sock = GenlSocket::open().map_err(|e| NbdKernelError::netlink(what, e))?;
    match family_id(&mut sock, NBD_FAMILY) {
        Ok(Some(id)) => Ok((sock, id)),
        Ok(None) => Err(NbdKernelError::NoDriver),
        Err(e) => Err(NbdKernelError::netlink(what, e)),
    }
}

/// Whether this kernel has the nbd driver loaded (its generic netlink family exists).
pub fn kernel_has_nbd() -> bool {
    matches!(genl_family_id(NBD_FAMILY), Ok(Some(_)))
}

/// A store as `/dev/nbdN`: farmap's NBD server runs in this process on Unix sockets whose
/// other ends the kernel's NBD client uses (the way `nbd-client -C N` hands its sockets over,
/// through generic netlink).
///
/// Three ways in (r3map's path / file / slice mounts): [`path`](Self::path) (the device node,
/// for `mkfs`, `mount`, other programs), [`open`](Self::open) (a `File`) and
/// [`map`](Self::map) (a shared mapping seen as a [`RegionSlice`](farmap_memory::RegionSlice)).
///
/// [`shutdown`](Self::shutdown) flushes first (`fsync` of the device: the page cache is
/// written back and the kernel sends `NBD_CMD_FLUSH`, which flushes the store), then
/// disconnects (`NBD_CMD_DISCONNECT`; the device is destroyed), then stops the server.
/// Dropping it does the same as well as it can without a runtime to wait on: call
/// `shutdown`.
///
/// The server's tasks run on the Tokio runtime that called [`start`](Self::start): a thread
/// of that runtime must not block on the device (a read of it, a page fault in a mapping of
/// it), or the request it waits for may wait for that very thread.
#[derive(Debug)]
pub struct NbdMount {
    index: u32,
    path: PathBuf,
    geometry: Geometry,
    block_size: u32,
    read_only: bool,
    family: u16,
    io_timeout: Duration,
    server: Option<NbdServer>,
}

impl NbdMount {
    /// Serves `store` in this process and connects the kernel's NBD client to it with
    /// `opts.connections` sockets; returns once `/dev/nbdN` has its size and its node.
    /// Must be called from within a Tokio runtime (the server's tasks run on it).
    pub async fn start(
        store: Arc<dyn Store>,
        opts: &NbdMountOptions,
    ) -> Result<NbdMount, NbdKernelError> {
        let n = opts.connections;
        let timeout_s = check_options(opts)?;
        // First the driver: without it there is nothing to serve.
        let (sock, family) = blocking("resolving the nbd family", nbd_family).await?;
        let geometry = store.geometry();
        let (server, dir, sock_path) = serve_privately(store, opts).await?;
        let (fds, details) = connect_sockets(&sock_path, n).await?;
        drop(dir);
        let size = details.size;
        let block_size = block_size_for(size, details.block.map(|b| b.preferred));
        let connect = genl::Connect {
            size,
            block_size: block_size.into(),
            timeout_s,
            dead_conn_timeout_s: 0,
            server_flags: details.flags.into(),
            client_flags: NBD_CFLAG_DESTROY_ON_DISCONNECT,
            sockets: fds.iter().map(|f| f.as_raw_fd() as u32).collect(),
            index: opts.index,
            backend: Some(format!("farmap:{}", std::process::id())),
        };
        let index = blocking("connecting the device", move || {
            let mut sock = sock;
            let r = connect_device(&mut sock, family, &connect);
            // The kernel holds its own references to the sockets now.
            drop(fds);
            r
        })
        .await?;
        let mut mount = NbdMount {
            index,
            path: PathBuf::from(format!("/dev/nbd{index}")),
            geometry,
            block_size,
            read_only: opts.read_only || details.flags & tflag::READ_ONLY != 0,
            family,
            io_timeout: opts.io_timeout,
            server: Some(server),
        };
        if let Err(e) = mount.wait_ready(size, opts.ready_timeout).await {
            let _ = mount.teardown().await;
            return Err(e);
        }
        tracing::debug!(
            "{} is connected ({size} bytes, {n} sockets, block size {block_size})",
            mount.path.display()
        );
        Ok(mount)
    }

    /// Waits until the kernel reports the device's size and its node exists.
    async fn wait_ready(&self, size: u64, limit: Duration) -> Result<(), NbdKernelError> {
        let start = Instant::now();
        let sysfs = format!("/sys/block/nbd{}/size", self.index);
        let want = size / 512;
        loop {
            let sectors = std::fs::read_to_string(&sysfs)
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok());
            let node = std::fs::metadata(&self.path)
                .map(|m| m.file_type().is_block_device())
                .unwrap_or(false);
            if sectors == Some(want) && node {
                return Ok(());
            }
            if start.elapsed() >= limit {
                let state = match (sectors, node) {
                    (s, _) if s != Some(want) => format!(
                        "{sysfs} says {} sectors, expected {want}",
                        s.map_or("nothing".to_string(), |s| s.to_string())
                    ),
                    _ => "its device node did not appear (is devtmpfs mounted on /dev?)".into(),
                };
                return Err(NbdKernelError::NotReady {
                    device: self.path.clone(),
                    waited: limit,
                    state,
                });
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// The device node, `/dev/nbdN`.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The device's number N.
    pub fn index(&self) -> u32 {
        self.index
    }

    /// The region's shape (the store's).
    pub fn geometry(&self) -> Geometry {
        self.geometry
    }

    /// The device's logical block size.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Whether writes are refused.
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// The I/O timeout the kernel was given.
    pub fn io_timeout(&self) -> Duration {
        self.io_timeout
    }

    /// Connections the in-process server is serving (the kernel's sockets).
    pub fn connections(&self) -> usize {
        self.server.as_ref().map_or(0, NbdServer::connections)
    }

    /// Opens the device (read-write unless read-only). Blocking I/O on it must not run on
    /// a thread of the runtime that serves it.
    pub fn open(&self) -> std::io::Result<File> {
        std::fs::OpenOptions::new()
            .read(true)
            .write(!self.read_only)
            .open(&self.path)
    }

    /// Maps the whole device shared: its memory is the region (see [`MappedDevice`]).
    pub fn map(&self) -> Result<MappedDevice<'_>, NbdKernelError> {
        let size = self.geometry.size();
        let len = usize::try_from(size).map_err(|_| NbdKernelError::TooLarge { size })?;
        let file = self.open().map_err(|source| NbdKernelError::Device {
            what: "opening",
            device: self.path.clone(),
            source,
        })?;
        farmap_memory::SharedMapping::new(file, len, !self.read_only, "a mapped NBD device")
            .map(|map| MappedDevice::new(map, self))
            .map_err(|source| NbdKernelError::Device {
                what: "mapping",
                device: self.path.clone(),
                source,
            })
    }

    /// Writes the device's page cache back and flushes the store (`fsync`). Blocks; must
    /// not run on a thread of the runtime that serves the device.
    pub fn sync(&self) -> Result<(), NbdKernelError> {
        sync_device(&self.path)
    }

    /// Flushes (`fsync`: page cache to the server, then `NBD_CMD_FLUSH`, a store flush),
    /// disconnects (the kernel sends `NBD_CMD_DISC` on every socket and destroys the
    /// device), and stops the server, which flushes the store once more. On an error the
    /// device is disconnected all the same.
    pub async fn shutdown(mut self) -> Result<(), NbdKernelError> {
        self.teardown().await
    }

    async fn teardown(&mut self) -> Result<(), NbdKernelError> {
        let Some(server) = self.server.take() else {
            return Ok(());
        };
        let path = self.path.clone();
        let synced = blocking("flushing the device", move || sync_device(&path)).await;
        let (family, index) = (self.family, self.index);
        let disconnected = blocking("disconnecting the device", move || {
            disconnect_device(family, index)
        })
        .await;
        // The kernel sends NBD_CMD_DISC and shuts its sockets down; the server sees each
        // connection end.
        let start = Instant::now();
        while server.connections() > 0 && start.elapsed() < Duration::from_secs(10) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let stopped = server.shutdown().await.map_err(NbdKernelError::Stop);
        tracing::debug!("{} is disconnected", self.path.display());
        synced.and(disconnected).and(stopped)
    }
}

impl Drop for NbdMount {
    /// Without [`shutdown`](NbdMount::shutdown): flushes from a thread of its own (waiting
    /// at most the I/O timeout, since the runtime that serves the device may be the one
    /// dropping it), disconnects, and stops the server abruptly.
    fn drop(&mut self) {
        if self.server.is_none() {
            return;
        }
        tracing::warn!(
            "{} dropped without shutdown(): flushing and disconnecting it as well as possible",
            self.path.display()
        );
        let path = self.path.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name("nbd-drop-sync".into())
            .spawn(move || {
                let _ = tx.send(sync_device(&path));
            });
        if spawned.is_ok() {
            match rx.recv_timeout(self.io_timeout) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!("{e}"),
                Err(_) => tracing::warn!(
                    "flushing {} did not finish within {:?}; disconnecting anyway",
                    self.path.display(),
                    self.io_timeout
                ),
            }
        }
        if let Err(e) = disconnect_device(self.family, self.index) {
            tracing::warn!("{e}");
        }
    }
}

/// `fsync` of the device: the page cache is written back and the kernel sends a flush.
fn sync_device(path: &Path) -> Result<(), NbdKernelError> {
    let device = |what, source| NbdKernelError::Device {
        what,
        device: path.to_path_buf(),
        source,
    };
    let f = File::open(path).map_err(|e| device("opening (to flush it)", e))?;
    f.sync_all().map_err(|e| device("flushing (fsync)", e))
}

fn connect_device(
    sock: &mut GenlSocket,
    family: u16,
    c: &genl::Connect,
) -> Result<u32, NbdKernelError> {
    let what = "NBD_CMD_CONNECT";
    let seq = sock.next_seq();
    let answer = sock
        .request(seq, &genl::connect(family, seq, c))
        .map_err(|e| NbdKernelError::netlink(what, e))?;
    for (cmd, attrs) in &answer.messages {
        if *cmd == NBD_CMD_CONNECT {
            if let Some(index) =
                genl::nbd_index(attrs).map_err(|e| NbdKernelError::netlink(what, e.into()))?
            {
                return Ok(index);
            }
        }
    }
    // Older kernels acknowledge without a reply; then the index is the one asked for.
    c.index.ok_or(NbdKernelError::Netlink {
        what,
        source: genl::DecodeError {
            what: "the kernel connected a device without saying which",
            at: 0,
        }
        .into(),
    })
}

fn disconnect_device(family: u16, index: u32) -> Result<(), NbdKernelError> {
    let what = "NBD_CMD_DISCONNECT";
    let mut sock = GenlSocket::open().map_err(|e| NbdKernelError::netlink(what, e))?;
    let seq = sock.next_seq();
    sock.request(seq, &genl::disconnect(family, seq, index))
        .map(|_| ())
        .map_err(|e| NbdKernelError::netlink(what, e))
}

/// The logical block size: the server's preferred size within 512..=4096, halved until it
/// divides the size.
fn block_size_for(size: u64, preferred: Option<u32>) -> u32 {
    let mut bs = preferred
        .unwrap_or(4096)
        .clamp(512, 4096)
        .next_power_of_two()
        .min(4096);
    while bs > 512 && !size.is_multiple_of(u64::from(bs)) {
        bs /= 2;
    }
    bs
}

/// The client side of the handshake on one socket (no TLS, simple replies: what the kernel
/// speaks once the socket is handed over).
async fn handshake(s: &mut UnixStream) -> Result<ExportDetails, HandshakeFailure> {
    let mut hs = ClientHandshake::new(ClientConfig {
        export: String::new(),
        tls: false,
        structured: false,
        allocation: false,
    });
    let mut input = BytesMut::with_capacity(4096);
    let mut out = BytesMut::new();
    loop {
        let step = hs
            .step(&mut input, &mut out)
            .map_err(|e| ("the handshake failed", Some(boxed(e))))?;
        if !out.is_empty() {
            s.write_all(&out)
                .await
                .map_err(|e| ("sending the handshake", Some(boxed(e))))?;
            out.clear();
        }
        match step {
            ClientStep::NeedMore => {
                if input.len() > 1 << 20 {
                    return Err(("the server's handshake replies exceed 1 MiB", None));
                }
                match s.read_buf(&mut input).await {
                    Ok(0) => return Err(("the server closed the connection", None)),
                    Ok(_) => {}
                    Err(e) => return Err(("reading the handshake", Some(boxed(e)))),
                }
            }
            ClientStep::StartTls => return Err(("the server asked for TLS", None)),
            ClientStep::Done(d) => {
                if !input.is_empty() {
                    return Err(("the server sent bytes after the handshake", None));
                }
                return Ok(d);
            }
        }
    }
}

type HandshakeFailure = (
    &'static str,
    Option<Box<dyn std::error::Error + Send + Sync>>,
);

fn boxed(
    e: impl std::error::Error + Send + Sync + 'static,
) -> Box<dyn std::error::Error + Send + Sync> {
    Box::new(e)
}

/// Checks the number of connections; returns the I/O timeout in whole seconds (rounded up).
fn check_options(opts: &NbdMountOptions) -> Result<u64, NbdKernelError> {
    check_range(
        "the number of NBD connections",
        opts.connections as u64,
        1,
        MAX_CONNECTIONS as u64,
    )?;
    let timeout_s = opts.io_timeout.as_secs() + u64::from(opts.io_timeout.subsec_nanos() > 0);
    check_range("the I/O timeout in seconds", timeout_s, 1, 24 * 3600)?;
    Ok(timeout_s)
}

/// Serves `store` on a Unix socket in a private directory that goes away once the sockets
/// are connected (nobody else can reach the server); returns the server, the directory and
/// the socket's path.
async fn serve_privately(
    store: Arc<dyn Store>,
    opts: &NbdMountOptions,
) -> Result<(NbdServer, tempfile::TempDir, PathBuf), NbdKernelError> {
    let n = opts.connections;
    let dir = tempfile::Builder::new()
        .prefix("farmap-nbd-")
        .tempdir()
        .map_err(|e| conn_err(0, n, "creating a private directory for its socket", e))?;
    let sock_path = dir.path().join("nbd.sock");
    let listener = Listener::bind(&ListenAddr::Unix(sock_path.clone()))
        .await
        .map_err(|e| conn_err(0, n, "binding its Unix socket", e))?;
    let server_opts = NbdServeOptions {
        max_connections: n,
        // The kernel keeps its sockets open and quiet for as long as the device lives.
        idle_timeout: Duration::from_secs(365 * 24 * 3600),
        log: false,
        ..NbdServeOptions::default()
    };
    let export = Export {
        name: String::new(),
        description: "farmap kernel NBD device".into(),
        store,
        read_only: opts.read_only,
    };
    let server = serve_nbd(vec![export], listener, server_opts).map_err(NbdKernelError::Serve)?;
    Ok((server, dir, sock_path))
}

/// Connects `n` sockets to the server at `sock_path` and does their handshakes; every
/// connection must see the same export, and several need `CAN_MULTI_CONN`. Returns the
/// blocking sockets for the kernel and the export's details.
async fn connect_sockets(
    sock_path: &Path,
    n: usize,
) -> Result<(Vec<OwnedFd>, ExportDetails), NbdKernelError> {
    let mut fds: Vec<OwnedFd> = Vec::with_capacity(n);
    let mut details: Option<ExportDetails> = None;
    for i in 1..=n {
        let mut s = UnixStream::connect(sock_path)
            .await
            .map_err(|e| conn_err(i, n, "connecting", e))?;
        let d = handshake(&mut s)
            .await
            .map_err(|(what, e)| conn_err_opt(i, n, what, e))?;
        if let Some(first) = &details {
            if (first.size, first.flags) != (d.size, d.flags) {
                return Err(conn_err_opt(
                    i,
                    n,
                    "the server described the export differently than to connection 1",
                    None,
                ));
            }
        }
        details.get_or_insert(d);
        let s = s
            .into_std()
            .and_then(|s| s.set_nonblocking(false).map(|()| s))
            .map_err(|e| conn_err(i, n, "handing the socket over", e))?;
        fds.push(OwnedFd::from(s));
    }
    let details = details.expect("at least one connection");
    if n > 1 && details.flags & tflag::CAN_MULTI_CONN == 0 {
        return Err(conn_err_opt(
            1,
            n,
            "the server does not allow several connections (no CAN_MULTI_CONN)",
            None,
        ));
    }
    Ok((fds, details))
}

fn conn_err(conn: usize, total: usize, what: &str, e: std::io::Error) -> NbdKernelError {
    conn_err_opt(conn, total, what, Some(boxed(e)))
}

fn conn_err_opt(
    conn: usize,
    total: usize,
    what: &str,
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
) -> NbdKernelError {
    NbdKernelError::Connection {
        conn,
        total,
        what: what.to_string(),
        source,
    }
}

/// Runs blocking `f` (netlink, `fsync`) off the runtime's threads.
async fn blocking<T: Send + 'static>(
    what: &'static str,
    f: impl FnOnce() -> Result<T, NbdKernelError> + Send + 'static,
) -> Result<T, NbdKernelError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|_| NbdKernelError::Thread(what))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_sizes() {
        assert_eq!(block_size_for(64 << 20, Some(65536)), 4096);
        assert_eq!(block_size_for(64 << 20, None), 4096);
        assert_eq!(block_size_for(64 << 20, Some(512)), 512);
        assert_eq!(block_size_for(64 << 20, Some(1000)), 1024);
        assert_eq!(block_size_for(4096 + 1024, Some(4096)), 1024);
        assert_eq!(block_size_for(1000, Some(4096)), 512);
    }

    /// The generic netlink path works on any Linux kernel: the controller resolves itself.
    #[test]
    fn the_controller_resolves_itself() {
        assert_eq!(genl_family_id("nlctrl").unwrap(), Some(GENL_ID_CTRL));
        assert_eq!(genl_family_id("farmap-nofam").unwrap(), None);
    }
}
