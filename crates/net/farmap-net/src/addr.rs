//! Addresses: where a server listens and where a client connects, and the listener itself.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use tokio::net::{TcpListener, UnixListener};

use crate::stream::BoxStream;

/// Where a server listens: `HOST:PORT` (TCP) or `unix:/path` (a Unix socket).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    /// A TCP address; port 0 picks a free port.
    Tcp(SocketAddr),
    /// A Unix socket path.
    Unix(PathBuf),
}

/// Why a listen address could not be understood.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{given:?} is not an address to listen on: write IP:PORT (e.g. 127.0.0.1:7400) or unix:/path"
)]
pub struct AddrError {
    /// The address as given.
    pub given: String,
}

impl FromStr for ListenAddr {
    type Err = AddrError;

    fn from_str(s: &str) -> Result<Self, AddrError> {
        if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Err(AddrError { given: s.into() });
            }
            return Ok(ListenAddr::Unix(path.into()));
        }
        s.parse()
            .map(ListenAddr::Tcp)
            .map_err(|_| AddrError { given: s.into() })
    }
}

impl fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ListenAddr::Tcp(a) => write!(f, "{a}"),
            ListenAddr::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

/// Where a client connects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RemoteAddr {
    /// `host:port`; the host may be a name, resolved at every (re)connect.
    Tcp(String),
    /// A Unix socket path.
    Unix(PathBuf),
}

/// A malformed address to connect to.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{given:?} is not an address to connect to: write HOST:PORT (e.g. 10.0.0.2:7100) or unix:/path"
)]
pub struct RemoteAddrError {
    /// The address as given.
    pub given: String,
}

impl FromStr for RemoteAddr {
    type Err = RemoteAddrError;

    /// `unix:/path`, or `HOST:PORT` with a numeric port (`[v6]:PORT` for IPv6 literals).
    fn from_str(s: &str) -> Result<Self, RemoteAddrError> {
        let err = || RemoteAddrError { given: s.into() };
        if let Some(path) = s.strip_prefix("unix:") {
            return if path.is_empty() {
                Err(err())
            } else {
                Ok(RemoteAddr::Unix(path.into()))
            };
        }
        let (host, port) = s.rsplit_once(':').ok_or_else(err)?;
        if host.is_empty() || port.parse::<u16>().is_err() {
            return Err(err());
        }
        Ok(RemoteAddr::Tcp(s.into()))
    }
}

impl RemoteAddr {
    /// The host part of a TCP address (without brackets for IPv6), the default TLS server
    /// name; `localhost` for a Unix socket.
    pub fn host(&self) -> &str {
        match self {
            RemoteAddr::Tcp(hp) => {
                let host = hp.rsplit_once(':').map_or(hp.as_str(), |(h, _)| h);
                host.trim_start_matches('[').trim_end_matches(']')
            }
            RemoteAddr::Unix(_) => "localhost",
        }
    }
}

impl From<&ListenAddr> for RemoteAddr {
    fn from(a: &ListenAddr) -> Self {
        match a {
            ListenAddr::Tcp(s) => RemoteAddr::Tcp(s.to_string()),
            ListenAddr::Unix(p) => RemoteAddr::Unix(p.clone()),
        }
    }
}

impl fmt::Display for RemoteAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RemoteAddr::Tcp(hp) => f.write_str(hp),
            RemoteAddr::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

/// A bound listening socket, TCP or Unix.
#[derive(Debug)]
pub enum Listener {
    /// A TCP listener.
    Tcp(TcpListener),
    /// A Unix socket listener and its path (removed when the server shuts down).
    Unix(UnixListener, PathBuf),
}

