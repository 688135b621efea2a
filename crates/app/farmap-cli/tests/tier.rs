//! `tier:` through the CLI, process by process: what a `memory:` tier held does not outlive
//! the process that wrote it, and the next process says so instead of reading zeros.

mod common;
use common::farmap;

#[test]
fn chunks_left_in_a_memory_tier_are_an_error_in_the_next_process_not_zeros() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.img");
    let data: Vec<u8> = (0..4u32 << 20).map(|i| (i / 4096) as u8 | 1).collect();
    std::fs::write(&src, &data).unwrap();
    let spec = format!(
        "tier:(memory:4MiB?chunk=64KiB&cap=1MiB)(dir:{}?size=4MiB&chunk=64KiB)",
        dir.path().join("chunks").display()
    );
    // One process writes the region: its first MiB lands in the memory tier.
    farmap().ok(&["cp", &format!("file:{}", src.display()), &spec]);
    assert!(
        dir.path().join("chunks.tiers").exists(),
        "the placement map is kept beside the dir tier"
    );
    // The next process cannot have that MiB: it fails, naming why.
    let out = dir.path().join("out.img");
    let err = farmap().fails(&["cp", &spec, &format!("file:{}", out.display())]);
    assert!(err.contains("lost") && err.contains("memory"), "{err}");
}
