//! The library in plain mode (no `FARMAP_RUN_SOCK`) under real programs: each must run as
//! it does without it, and its stats line must show that the library's main heap served
//! its allocations.

mod common;

use std::process::Command;

use common::{assert_success, count, preloaded, python_tagged, stat, stats};

const PYTHON: &str = "/usr/bin/python3";

#[test]
fn bin_true_runs_and_reports() {
    let out = preloaded("/bin/true").output().unwrap();
    assert_success(&out, "/bin/true");
    let s = stats(&out);
    assert_eq!(stat(&s, "mode"), "plain");
    assert_eq!(count(&s, "child_allocs"), 0);
}

#[test]
fn python_pass_is_served_by_the_main_heap() {
    let out = preloaded(PYTHON).args(["-c", "pass"]).output().unwrap();
    assert_success(&out, "python3 -c pass");
    let s = stats(&out);
    assert_eq!(stat(&s, "mode"), "plain");
    assert!(count(&s, "main_allocs") > 100, "{s:?}");
}

#[test]
fn python_threads_read_back_100_mib_of_tagged_objects() {
    let out = preloaded(PYTHON)
        .args(["-c", &python_tagged(4, 100)])
        .output()
        .unwrap();
    assert_success(&out, "python3 (4 threads, 100 MiB)");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "ok");
    let s = stats(&out);
    // 1,600 bytearrays of 64 KiB (above pymalloc's 512 B) come from malloc.
    assert!(count(&s, "main_allocs") > 1600, "{s:?}");
}

#[test]
fn a_failed_handshake_exits_127_or_falls_back_when_optional() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("nobody-listens");
    let out = preloaded("/bin/true")
        .env("FARMAP_RUN_SOCK", &sock)
        .env("FARMAP_RUN_TOKEN", "00".repeat(32))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(127), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("connecting to FARMAP_RUN_SOCK"), "{stderr}");
    let out = preloaded(PYTHON)
        .args(["-c", "print(len(bytearray(10**6)))"])
        .env("FARMAP_RUN_SOCK", &sock)
        .env("FARMAP_RUN_TOKEN", "00".repeat(32))
        .env("FARMAP_RUN_OPTIONAL", "1")
        .output()
        .unwrap();
    assert_success(&out, "python3 with FARMAP_RUN_OPTIONAL=1");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "1000000");
    let s = stats(&out);
    assert_eq!(stat(&s, "mode"), "plain");
    assert!(count(&s, "main_allocs") > 0, "{s:?}");
    let out = preloaded("/bin/true")
        .env("FARMAP_RUN_SOCK", &sock)
        .env("FARMAP_RUN_TOKEN", "not hex")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(127), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("FARMAP_RUN_TOKEN"));
}

/// glibc's malloc semantics and the C++ operators, checked from C++ under the library.
const CXX: &str = r#"
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <malloc.h>
#include <new>
#include <string>
#include <vector>

static int failures = 0;
#define CHECK(c) do { if (!(c)) { std::printf("FAIL line %d: %s\n", __LINE__, #c); failures++; } } while (0)

struct alignas(256) Wide { char bytes[300]; };

