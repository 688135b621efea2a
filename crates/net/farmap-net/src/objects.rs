//! [`RemoteObjects`]: the named objects a farmap server exports (`farmap serve --objects`),
//! as [`Objects`] for a versioned layout (`versioned:(farmap://ADDR)/REGION`).
//!
//! The same pool, reconnection, deadlines, TLS and keys as [`RemoteStore`](crate::RemoteStore);
//! reads (`get`, `exists`, `list`) are sent again once on another connection if theirs was
//! lost under them, a create or delete is not (its outcome is unknown: the caller decides).
//! What the server answers is checked: list replies must name single, valid names in
//! ascending order, and a folder of more than [`MAX_LISTED`] names (or [`MAX_LISTED_BYTES`]
//! of them) is refused; an object over [`MAX_OBJECT`] is refused before it is sent.

use bytes::Bytes;
use farmap_core::{check_key, BoxFuture, ErrorKind, Objects, StoreError, StoreResult};
use farmap_wire::{Features, Frame, Message, HEADER_LEN, MAX_OBJECT};

use crate::addr::RemoteAddr;
use crate::remote::{Client, ClientOptions};

/// Most names one listing gathers from a server (over many replies): what a layout's largest
/// folder holds, with room; a server that sends more is refused rather than followed.
pub const MAX_LISTED: usize = 4 << 20;
/// Most bytes of names one listing gathers from a server.
pub const MAX_LISTED_BYTES: usize = 256 << 20;

/// Named objects served by a farmap server.
pub struct RemoteObjects {
    client: Client,
}

impl std::fmt::Debug for RemoteObjects {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteObjects")
            .field("addr", self.client.addr())
            .finish()
    }
}

impl RemoteObjects {
    /// Connects to the objects server at `addr`: the first connection is made now (its
    /// failure is the error: refused, a region server rather than an objects one, TLS...),
    /// the rest of the pool in the background.
    pub async fn connect(addr: RemoteAddr, opts: ClientOptions) -> StoreResult<RemoteObjects> {
        let client = Client::connect(addr, opts, Features::OBJECTS).await?;
        Ok(RemoteObjects { client })
    }

    /// The server's address.
    pub fn addr(&self) -> &RemoteAddr {
        self.client.addr()
    }

    fn corrupt(&self, what: String) -> StoreError {
        StoreError::new(
            ErrorKind::Corrupt,
            format!("the server at {} {what}", self.client.addr()),
        )
    }

    /// One page of `dir`'s names after `after`, checked.
    async fn list_page(&self, dir: &str, after: &str) -> StoreResult<(Vec<String>, bool)> {
        let msg = Message::ObjList {
            dir: dir.to_owned(),
            after: after.to_owned(),
        };
        let (names, more) = match self.client.call(msg).await? {
            Message::ObjNames { names, more } => (names, more),
            other => return Err(self.client.unexpected("list", &other)),
        };
        let mut last = after;
        for n in &names {
            if n.contains('/') || check_key(n).is_err() {
                return Err(self.corrupt(format!("listed {n:?} in {dir}, not a name")));
            }
            if !last.is_empty() && n.as_str() <= last {
                return Err(self.corrupt(format!("listed {dir} out of order ({n:?})")));
            }
            last = n;
        }
        if more && names.is_empty() {
            return Err(self.corrupt(format!("listed {dir} without progress")));
        }
        Ok((names, more))
    }
}

impl Drop for RemoteObjects {
    fn drop(&mut self) {
        self.client.close("the client closed the objects");
    }
}

impl Objects for RemoteObjects {
    fn get<'a>(&'a self, key: &'a str) -> BoxFuture<'a, StoreResult<Option<Bytes>>> {
        Box::pin(async move {
            check_key(key)?;
            match self.client.call(Message::ObjGet(key.to_owned())).await? {
                Message::ObjData(d) => Ok(d),
                other => Err(self.client.unexpected("get", &other)),
            }
        })
    }

    fn exists<'a>(&'a self, key: &'a str) -> BoxFuture<'a, StoreResult<bool>> {
        Box::pin(async move {
            check_key(key)?;
            match self.client.call(Message::ObjExists(key.to_owned())).await? {
                Message::ObjBool(b) => Ok(b),
                other => Err(self.client.unexpected("exists", &other)),
            }
        })
    }

    fn create<'a>(&'a self, key: &'a str, data: Bytes) -> BoxFuture<'a, StoreResult<bool>> {
        Box::pin(async move {
            check_key(key)?;
            let msg = Message::ObjCreate {
                key: key.to_owned(),
                data,
            };
            // Refused here rather than by the server's decoder, which would close the
            // connection under every other request in flight on it.
            let len = Frame::new(1, msg.clone()).encoded_len();
            let max_frame = self.client.max_frame();
            if len > HEADER_LEN + 2 + key.len() + MAX_OBJECT || len > max_frame {
                return Err(StoreError::invalid(format!(
                    "object {key} is too large for {}: at most {MAX_OBJECT} bytes, in a frame \
                     of at most {max_frame}",
                    self.location(),
                )));
            }
            match self.client.call(msg).await? {
                Message::ObjBool(b) => Ok(b),
                other => Err(self.client.unexpected("create", &other)),
            }
        })
    }

    fn list<'a>(&'a self, dir: &'a str) -> BoxFuture<'a, StoreResult<Vec<String>>> {
        Box::pin(async move {
            check_key(dir)?;
            let mut all: Vec<String> = Vec::new();
            let mut bytes = 0usize;
            loop {
                let after = all.last().map_or("", String::as_str);
                let (names, more) = self.list_page(dir, after).await?;
                bytes += names.iter().map(String::len).sum::<usize>();
                if all.len() + names.len() > MAX_LISTED || bytes > MAX_LISTED_BYTES {
                    return Err(self.corrupt(format!(
                        "listed more than {MAX_LISTED} names or {MAX_LISTED_BYTES} bytes of \
                         names in {dir}"
                    )));
                }
                all.extend(names);
                if !more {
                    return Ok(all);
                }
            }
        })
    }

    fn delete<'a>(&'a self, key: &'a str) -> BoxFuture<'a, StoreResult<()>> {
        Box::pin(async move {
            check_key(key)?;
            match self.client.call(Message::ObjDelete(key.to_owned())).await? {
                Message::Done => Ok(()),
                other => Err(self.client.unexpected("delete", &other)),
            }
        })
    }

    fn location(&self) -> String {
        format!("farmap://{}", self.client.addr())
    }
}
