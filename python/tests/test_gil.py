"""Blocking calls release the GIL: another Python thread runs while one waits in farmap.

The other thread here is the peer the blocking call waits for: a Python socket server that
the `farmap://` client connects to while `open_store` waits for the server's answer. With the
GIL released, the server thread accepts, reads the client's first bytes and hangs up, and
`open_store` fails at once; had `open_store` kept the GIL, the server thread could not run
until the call gave up at its timeout (5 s).
"""

import socket
import threading
import time

import pytest

import farmap


def test_a_python_thread_serves_the_peer_that_a_blocking_call_waits_for():
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    seen = {}

    def serve_once():
        conn, _ = srv.accept()
        seen["accepted"] = time.monotonic()
        srv.close()  # later connection attempts are refused: the client gives up quickly
        conn.settimeout(5)
        try:
            seen["bytes"] = conn.recv(64)
        except OSError:
            seen["bytes"] = b""
        conn.close()

    t = threading.Thread(target=serve_once)
    t.start()
    start = time.monotonic()
    with pytest.raises(farmap.FarmapError) as e:
        farmap.open_store(f"farmap://127.0.0.1:{port}?timeout=5s")
    elapsed = time.monotonic() - start
    t.join(timeout=30)
    assert not t.is_alive()
    assert seen["bytes"], "the client sent nothing"
    assert elapsed < 2.5, f"open_store waited {elapsed:.1f} s: the server thread could not run"
    assert str(e.value)


def test_many_threads_use_one_store_at_once():
    """Four threads write and read their own quarter concurrently; nothing is lost."""
    store = farmap.open_store("memory:4MiB?chunk=4KiB")
    errors = []

    def work(k):
        try:
            base = k * (1 << 20)
            for i in range(64):
                data = bytes([k * 64 + i & 0xFF]) * 5000
                store.write(base + i * 5000, data)
                assert store.read(base + i * 5000, 5000) == data
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for k in range(4):
        assert store.read(k * (1 << 20) + 63 * 5000, 5000) == bytes([k * 64 + 63 & 0xFF]) * 5000
    store.close()
