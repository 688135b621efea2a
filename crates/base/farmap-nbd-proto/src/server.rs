//! The server's side of the fixed-newstyle handshake, as a state machine with no I/O.

use bytes::{Buf, BufMut, BytesMut};

use crate::consts::{
    info, opt, rep, tflag, BASE_ALLOCATION, FLAG_C_FIXED_NEWSTYLE, FLAG_C_NO_ZEROES,
    FLAG_FIXED_NEWSTYLE, FLAG_NO_ZEROES, IHAVEOPT, MAX_STRING, NBDMAGIC, OPT_REPLY_MAGIC,
};
use crate::cursor::{be32, be64, Cursor};

/// The largest option (its data) the server reads; larger ones are skipped as they arrive
/// and answered with `NBD_REP_ERR_TOO_BIG`. Room for a name and many metadata queries.
pub const MAX_OPTION_LEN: u32 = 64 * 1024;

/// The metadata context id given to `base:allocation`.
const ALLOCATION_ID: u32 = 1;

/// Block size constraints of an export (`NBD_INFO_BLOCK_SIZE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSize {
    /// Smallest addressable length and alignment (a power of two, at most 64 KiB).
    pub min: u32,
    /// Size and alignment at which requests are efficient.
    pub preferred: u32,
    /// Largest payload of one request.
    pub max: u32,
}

/// An export as the handshake describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportInfo {
    /// Its name (`""` is the default export).
    pub name: String,
    /// A description for humans (may be empty).
    pub description: String,
    /// Size in bytes.
    pub size: u64,
    /// Transmission flags ([`tflag`]); `HAS_FLAGS` is added when sent.
    pub flags: u16,
    /// Block size constraints.
    pub block: BlockSize,
}

/// Whether the server insists on TLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsMode {
    /// No TLS: `NBD_OPT_STARTTLS` is refused by policy.
    Off,
    /// FORCEDTLS: every option but `STARTTLS` and `ABORT` gets `NBD_REP_ERR_TLS_REQD` until
    /// the stream is upgraded.
    Required,
}

/// What a server offers.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The exports, looked up by exact name.
    pub exports: Vec<ExportInfo>,
    /// TLS policy.
    pub tls: TlsMode,
}

/// What the handshake settled, for the transmission phase.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Negotiated {
    /// Index of the chosen export in [`ServerConfig::exports`].
    pub export: usize,
    /// Structured replies were negotiated.
    pub structured: bool,
    /// The id of `base:allocation`, when it was selected for this export.
    pub allocation_context: Option<u32>,
    /// The transmission flags the client was sent.
    pub flags: u16,
}

/// What the driver of a [`ServerHandshake`] must do next (after sending what was queued).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerStep {
    /// Read more bytes from the client.
    NeedMore,
    /// Send what was queued, then run a TLS handshake as the server on the same stream and
    /// call [`ServerHandshake::tls_started`]; all further bytes travel inside TLS.
    StartTls,
    /// Send what was queued; the transmission phase begins (bytes left in the input are the
    /// first requests).
    Done(Negotiated),
    /// The client aborted the session: send what was queued and close.
    Aborted,
}

/// Why a handshake ended with a hard disconnect.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HandshakeError {
    /// The client set flags the server did not offer.
    #[error("the client sent unknown handshake flags {flags:#x} (not an NBD client?)")]
    ClientFlags {
        /// The flags sent.
        flags: u32,
    },
    /// An option did not start with `IHAVEOPT`.
    #[error("the client sent {found:#018x} where an option's IHAVEOPT magic belongs")]
    BadMagic {
        /// The eight bytes found.
        found: u64,
    },
    /// `NBD_OPT_EXPORT_NAME` named an export that does not exist (it cannot be answered
    /// with an error).
    #[error("the client asked for export {name:?}, which does not exist")]
    UnknownExport {
        /// The name asked for.
        name: String,
    },
    /// `NBD_OPT_EXPORT_NAME` before TLS on a server that requires TLS.
    #[error("the client asked for an export without starting TLS, which this server requires")]
    TlsRequired,
    /// The machine was stepped after it finished.
    #[error("the handshake is already over")]
    Finished,
}

#[derive(Debug)]
enum Phase {
    ClientFlags,
    Options,
    /// Skipping the data of an option too large to read; its reply follows.
    Discard {
        option: u32,
        remaining: u64,
    },
    Finished,
}

