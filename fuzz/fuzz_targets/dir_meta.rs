//! The dir store's metadata decoder (`farmap-dir.meta`) on arbitrary bytes: it must never
//! panic, and what it accepts must render back to the same values.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    farmap_store::fuzz_dir_meta(data);
});
