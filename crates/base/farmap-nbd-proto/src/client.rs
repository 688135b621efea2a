//! The client's side of the fixed-newstyle handshake, as a state machine with no I/O.

use bytes::{Buf, BufMut, BytesMut};

use crate::consts::{
    info, opt, rep, BASE_ALLOCATION, FLAG_C_FIXED_NEWSTYLE, FLAG_C_NO_ZEROES, FLAG_FIXED_NEWSTYLE,
    FLAG_NO_ZEROES, IHAVEOPT, NBDMAGIC, OPT_REPLY_MAGIC,
};
use crate::cursor::{be32, be64, Cursor};
use crate::server::{BlockSize, MAX_OPTION_LEN};

/// What a client asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientConfig {
    /// The export's name (`""`: the default export).
    pub export: String,
    /// Start TLS before anything else (the server must accept it).
    pub tls: bool,
    /// Ask for structured replies.
    pub structured: bool,
    /// Ask for the `base:allocation` metadata context (needs structured replies).
    pub allocation: bool,
}

/// What the server told the client about the export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportDetails {
    /// Size in bytes.
    pub size: u64,
    /// Transmission flags.
    pub flags: u16,
    /// Block size constraints, if the server sent them.
    pub block: Option<BlockSize>,
    /// Structured replies were negotiated.
    pub structured: bool,
    /// The context id of `base:allocation`, if selected.
    pub allocation_context: Option<u32>,
}

/// What the driver of a [`ClientHandshake`] must do next (after sending what was queued).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientStep {
    /// Read more bytes from the server.
    NeedMore,
    /// Run a TLS handshake as the client on the same stream, then call
    /// [`ClientHandshake::tls_started`].
    StartTls,
    /// The transmission phase begins.
    Done(ExportDetails),
}

/// Why a client's handshake failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ClientHandshakeError {
    /// The peer does not greet like an NBD newstyle server.
    #[error(
        "the server is not an NBD server (it sent {found:#018x} where NBDMAGIC/IHAVEOPT belong)"
    )]
    NotNbd {
        /// The eight bytes found.
        found: u64,
    },
    /// The server does not speak fixed newstyle.
    #[error("the NBD server does not speak the fixed-newstyle handshake")]
    NotFixedNewstyle,
    /// The server refused an option with an error.
    #[error("the NBD server refused {option}: {reply}{}", if message.is_empty() { String::new() } else { format!(" ({message})") })]
    Refused {
        /// The option, by name.
        option: &'static str,
        /// The error reply, by name.
        reply: &'static str,
        /// The server's message.
        message: String,
    },
    /// The server answered with something the protocol does not allow here.
    #[error("the NBD server sent a malformed handshake reply: {0}")]
    Malformed(&'static str),
    /// The server sent no size for the export.
    #[error("the NBD server accepted the export without saying its size")]
    NoExportInfo,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Greeting,
    StartTls,
    Structured,
    Meta,
    Go,
    ExportName,
    Finished,
}

/// The client's side of the fixed-newstyle handshake: `STARTTLS` (optional),
/// `STRUCTURED_REPLY`, `SET_META_CONTEXT base:allocation`, then `GO` (falling back to
/// `EXPORT_NAME` for servers that do not know `GO`).
#[derive(Debug)]
pub struct ClientHandshake {
    config: ClientConfig,
    phase: Phase,
    no_zeroes: bool,
    structured: bool,
    allocation: Option<u32>,
    size: Option<(u64, u16)>,
    block: Option<BlockSize>,
}

fn option_name(option: u32) -> &'static str {
    match option {
        opt::EXPORT_NAME => "NBD_OPT_EXPORT_NAME",
        opt::ABORT => "NBD_OPT_ABORT",
        opt::LIST => "NBD_OPT_LIST",
        opt::STARTTLS => "NBD_OPT_STARTTLS",
        opt::INFO => "NBD_OPT_INFO",
        opt::GO => "NBD_OPT_GO",
        opt::STRUCTURED_REPLY => "NBD_OPT_STRUCTURED_REPLY",
        opt::LIST_META_CONTEXT => "NBD_OPT_LIST_META_CONTEXT",
        opt::SET_META_CONTEXT => "NBD_OPT_SET_META_CONTEXT",
        _ => "an option",
    }
}