impl Listener {
    /// Binds `addr`. A Unix socket path left behind by a server that is gone (nothing accepts
    /// on it) is replaced; one that a live server uses is an error.
    pub async fn bind(addr: &ListenAddr) -> io::Result<Listener> {
        match addr {
            ListenAddr::Tcp(a) => Ok(Listener::Tcp(TcpListener::bind(a).await?)),
            ListenAddr::Unix(p) => {
                if is_stale_socket(p).await {
                    let _ = std::fs::remove_file(p);
                }
                Ok(Listener::Unix(bind_private_unix(p)?, p.clone()))
            }
        }
    }

    /// The address actually bound (with the real port when port 0 was asked for).
    pub fn local_addr(&self) -> io::Result<ListenAddr> {
        match self {
            Listener::Tcp(l) => l.local_addr().map(ListenAddr::Tcp),
            Listener::Unix(_, p) => Ok(ListenAddr::Unix(p.clone())),
        }
    }

    /// Accepts one connection: the stream and a name for the peer, for logs.
    pub async fn accept(&self) -> io::Result<(BoxStream, String)> {
        match self {
            Listener::Tcp(l) => {
                let (s, peer) = l.accept().await?;
                s.set_nodelay(true)?;
                Ok((Box::new(s), peer.to_string()))
            }
            Listener::Unix(l, p) => {
                let (s, _) = l.accept().await?;
                Ok((Box::new(s), format!("unix:{}", p.display())))
            }
        }
    }

    /// Removes a Unix socket's path (called at shutdown).
    pub fn cleanup(&self) {
        if let Listener::Unix(_, p) = self {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Binds a Unix socket at `path` that only this user can connect to (mode 0600), with no
/// moment at which it exists with a wider mode: it is bound and restricted inside a fresh
/// directory of mode 0700 beside `path`, then renamed into place. A file already at `path`
/// is replaced (callers check first that it is a stale socket).
pub fn bind_private_unix(path: &Path) -> io::Result<UnixListener> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let name = path.file_name().ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} names no socket file", path.display()),
        )
    })?;
    let dir = parent.join(format!(
        ".{}.{}.{}",
        name.to_string_lossy(),
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::DirBuilder::new().mode(0o700).create(&dir)?;
    let inside = dir.join("s");
    let bound = UnixListener::bind(&inside).and_then(|l| {
        std::fs::set_permissions(&inside, std::fs::Permissions::from_mode(0o600))?;
        std::fs::rename(&inside, path)?;
        Ok(l)
    });
    let _ = std::fs::remove_file(&inside);
    let _ = std::fs::remove_dir(&dir);
    bound
}

async fn is_stale_socket(p: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    let is_socket = std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_socket());
    is_socket && tokio::net::UnixStream::connect(p).await.is_err()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn unix_sockets_are_private_from_the_start() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("farmap.sock");
        let l = bind_private_unix(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{mode:o}");
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            1,
            "the private directory is gone"
        );
        let (client, accepted) = tokio::join!(tokio::net::UnixStream::connect(&path), l.accept());
        client.unwrap();
        accepted.unwrap();
    }

    #[test]
    fn listen_addresses() {
        assert_eq!(
            "127.0.0.1:7400".parse::<ListenAddr>().unwrap(),
            ListenAddr::Tcp("127.0.0.1:7400".parse().unwrap())
        );
        assert_eq!(
            "unix:/tmp/x.sock".parse::<ListenAddr>().unwrap(),
            ListenAddr::Unix("/tmp/x.sock".into())
        );
        for bad in ["localhost", "unix:", "1.2.3.4", ":80"] {
            let e = bad.parse::<ListenAddr>().unwrap_err().to_string();
            assert!(e.contains("IP:PORT"), "{e}");
        }
    }

    #[test]
    fn hosts_of_remote_addresses() {
        assert_eq!(
            RemoteAddr::Tcp("example.org:7400".into()).host(),
            "example.org"
        );
        assert_eq!(RemoteAddr::Tcp("[::1]:7400".into()).host(), "::1");
        assert_eq!(RemoteAddr::Unix("/x".into()).host(), "localhost");
        assert_eq!(RemoteAddr::Unix("/x".into()).to_string(), "unix:/x");
    }
}
