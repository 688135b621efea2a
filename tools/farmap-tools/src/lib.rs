//! What is not the farmap product but ships beside it, linked into the `farmap` binary by its
//! default `tools` feature:
//!
//! - [`mod@bench`]: `farmap bench ...`, a benchmark per data path, each against a reference
//!   measured in the same run (`--json`: one object per line on stdout);
//! - [`demo`]: `farmap demo`, a live migration shown end to end between two processes, and
//!   the hidden `farmap __demo-node` those processes run;
//! - [`guest`]: `farmap __guest`, the pattern writes and checks the kernel tests run inside
//!   their VM;
//! - `bench/uffd_raw.rs`: a raw userfaultfd handler, the reference of `bench uffd` and
//!   `bench paging` (the crate's only `unsafe` code).
#![deny(unsafe_code)]

#[macro_use]
extern crate farmap_cli_kit;

pub mod bench;
pub mod demo;
pub mod guest;

use farmap_cli_kit::output;
