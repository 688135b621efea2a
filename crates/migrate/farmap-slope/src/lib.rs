//! Object migration (Slope; see `docs/design/slope.md`): an object of a
//! [`farmap_arena::Arena`] moves to another process of the same arena as its pages, at the
//! same address, with no serialization code.
//!
//! The source ([`migrate`]) sends the object's page set while its threads keep working
//! (writes are tracked by asynchronous write protection, never blocked), then rounds of the
//! pages written meanwhile; then it closes writes, waits for its writers to leave and sends
//! the last written pages with the hand-over. The destination ([`ObjListener::accept`])
//! installs them and says so; the source then closes reads, waits for its readers, and
//! releases the object, which from then on is the destination's
//! ([`Obj::attach`](farmap_arena::Obj::attach)).
//!
//! The connection is farmap's migration channel (`Msg::Object` frames), so it is
//! authenticated with the migration key like region migrations; pages travel inline. This
//! is pre-copy only: every page is at the destination before it owns the object.

mod dest;
mod error;
mod link;
pub mod msg;
mod source;

pub use dest::{Arrival, ObjListener, HANDSHAKE_LIMIT, IDLE_LIMIT};
pub use error::SlopeError;
pub use source::{migrate, MigrateOptions, MigrationReport};
