"""Regions: the mapping as a writable buffer, numpy on it without a copy, sync to the store,
faults that bring in the store's data, and the lifetime rules of exported buffers."""

import gc
import time

import numpy as np
import pytest

import farmap

KIB = 1024
MIB = 1024 * KIB


def settled(read, want, patience=5.0):
    """`read()` once it reaches `want` (the fault handler counts a fetch just after it wakes
    the faulting thread), or its last value after `patience` seconds."""
    deadline = time.monotonic() + patience
    value = read()
    while value < want and time.monotonic() < deadline:
        time.sleep(0.001)
        value = read()
    return value


def test_numpy_wraps_the_mapping_and_its_writes_reach_the_store(tmp_path, uffd):
    spec = f"file:{tmp_path}/disk.img?size=4MiB&chunk=64KiB"
    with farmap.open_region(spec) as region:
        assert region.size == 4 * MIB and len(region) == 4 * MIB
        arr = np.frombuffer(region, dtype=np.uint32)
        assert arr.shape == (MIB,)
        assert arr.flags.writeable
        # The array's memory is the mapping itself, not a copy.
        assert arr.ctypes.data == region.address
        view = region.memoryview()
        assert not view.readonly and view.nbytes == 4 * MIB and view.format == "B"
        assert region.exports == 2
        arr[: 64 * KIB] = np.arange(64 * KIB, dtype=np.uint32)
        arr[-1] = 0xDEADBEEF
        # Seen through the other views at once (same memory).
        assert view[4:8].tobytes() == (1).to_bytes(4, "little")
        assert region.read(4 * MIB - 4, 4) == (0xDEADBEEF).to_bytes(4, "little")
        region.sync()
        # The store has it after sync: a second opening of the file reads it.
        with farmap.open_store(f"file:{tmp_path}/disk.img?ro") as s:
            assert s.read(0, 256 * KIB) == np.arange(64 * KIB, dtype=np.uint32).tobytes()
            assert s.read(4 * MIB - 4, 4) == (0xDEADBEEF).to_bytes(4, "little")
        del arr
        view.release()
        assert region.exports == 0
    assert region.closed


def test_touching_the_region_faults_in_the_stores_data(tmp_path, uffd):
    spec = f"file:{tmp_path}/disk.img?size=2MiB&chunk=64KiB"
    rng = np.random.default_rng(7)
    data = rng.integers(0, 256, size=2 * MIB, dtype=np.uint8)
    with farmap.open_store(spec) as s:
        s.write(0, data.tobytes())
    with farmap.open_region(spec, mode="direct") as region:
        assert region.stats()["chunks_fetched"] == 0
        arr = np.frombuffer(region, dtype=np.uint8)
        # One byte of chunk 5: that chunk, and no other, is fetched (direct mode: no pull).
        assert arr[5 * 64 * KIB + 3] == data[5 * 64 * KIB + 3]
        fetched = settled(lambda: region.stats()["chunks_fetched"], 1)
        assert fetched == 1, region.stats()
        assert np.array_equal(arr[5 * 64 * KIB : 6 * 64 * KIB], data[5 * 64 * KIB : 6 * 64 * KIB])
        assert region.stats()["chunks_fetched"] == 1
        # Then everything.
        assert np.array_equal(arr, data)
        assert settled(lambda: region.stats()["chunks_fetched"], 32) == 32, region.stats()
        assert region.stats()["faults"] >= 32
        del arr


def test_close_is_refused_while_a_buffer_is_exported(uffd):
    region = farmap.open_region("memory:1MiB?chunk=64KiB")
    view = memoryview(region)
    arr = np.frombuffer(region, dtype=np.uint8)
    with pytest.raises(farmap.BusyError) as e:
        region.close()
    assert isinstance(e.value, BufferError)
    # Nothing changed: still open, still usable through the views.
    assert not region.closed
    view[0] = 42
    assert arr[0] == 42
    view.release()
    with pytest.raises(farmap.BusyError):
        region.close()
    del arr
    gc.collect()
    region.close()
    assert region.closed
    region.close()  # twice: nothing
    with pytest.raises(farmap.ClosedError):
        memoryview(region)
    with pytest.raises(farmap.ClosedError):
        region.read(0, 1)


def test_a_dropped_region_is_synced(tmp_path, uffd):
    spec = f"file:{tmp_path}/disk.img?size=1MiB&chunk=64KiB"
    region = farmap.open_region(spec)
    region.write(1000, b"written, never synced by hand")
    del region
    gc.collect()
    with farmap.open_store(spec) as s:
        assert s.read(1000, 29) == b"written, never synced by hand"


def test_region_arguments_are_checked(tmp_path, uffd):
    with pytest.raises(farmap.InvalidInputError):
        farmap.open_region("memory:1MiB", mode="sideways")
    with pytest.raises(farmap.SpecError):
        farmap.open_region("memory:lots")
    with farmap.open_region("memory:1MiB?chunk=64KiB") as region:
        with pytest.raises(farmap.OutOfRangeError):
            region.write(MIB - 1, b"ab")
        with pytest.raises(farmap.OutOfRangeError):
            region.read(-1, 4)
        assert region.read(MIB - 2, 2) == b"\0\0"
