//! A region of memory backed by a memory store: fill the store, read it through plain memory,
//! write, sync, and see the writes in the store.
//!
//! ```text
//! cargo run -p farmap --example region
//! ```

use std::error::Error;
use std::sync::Arc;

use farmap::pipeline::PushOptions;
use farmap::store::MemoryStore;
use farmap::{ChunkIdx, Geometry, Region, RegionOptions, Store};

fn main() -> Result<(), Box<dyn Error>> {
    // Says why if this machine has no usable userfaultfd.
    farmap::region::probe()?;
    // A 64 MiB store in 64 KiB chunks, with a greeting in chunk 3.
    let geometry = Geometry::new(64 << 20, 64 << 10)?;
    let store = Arc::new(MemoryStore::new(geometry));
    let rt = tokio::runtime::Builder::new_current_thread().build()?;
    let mut chunk = vec![0u8; 64 << 10];
    chunk[..14].copy_from_slice(b"hello, farmap!");
    rt.block_on(store.write(ChunkIdx(3), chunk.into()))?;

    // Map it. Nothing is fetched until touched; the background puller fills the rest.
    let opts = RegionOptions {
        push: PushOptions {
            interval: None, // push at sync() only, for this demo
            ..PushOptions::default()
        },
        ..RegionOptions::default()
    };
    let region = Region::open(store.clone(), opts)?;
    let mut greeting = [0u8; 14];
    region.memory().read_into(3 * (64 << 10), &mut greeting)?;
    println!("read through memory: {:?}", std::str::from_utf8(&greeting)?);
    assert_eq!(&greeting, b"hello, farmap!");

    // Write through memory: tracked per page, pushed by sync().
    region.memory().write_from(1000, b"world")?;
    let dirty = region.take_dirty()?;
    println!(
        "written pages: {:?} in chunks {:?}",
        dirty.pages, dirty.chunks
    );
    region.memory().write_from(1000, b"again")?; // re-dirty after the take
    region.sync()?;
    let stored = rt.block_on(store.read(ChunkIdx(0)))?;
    println!(
        "the store now says: {:?}",
        std::str::from_utf8(&stored[1000..1005])?
    );
    assert_eq!(&stored[1000..1005], b"again");

    let pull = region.wait_pull().expect("managed regions pull");
    println!("background pull: {:?} in {:?}", pull.progress, pull.elapsed);
    println!("{:#?}", region.stats());
    region.close()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn runs() {
        if let Err(e) = farmap::region::probe() {
            farmap_testkit::skip("examples/region.rs: runs", e);
            return;
        }
        super::main().unwrap();
    }
}