fn reply_name(ty: u32) -> &'static str {
    match ty {
        rep::ERR_UNSUP => "unsupported (NBD_REP_ERR_UNSUP)",
        rep::ERR_POLICY => "refused by policy (NBD_REP_ERR_POLICY)",
        rep::ERR_INVALID => "invalid (NBD_REP_ERR_INVALID)",
        rep::ERR_PLATFORM => "not on this platform (NBD_REP_ERR_PLATFORM)",
        rep::ERR_TLS_REQD => "TLS required (NBD_REP_ERR_TLS_REQD)",
        rep::ERR_UNKNOWN => "no such export (NBD_REP_ERR_UNKNOWN)",
        rep::ERR_SHUTDOWN => "shutting down (NBD_REP_ERR_SHUTDOWN)",
        rep::ERR_BLOCK_SIZE_REQD => "block sizes required (NBD_REP_ERR_BLOCK_SIZE_REQD)",
        rep::ERR_TOO_BIG => "too big (NBD_REP_ERR_TOO_BIG)",
        _ => "an unknown error",
    }
}

fn put_option(out: &mut BytesMut, option: u32, data: &[u8]) {
    out.put_u64(IHAVEOPT);
    out.put_u32(option);
    out.put_u32(data.len() as u32);
    out.put_slice(data);
}

impl ClientHandshake {
    /// A machine for one connection (nothing is sent before the server's greeting).
    pub fn new(config: ClientConfig) -> Self {
        Self {
            config,
            phase: Phase::Greeting,
            no_zeroes: false,
            structured: false,
            allocation: None,
            size: None,
            block: None,
        }
    }

    /// The stream was upgraded to TLS after [`ClientStep::StartTls`]; queues the next option.
    pub fn tls_started(&mut self, out: &mut BytesMut) {
        self.after_tls(out);
    }

    fn after_tls(&mut self, out: &mut BytesMut) {
        if self.config.structured {
            self.phase = Phase::Structured;
            put_option(out, opt::STRUCTURED_REPLY, &[]);
        } else {
            self.send_go(out);
        }
    }

    fn send_meta(&mut self, out: &mut BytesMut) {
        self.phase = Phase::Meta;
        let name = self.config.export.as_bytes();
        let mut d = BytesMut::new();
        d.put_u32(name.len() as u32);
        d.put_slice(name);
        d.put_u32(1);
        d.put_u32(BASE_ALLOCATION.len() as u32);
        d.put_slice(BASE_ALLOCATION.as_bytes());
        put_option(out, opt::SET_META_CONTEXT, &d);
    }

    fn send_go(&mut self, out: &mut BytesMut) {
        self.phase = Phase::Go;
        let name = self.config.export.as_bytes();
        let mut d = BytesMut::new();
        d.put_u32(name.len() as u32);
        d.put_slice(name);
        d.put_u16(1);
        d.put_u16(info::BLOCK_SIZE);
        put_option(out, opt::GO, &d);
    }

    fn done(&mut self) -> Result<ClientStep, ClientHandshakeError> {
        self.phase = Phase::Finished;
        let (size, flags) = self.size.ok_or(ClientHandshakeError::NoExportInfo)?;
        Ok(ClientStep::Done(ExportDetails {
            size,
            flags,
            block: self.block,
            structured: self.structured,
            allocation_context: self.allocation,
        }))
    }

    /// Consumes what it can of `input`, appends what to send to `out`, and says what to do
    /// next.
    pub fn step(
        &mut self,
        input: &mut BytesMut,
        out: &mut BytesMut,
    ) -> Result<ClientStep, ClientHandshakeError> {
        loop {
            match self.phase {
                Phase::Finished => return Err(ClientHandshakeError::Malformed("handshake over")),
                Phase::Greeting => {
                    if input.len() < 18 {
                        return Ok(ClientStep::NeedMore);
                    }
                    for (at, want) in [(0, NBDMAGIC), (8, IHAVEOPT)] {
                        let found = be64(input, at);
                        if found != want {
                            return Err(ClientHandshakeError::NotNbd { found });
                        }
                    }
                    let flags = u16::from_be_bytes([input[16], input[17]]);
                    input.advance(18);
                    if flags & FLAG_FIXED_NEWSTYLE == 0 {
                        return Err(ClientHandshakeError::NotFixedNewstyle);
                    }
                    self.no_zeroes = flags & FLAG_NO_ZEROES != 0;
                    let mut cflags = FLAG_C_FIXED_NEWSTYLE;
                    if self.no_zeroes {
                        cflags |= FLAG_C_NO_ZEROES;
                    }
                    out.put_u32(cflags);
                    if self.config.tls {
                        self.phase = Phase::StartTls;
                        put_option(out, opt::STARTTLS, &[]);
                    } else {
                        self.after_tls(out);
                    }
                }
                Phase::ExportName => {
                    let need = if self.no_zeroes { 10 } else { 134 };
                    if input.len() < need {
                        return Ok(ClientStep::NeedMore);
                    }
                    let size = be64(input, 0);
                    let flags = u16::from_be_bytes([input[8], input[9]]);
                    input.advance(need);
                    self.size = Some((size, flags));
                    return self.done();
                }
                _ => {
                    if input.len() < 20 {
                        return Ok(ClientStep::NeedMore);
                    }
                    if be64(input, 0) != OPT_REPLY_MAGIC {
                        return Err(ClientHandshakeError::Malformed("bad option reply magic"));
                    }
                    let option = be32(input, 8);
                    let ty = be32(input, 12);
                    let len = be32(input, 16);
                    if len > MAX_OPTION_LEN {
                        return Err(ClientHandshakeError::Malformed("option reply too long"));
                    }
                    if input.len() < 20 + len as usize {
                        return Ok(ClientStep::NeedMore);
                    }
                    input.advance(20);
                    let data = input.split_to(len as usize);
                    if let Some(step) = self.on_reply(option, ty, &data, out)? {
                        return Ok(step);
                    }
                }
            }
        }
    }