int main() {
    void *a = std::malloc(0), *b = std::malloc(0);
    CHECK(a && b && a != b);
    std::free(a); std::free(b);
    std::free(nullptr);
    errno = 1234; void *c = std::malloc(100); std::free(c);
    CHECK(errno == 1234);
    errno = 0;
    CHECK(std::calloc(SIZE_MAX / 2, 3) == nullptr && errno == ENOMEM);
    int *z = (int *)std::calloc(1000, sizeof(int));
    bool zeros = true; for (int i = 0; i < 1000; i++) zeros &= z[i] == 0;
    CHECK(zeros);
    void *r = std::malloc(10);
    CHECK(realloc(r, 0) == nullptr);
    char *g = (char *)std::malloc(100);
    std::memset(g, 'x', 100);
    g = (char *)std::realloc(g, 1 << 20);
    CHECK(g[0] == 'x' && g[99] == 'x');
    std::free(g);
    void *p = nullptr;
    CHECK(posix_memalign(&p, 24, 10) == EINVAL);
    CHECK(posix_memalign(&p, 4096, 10) == 0 && ((uintptr_t)p & 4095) == 0);
    std::free(p);
    void *m = memalign(24, 10);
    CHECK(m && ((uintptr_t)m & 31) == 0);
    std::free(m);
    void *al = aligned_alloc(1 << 16, 100);
    CHECK(al && ((uintptr_t)al & 0xffff) == 0);
    std::free(al);
    void *v = valloc(1);
    CHECK(v && ((uintptr_t)v & 4095) == 0);
    std::free(v);
    for (size_t n : {1, 17, 100, 1000, 40000, 100000}) {
        char *q = (char *)std::malloc(n);
        size_t u = malloc_usable_size(q);
        CHECK(u >= n);
        std::memset(q, 0x5a, u);
        std::free(q);
    }
    errno = 0;
    CHECK(reallocarray(nullptr, SIZE_MAX / 2, 3) == nullptr && errno == ENOMEM);
    int *one = new int(42);
    CHECK(*one == 42);
    delete one;
    int *arr = new int[1000];
    for (int i = 0; i < 1000; i++) arr[i] = i;
    CHECK(arr[999] == 999);
    delete[] arr;
    Wide *w = new Wide;
    CHECK(((uintptr_t)w & 255) == 0);
    delete w;
    Wide *ws = new Wide[10];
    CHECK(((uintptr_t)ws & 255) == 0);
    delete[] ws;
    int *nt = new (std::nothrow) int[10];
    CHECK(nt != nullptr);
    delete[] nt;
    std::vector<std::string> strings;
    for (int i = 0; i < 100000; i++) strings.push_back(std::string(40, 'a' + i % 26));
    bool same = true;
    for (int i = 0; i < 100000; i++) same &= strings[i] == std::string(40, 'a' + i % 26);
    CHECK(same);
    std::printf(failures ? "failed\n" : "ok\n");
    return failures ? 1 : 0;
}
"#;

#[test]
fn a_cxx_program_sees_glibcs_semantics_and_its_operators_are_ours() {
    let test = "a_cxx_program_sees_glibcs_semantics_and_its_operators_are_ours";
    if Command::new("g++").arg("--version").output().is_err() {
        farmap_testkit::skip(test, "g++ is not installed");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("t.cc");
    let exe = dir.path().join("t");
    std::fs::write(&src, CXX).unwrap();
    let built = Command::new("g++")
        .args(["-O1", "-std=c++17", "-o"])
        .arg(&exe)
        .arg(&src)
        .output()
        .unwrap();
    assert_success(&built, "g++");
    let plain = Command::new(&exe).output().unwrap();
    assert_success(&plain, "the C++ program without the library");
    let out = preloaded(exe.to_str().unwrap()).output().unwrap();
    assert_success(&out, "the C++ program under the library");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "ok");
    let s = stats(&out);
    // 100,000 strings of 40 bytes (new), plus the vector's growth.
    assert!(count(&s, "main_allocs") > 100_000, "{s:?}");
}

#[test]
fn redis_server_answers_and_its_allocations_are_ours() {
    let test = "redis_server_answers_and_its_allocations_are_ours";
    let cli = |sock: &std::path::Path, args: &[&str]| {
        Command::new("redis-cli")
            .arg("-s")
            .arg(sock)
            .args(args)
            .output()
    };
    if Command::new("redis-server")
        .arg("--version")
        .output()
        .is_err()
        || Command::new("redis-cli").arg("--version").output().is_err()
    {
        farmap_testkit::skip(test, "redis-server or redis-cli is not installed");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("redis.sock");
    let mut server = preloaded("redis-server")
        .args([
            "--port",
            "0",
            "--save",
            "",
            "--appendonly",
            "no",
            "--unixsocket",
        ])
        .arg(&sock)
        .current_dir(dir.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        if let Ok(out) = cli(&sock, &["PING"]) {
            if String::from_utf8_lossy(&out.stdout).trim() == "PONG" {
                break;
            }
        }
        if let Some(status) = server.try_wait().unwrap() {
            panic!("redis-server ended: {status:?}");
        }
        assert!(
            std::time::Instant::now() < deadline,
            "redis-server never answered PING"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // 20,000 keys of 1 KiB through one pipeline-free loop in Lua (one round trip).
    let script = "for i=1,20000 do redis.call('SET', 'k'..i, string.rep(string.char(65 + i % 26), 1024)) end return redis.call('DBSIZE')";
    let out = cli(&sock, &["EVAL", script, "0"]).unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "20000");
    let out = cli(&sock, &["GET", "k12345"]).unwrap();
    let want = std::iter::repeat_n((b'A' + (12345 % 26) as u8) as char, 1024).collect::<String>();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), want);
    let _ = cli(&sock, &["SHUTDOWN", "NOSAVE"]);
    let out = server.wait_with_output().unwrap();
    assert!(out.status.success(), "redis-server: {out:?}");
    let s = stats(&out);
    assert!(count(&s, "main_allocs") > 40_000, "{s:?}");
}
