//! The object migration messages (farmap-slope) on arbitrary bytes: the decoder must never
//! panic; every message it accepts must encode to bytes that decode to the same message (an
//! `Abort` reason is decoded lossily, so it is compared re-decoded), and the run checker
//! must never panic on what it decodes.
#![no_main]

use farmap_slope::msg::{check_runs, ObjMsg};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(msg) = ObjMsg::decode(data) else {
        return;
    };
    let back = ObjMsg::decode(&msg.encode()).expect("an encoded message decodes");
    match &msg {
        ObjMsg::Abort { .. } => {
            assert_eq!(ObjMsg::decode(&back.encode()).expect("decodes"), back, "stable");
        }
        _ => assert_eq!(back, msg, "the message survives a round trip"),
    }
    if let ObjMsg::Pages { runs, data, .. } | ObjMsg::HandOver { runs, data, .. } = &msg {
        let _ = check_runs(runs, data.len(), 1 << 18, 4096);
    }
});
