//! Generates the gRPC messages, client and server from `proto/farmap/v1/store.proto`, with the
//! `protoc` binary shipped by the `protoc-bin-vendored` crate (nothing to install).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/farmap/v1/store.proto";
    println!("cargo:rerun-if-changed={proto}");
    let mut config = prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    // Chunk payloads as `bytes::Bytes`: decoded without a copy, shared with the store.
    config.bytes(["."]);
    tonic_prost_build::configure()
        // Messages are encoded into a buffer reserved for their length (see src/codec.rs).
        .codec_path("crate::codec::ReservingCodec")
        .build_client(true)
        .build_server(true)
        .build_transport(false)
        .compile_with_config(config, &[proto], &["proto"])?;
    Ok(())
}
