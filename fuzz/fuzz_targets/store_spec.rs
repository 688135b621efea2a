//! Store spec parsing (`memory:1GiB`, `dir:./x?size=1GiB&chunk=4MiB`, `farmaps://h:1?ca=...`)
//! on arbitrary strings, without opening anything: it must never panic, and every spec it
//! accepts must print (canonical form) to a string that parses back to the same spec, except
//! for a password, which prints as `***`; its secret form (`to_secret_string`, passwords
//! kept: what a region handed to another process opens) must parse back to exactly the spec.
#![no_main]

use farmap::{SpecKind, StoreSpec};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(spec) = text.parse::<StoreSpec>() else {
        return;
    };
    let secret = spec.to_secret_string();
    let back: StoreSpec = secret
        .parse()
        .unwrap_or_else(|e| panic!("{text:?} parsed, but its secret form {secret:?} did not: {e}"));
    assert_eq!(back, spec, "{text:?} -> {secret:?} reads back differently");
    let shown = spec.to_string();
    let again: StoreSpec = shown.parse().unwrap_or_else(|e| {
        panic!("{text:?} parsed, but its canonical form {shown:?} did not: {e}")
    });
    assert_eq!(
        again,
        shown_password(spec),
        "{text:?} -> {shown:?} reads back differently"
    );
});

/// `spec` as its canonical form reads back: a password is `***` there.
fn shown_password(mut spec: StoreSpec) -> StoreSpec {
    match &mut spec.kind {
        SpecKind::Redis(c) if c.password.is_some() => c.password = Some("***".into()),
        SpecKind::Cql(t) if t.password.is_some() => t.password = Some("***".into()),
        SpecKind::Verified { inner } => **inner = shown_password((**inner).clone()),
        SpecKind::Mirror {
            primary, mirror, ..
        } => {
            **primary = shown_password((**primary).clone());
            **mirror = shown_password((**mirror).clone());
        }
        _ => {}
    }
    spec
}