/// The server's side of the fixed-newstyle handshake.
///
/// Send [`greeting`](Self::greeting) first, then call [`step`](Self::step) with everything
/// read until it returns something other than [`ServerStep::NeedMore`].
#[derive(Debug)]
pub struct ServerHandshake {
    config: ServerConfig,
    phase: Phase,
    tls_active: bool,
    structured: bool,
    no_zeroes: bool,
    /// The export name of the last `SET_META_CONTEXT`, and whether it selected
    /// `base:allocation`.
    meta: Option<(String, bool)>,
}

/// Appends an option reply.
fn reply(out: &mut BytesMut, option: u32, ty: u32, data: &[u8]) {
    out.put_u64(OPT_REPLY_MAGIC);
    out.put_u32(option);
    out.put_u32(ty);
    out.put_u32(data.len() as u32);
    out.put_slice(data);
}

/// Appends an error reply with a message for humans.
fn refuse(out: &mut BytesMut, option: u32, ty: u32, message: &str) {
    reply(out, option, ty, message.as_bytes());
}

/// A parsed `NBD_OPT_INFO` / `NBD_OPT_GO`.
struct InfoRequest<'a> {
    name: &'a str,
    requests: Vec<u16>,
}

fn parse_info(data: &[u8]) -> Option<InfoRequest<'_>> {
    let mut c = Cursor(data);
    let len = c.u32()? as usize;
    if len > c.rest().saturating_sub(2) {
        return None;
    }
    let name = c.string(len)?;
    let n = c.u16()? as usize;
    if c.rest() != 2 * n {
        return None;
    }
    let requests = (0..n).map(|_| c.u16()).collect::<Option<Vec<_>>>()?;
    Some(InfoRequest { name, requests })
}

/// A parsed `NBD_OPT_LIST_META_CONTEXT` / `NBD_OPT_SET_META_CONTEXT`.
fn parse_meta(data: &[u8]) -> Option<(&str, Vec<&str>)> {
    let mut c = Cursor(data);
    let len = c.u32()? as usize;
    if len > c.rest().saturating_sub(4) {
        return None;
    }
    let name = c.string(len)?;
    let n = c.u32()?;
    let mut queries = Vec::new();
    for _ in 0..n {
        let len = c.u32()? as usize;
        queries.push(c.string(len)?);
    }
    (c.rest() == 0).then_some((name, queries))
}

impl ServerHandshake {
    /// A machine for one connection.
    pub fn new(config: ServerConfig) -> Self {
        Self {
            config,
            phase: Phase::ClientFlags,
            tls_active: false,
            structured: false,
            no_zeroes: false,
            meta: None,
        }
    }

    /// The server's first 18 bytes: `NBDMAGIC`, `IHAVEOPT` and the handshake flags.
    pub fn greeting(&self, out: &mut BytesMut) {
        out.put_u64(NBDMAGIC);
        out.put_u64(IHAVEOPT);
        out.put_u16(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
    }

    /// The stream was upgraded to TLS after [`ServerStep::StartTls`]: options negotiated
    /// before are forgotten, as the protocol requires.
    pub fn tls_started(&mut self) {
        self.tls_active = true;
        self.structured = false;
        self.meta = None;
    }

    /// Consumes what it can of `input`, appends replies to `out`, and says what to do next.
    pub fn step(
        &mut self,
        input: &mut BytesMut,
        out: &mut BytesMut,
    ) -> Result<ServerStep, HandshakeError> {
        loop {
            match &mut self.phase {
                Phase::Finished => return Err(HandshakeError::Finished),
                Phase::ClientFlags => {
                    if input.len() < 4 {
                        return Ok(ServerStep::NeedMore);
                    }
                    let flags = input.get_u32();
                    if flags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
                        self.phase = Phase::Finished;
                        return Err(HandshakeError::ClientFlags { flags });
                    }
                    self.no_zeroes = flags & FLAG_C_NO_ZEROES != 0;
                    self.phase = Phase::Options;
                }
                Phase::Discard { option, remaining } => {
                    let n = (*remaining).min(input.len() as u64) as usize;
                    input.advance(n);
                    *remaining -= n as u64;
                    if *remaining > 0 {
                        return Ok(ServerStep::NeedMore);
                    }
                    let option = *option;
                    self.phase = Phase::Options;
                    refuse(
                        out,
                        option,
                        rep::ERR_TOO_BIG,
                        &format!("options are limited to {MAX_OPTION_LEN} bytes"),
                    );
                }
                Phase::Options => {
                    if input.len() < 16 {
                        return Ok(ServerStep::NeedMore);
                    }
                    let magic = be64(input, 0);
                    if magic != IHAVEOPT {
                        self.phase = Phase::Finished;
                        return Err(HandshakeError::BadMagic { found: magic });
                    }
                    let option = be32(input, 8);
                    let len = be32(input, 12);
                    if len > MAX_OPTION_LEN {
                        input.advance(16);
                        self.phase = Phase::Discard {
                            option,
                            remaining: len.into(),
                        };
                        continue;
                    }
                    if input.len() < 16 + len as usize {
                        return Ok(ServerStep::NeedMore);
                    }
                    input.advance(16);
                    let data = input.split_to(len as usize);
                    if let Some(step) = self.option(option, &data, out)? {
                        return Ok(step);
                    }
                }
            }
        }
    }

