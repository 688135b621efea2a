"""Live migration of a region within this process: seed, leech, the data moves."""

import threading
import time

import numpy as np
import pytest

import farmap

MIB = 1 << 20


def test_a_region_moves_to_a_leecher_with_its_data(uffd):
    source = farmap.open_region("memory:8MiB?chunk=64KiB")
    rng = np.random.default_rng(3)
    data = rng.integers(0, 1 << 32, size=2 * MIB, dtype=np.uint32)
    arr = np.frombuffer(source, dtype=np.uint32)
    arr[:] = data
    del arr
    seeding = source.seed()
    assert ":" in seeding.control
    moved, report = farmap.leech(seeding.control, mode="precopy")
    seed_report = seeding.wait()
    assert report["mode"] == "precopy" and seed_report["mode"] == "precopy"
    assert report["bytes_precopy"] + report["bytes_postcopy"] >= 8 * MIB
    with moved:
        assert moved.size == 8 * MIB
        got = np.frombuffer(moved, dtype=np.uint32)
        assert np.array_equal(got, data)
        # The new region is ordinary memory of this process: writable in place.
        got[0] = 7
        assert moved.read(0, 4) == (7).to_bytes(4, "little")
        del got
    with pytest.raises(farmap.FarmapError):
        seeding.wait()  # once only
    source.close()


def test_waiting_for_a_seeding_releases_the_gil(uffd):
    """wait() blocks until a leecher is done; the leecher starts on this thread meanwhile,
    which needs the GIL: had wait() kept it, the leecher could only start after wait() gave
    up at its timeout, and the waiting thread would have a StoreTimeoutError."""
    source = farmap.open_region("memory:1MiB?chunk=64KiB")
    source.write(0, b"gil")
    seeding = source.seed()
    # Nobody leeches yet: a short wait times out, and the seeding goes on.
    with pytest.raises(farmap.StoreTimeoutError):
        seeding.wait(timeout=0.05)
    result = {}

    def wait():
        try:
            result["seed"] = seeding.wait(timeout=20)
        except farmap.FarmapError as e:
            result["error"] = e

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.1)  # the thread is inside wait()
    moved, report = farmap.leech(seeding.control, mode="postcopy")
    t.join(timeout=60)
    assert not t.is_alive(), "Seeding.wait() did not return"
    assert "error" not in result, result
    assert result["seed"]["mode"] == "postcopy"
    with moved:
        assert moved.read(0, 3) == b"gil"
    source.close()


def key_file(path, secret: str, mode=0o600):
    path.write_text(secret + "\n")
    path.chmod(mode)
    return path


def test_both_sides_must_hold_the_same_key_file(tmp_path, uffd):
    ours = key_file(tmp_path / "ours", "a" * 64)
    theirs = key_file(tmp_path / "theirs", "b" * 64)
    source = farmap.open_region("memory:1MiB?chunk=64KiB")
    source.write(100, b"keyed")
    seeding = source.seed(key_file=ours)
    # A leecher with another key is refused, and the seeding goes on for the right one.
    with pytest.raises(farmap.MigrationError):
        farmap.leech(seeding.control, key_file=theirs)
    # So is one with this process's own key (no key file).
    with pytest.raises(farmap.MigrationError):
        farmap.leech(seeding.control)
    moved, _ = farmap.leech(seeding.control, key_file=ours)
    seeding.wait(timeout=30)
    with moved:
        assert moved.read(100, 5) == b"keyed"
    source.close()


def test_key_files_are_checked_before_anything_starts(tmp_path, uffd):
    with farmap.open_region("memory:1MiB?chunk=64KiB") as source:
        with pytest.raises(farmap.NotFoundError):
            source.seed(key_file=tmp_path / "absent")
        with pytest.raises(farmap.PermissionDeniedError):
            source.seed(key_file=key_file(tmp_path / "open", "c" * 64, mode=0o644))
        with pytest.raises(farmap.InvalidInputError):
            source.seed(key_file=key_file(tmp_path / "short", "d"))


def test_bad_migration_arguments_raise_typed_errors(uffd):
    with pytest.raises(farmap.InvalidInputError):
        farmap.leech("127.0.0.1:1", mode="sideways")
    with pytest.raises(farmap.InvalidInputError):
        farmap.leech("not an address")
    with pytest.raises(farmap.MigrationError):
        farmap.leech("127.0.0.1:1")  # nobody listens there
