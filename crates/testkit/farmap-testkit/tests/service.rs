//! The service harness starts a real server, reports its values, and stops it.

use std::io::{Read, Write};
use std::net::TcpStream;

use farmap_testkit::{skip, Service};

#[test]
fn redis_service_starts_answers_and_stops() {
    let svc = match Service::start("redis", &[]) {
        Ok(s) => s,
        Err(e) => return skip("redis_service_starts_answers_and_stops", e),
    };
    let port: u16 = svc.var("PORT").parse().expect("a port");
    assert_eq!(svc.var("SPEC_BASE"), format!("redis://127.0.0.1:{port}"));
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("redis listens");
    s.write_all(b"PING\r\n").unwrap();
    let mut buf = [0u8; 7];
    s.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"+PONG\r\n");
    drop(s);
    svc.stop();
    assert!(
        TcpStream::connect(("127.0.0.1", port)).is_err(),
        "redis still listens on {port} after stop"
    );
}

#[test]
fn a_missing_script_is_a_clear_error() {
    let e = Service::start("no-such-service", &[]).unwrap_err();
    assert!(e.to_string().contains("no script"), "{e}");
}