    /// Answers one option; `Some` when the handshake leaves the option loop.
    fn option(
        &mut self,
        option: u32,
        data: &[u8],
        out: &mut BytesMut,
    ) -> Result<Option<ServerStep>, HandshakeError> {
        let tls_needed = self.config.tls == TlsMode::Required && !self.tls_active;
        match option {
            opt::ABORT => {
                reply(out, option, rep::ACK, &[]);
                self.phase = Phase::Finished;
                return Ok(Some(ServerStep::Aborted));
            }
            opt::STARTTLS => return Ok(self.start_tls(data, out)),
            opt::EXPORT_NAME if tls_needed => {
                self.phase = Phase::Finished;
                return Err(HandshakeError::TlsRequired);
            }
            _ if tls_needed => refuse(
                out,
                option,
                rep::ERR_TLS_REQD,
                "this server requires TLS: start it with NBD_OPT_STARTTLS first",
            ),
            opt::EXPORT_NAME => return self.export_name(data, out).map(Some),
            opt::LIST => self.list(data, out),
            opt::INFO | opt::GO => return Ok(self.info_or_go(option, data, out)),
            opt::STRUCTURED_REPLY => {
                if !data.is_empty() {
                    refuse(
                        out,
                        option,
                        rep::ERR_INVALID,
                        "STRUCTURED_REPLY takes no data",
                    );
                } else {
                    self.structured = true;
                    reply(out, option, rep::ACK, &[]);
                }
            }
            opt::LIST_META_CONTEXT | opt::SET_META_CONTEXT => self.meta_context(option, data, out),
            _ => refuse(
                out,
                option,
                rep::ERR_UNSUP,
                &format!("option {option} is not supported"),
            ),
        }
        Ok(None)
    }

    /// `NBD_OPT_STARTTLS`: `Some` when the connection turns to TLS now.
    fn start_tls(&self, data: &[u8], out: &mut BytesMut) -> Option<ServerStep> {
        let option = opt::STARTTLS;
        if self.config.tls == TlsMode::Off {
            refuse(out, option, rep::ERR_POLICY, "this server does not use TLS");
        } else if self.tls_active {
            refuse(out, option, rep::ERR_INVALID, "TLS is already started");
        } else if !data.is_empty() {
            refuse(out, option, rep::ERR_INVALID, "STARTTLS takes no data");
        } else {
            reply(out, option, rep::ACK, &[]);
            return Some(ServerStep::StartTls);
        }
        None
    }

    /// `NBD_OPT_EXPORT_NAME`: the old way into transmission (no error reply: an unknown
    /// export ends the handshake).
    fn export_name(
        &mut self,
        data: &[u8],
        out: &mut BytesMut,
    ) -> Result<ServerStep, HandshakeError> {
        let name = String::from_utf8_lossy(data).into_owned();
        let Some(idx) = self.find(&name) else {
            self.phase = Phase::Finished;
            return Err(HandshakeError::UnknownExport { name });
        };
        let flags = self.flags(idx);
        out.put_u64(self.config.exports[idx].size);
        out.put_u16(flags);
        if !self.no_zeroes {
            out.put_bytes(0, 124);
        }
        Ok(self.finish(idx, &name, flags))
    }

    /// `NBD_OPT_LIST`: one reply per export.
    fn list(&self, data: &[u8], out: &mut BytesMut) {
        let option = opt::LIST;
        if !data.is_empty() {
            refuse(out, option, rep::ERR_INVALID, "LIST takes no data");
            return;
        }
        for e in &self.config.exports {
            let mut d = BytesMut::with_capacity(4 + e.name.len());
            d.put_u32(e.name.len() as u32);
            d.put_slice(e.name.as_bytes());
            d.put_slice(e.description.as_bytes());
            reply(out, option, rep::SERVER, &d);
        }
        reply(out, option, rep::ACK, &[]);
    }