    fn on_reply(
        &mut self,
        option: u32,
        ty: u32,
        data: &[u8],
        out: &mut BytesMut,
    ) -> Result<Option<ClientStep>, ClientHandshakeError> {
        let expected = match self.phase {
            Phase::StartTls => opt::STARTTLS,
            Phase::Structured => opt::STRUCTURED_REPLY,
            Phase::Meta => opt::SET_META_CONTEXT,
            _ => opt::GO,
        };
        if option != expected {
            return Err(ClientHandshakeError::Malformed(
                "a reply to an option that was not sent",
            ));
        }
        let refused = || ClientHandshakeError::Refused {
            option: option_name(option),
            reply: reply_name(ty),
            message: String::from_utf8_lossy(data).into_owned(),
        };
        match (self.phase, ty) {
            (Phase::StartTls, rep::ACK) => return Ok(Some(ClientStep::StartTls)),
            (Phase::StartTls, _) => return Err(refused()),
            (Phase::Structured, rep::ACK) => {
                self.structured = true;
                if self.config.allocation {
                    self.send_meta(out);
                } else {
                    self.send_go(out);
                }
            }
            (Phase::Structured, t) if t & rep::ERR != 0 => self.send_go(out),
            (Phase::Meta, rep::META_CONTEXT) => {
                let mut c = Cursor(data);
                let id = c
                    .u32()
                    .ok_or(ClientHandshakeError::Malformed("short META_CONTEXT"))?;
                if c.0 == BASE_ALLOCATION.as_bytes() {
                    self.allocation = Some(id);
                }
            }
            (Phase::Meta, rep::ACK) => self.send_go(out),
            (Phase::Meta, t) if t & rep::ERR != 0 => {
                self.allocation = None;
                self.send_go(out);
            }
            (Phase::Go, rep::INFO) => {
                let mut c = Cursor(data);
                match c.u16() {
                    Some(info::EXPORT) => {
                        let size = c.u64();
                        let flags = c.u16();
                        match (size, flags, c.rest()) {
                            (Some(s), Some(f), 0) => self.size = Some((s, f)),
                            _ => return Err(ClientHandshakeError::Malformed("bad INFO_EXPORT")),
                        }
                    }
                    Some(info::BLOCK_SIZE) => {
                        let (min, pref, max) = (c.u32(), c.u32(), c.u32());
                        match (min, pref, max, c.rest()) {
                            (Some(min), Some(preferred), Some(max), 0) => {
                                self.block = Some(BlockSize {
                                    min,
                                    preferred,
                                    max,
                                })
                            }
                            _ => {
                                return Err(ClientHandshakeError::Malformed("bad INFO_BLOCK_SIZE"))
                            }
                        }
                    }
                    Some(_) => {}
                    None => return Err(ClientHandshakeError::Malformed("empty INFO reply")),
                }
            }
            (Phase::Go, rep::ACK) => return self.done().map(Some),
            (Phase::Go, rep::ERR_UNSUP) => {
                self.phase = Phase::ExportName;
                put_option(out, opt::EXPORT_NAME, self.config.export.as_bytes());
            }
            (Phase::Go, t) if t & rep::ERR != 0 => return Err(refused()),
            _ => {
                return Err(ClientHandshakeError::Malformed(
                    "an option reply of an unexpected type",
                ))
            }
        }
        Ok(None)
    }
}
