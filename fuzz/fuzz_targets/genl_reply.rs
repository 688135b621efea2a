//! The kernel NBD client's generic netlink decoder on arbitrary datagrams (what it reads
//! from the kernel): splitting into messages, attributes, nested attributes, the family and
//! connect replies. None may panic, and every attribute lies within the datagram.
#![no_main]

use farmap_nbd_kernel::genl::{attrs, decode, family_reply, nbd_index, Message};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(msgs) = decode(data) else {
        return;
    };
    for m in msgs {
        if let Message::Genl { attrs: block, .. } = m {
            assert!(block.len() <= data.len());
            let _ = family_reply(block);
            let _ = nbd_index(block);
            for a in attrs(block).take(4096).flatten() {
                assert!(a.payload.len() <= block.len());
                let _ = a.string();
                let _ = a.u16();
                for n in a.nested().take(4096).flatten() {
                    let _ = n.u32();
                    let _ = n.string();
                }
            }
        }
    }
});