    /// `NBD_OPT_INFO` and `NBD_OPT_GO`: the export's information; `Some` when `GO` enters
    /// transmission.
    fn info_or_go(&mut self, option: u32, data: &[u8], out: &mut BytesMut) -> Option<ServerStep> {
        let Some(req) = parse_info(data) else {
            refuse(out, option, rep::ERR_INVALID, "malformed INFO/GO request");
            return None;
        };
        let Some(idx) = self.find(req.name) else {
            let msg = format!("there is no export named {:?}", req.name);
            refuse(out, option, rep::ERR_UNKNOWN, &msg);
            return None;
        };
        let flags = self.flags(idx);
        let e = &self.config.exports[idx];
        let mut d = BytesMut::with_capacity(14);
        d.put_u16(info::EXPORT);
        d.put_u64(e.size);
        d.put_u16(flags);
        reply(out, option, rep::INFO, &d);
        if req.requests.contains(&info::NAME) {
            let mut d = BytesMut::with_capacity(2 + e.name.len());
            d.put_u16(info::NAME);
            d.put_slice(e.name.as_bytes());
            reply(out, option, rep::INFO, &d);
        }
        if req.requests.contains(&info::DESCRIPTION) && !e.description.is_empty() {
            let mut d = BytesMut::with_capacity(2 + e.description.len());
            d.put_u16(info::DESCRIPTION);
            d.put_slice(e.description.as_bytes());
            reply(out, option, rep::INFO, &d);
        }
        let mut d = BytesMut::with_capacity(14);
        d.put_u16(info::BLOCK_SIZE);
        d.put_u32(e.block.min);
        d.put_u32(e.block.preferred);
        d.put_u32(e.block.max);
        reply(out, option, rep::INFO, &d);
        reply(out, option, rep::ACK, &[]);
        if option == opt::GO {
            let name = req.name.to_owned();
            return Some(self.finish(idx, &name, flags));
        }
        None
    }

    /// `NBD_OPT_LIST_META_CONTEXT` and `NBD_OPT_SET_META_CONTEXT`: only `base:allocation`
    /// exists.
    fn meta_context(&mut self, option: u32, data: &[u8], out: &mut BytesMut) {
        let set = option == opt::SET_META_CONTEXT;
        if set {
            // A SET replaces the selection even when it fails.
            self.meta = None;
        }
        if set && !self.structured {
            let msg = "SET_META_CONTEXT needs structured replies first";
            refuse(out, option, rep::ERR_INVALID, msg);
            return;
        }
        let Some((name, queries)) = parse_meta(data) else {
            refuse(
                out,
                option,
                rep::ERR_INVALID,
                "malformed metadata context request",
            );
            return;
        };
        if self.find(name).is_none() {
            let msg = format!("there is no export named {name:?}");
            refuse(out, option, rep::ERR_UNKNOWN, &msg);
            return;
        }
        let selected = if set {
            queries.contains(&BASE_ALLOCATION)
        } else {
            queries.is_empty()
                || queries
                    .iter()
                    .any(|q| *q == "base:" || *q == BASE_ALLOCATION)
        };
        if selected {
            let mut d = BytesMut::with_capacity(4 + BASE_ALLOCATION.len());
            d.put_u32(if set { ALLOCATION_ID } else { 0 });
            d.put_slice(BASE_ALLOCATION.as_bytes());
            reply(out, option, rep::META_CONTEXT, &d);
        }
        if set {
            self.meta = Some((name.to_owned(), selected));
        }
        reply(out, option, rep::ACK, &[]);
    }

    fn find(&self, name: &str) -> Option<usize> {
        if name.len() > MAX_STRING {
            return None;
        }
        self.config.exports.iter().position(|e| e.name == name)
    }

    /// The transmission flags sent for export `idx`.
    fn flags(&self, idx: usize) -> u16 {
        (self.config.exports[idx].flags | tflag::HAS_FLAGS) & !tflag::SEND_DF
    }

    fn finish(&mut self, idx: usize, name: &str, flags: u16) -> ServerStep {
        self.phase = Phase::Finished;
        let allocation = matches!(&self.meta, Some((n, true)) if n == name);
        ServerStep::Done(Negotiated {
            export: idx,
            structured: self.structured,
            allocation_context: (allocation && self.structured).then_some(ALLOCATION_ID),
            flags,
        })
    }
}
