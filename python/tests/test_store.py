"""Stores by spec: chunks, byte ranges across chunk boundaries, persistence, typed errors."""

import os

import pytest

import farmap

KIB = 1024


def pattern(n: int, seed: int = 1) -> bytes:
    return bytes((i * 7 + seed) % 251 for i in range(n))


@pytest.fixture(params=["memory", "file", "dir"])
def spec(request, tmp_path):
    """A 1 MiB region in chunks of 4 KiB, in each local kind of store."""
    kind = request.param
    if kind == "memory":
        return "memory:1MiB?chunk=4KiB"
    if kind == "file":
        return f"file:{tmp_path}/disk.img?size=1MiB&chunk=4KiB"
    return f"dir:{tmp_path}/chunks?size=1MiB&chunk=4KiB"


def test_geometry_comes_from_the_spec(spec):
    with farmap.open_store(spec) as s:
        assert s.size == 1 << 20
        assert s.chunk_size == 4 * KIB
        assert s.chunk_count == 256
        assert not s.closed


def test_missing_chunks_read_as_zeros_and_written_chunks_read_back(spec):
    with farmap.open_store(spec) as s:
        assert s.read_chunk(5) == bytes(4 * KIB)
        data = pattern(4 * KIB)
        s.write_chunk(5, data)
        assert s.read_chunk(5) == data
        # Its neighbours are untouched.
        assert s.read_chunk(4) == bytes(4 * KIB)
        assert s.read_chunk(6) == bytes(4 * KIB)
        # Chunk and byte views agree.
        assert s.read(5 * 4 * KIB, 4 * KIB) == data


def test_byte_ranges_across_chunk_boundaries(spec):
    with farmap.open_store(spec) as s:
        base = pattern(3 * 4 * KIB, seed=3)
        s.write(0, base)
        # 200 bytes across the boundary of chunks 0 and 1, then 9000 bytes over three chunks.
        s.write(4 * KIB - 100, b"\xaa" * 200)
        s.write(4 * KIB + 50, b"\x55" * 9000)
        want = bytearray(base) + bytearray(4 * KIB)
        want[4 * KIB - 100 : 4 * KIB + 100] = b"\xaa" * 200
        want[4 * KIB + 50 : 4 * KIB + 50 + 9000] = b"\x55" * 9000
        got = s.read(0, len(want))
        assert got == bytes(want)
        # Whole chunks agree with the byte view (read-modify-write kept the other bytes).
        assert s.read_chunk(0) == bytes(want[: 4 * KIB])
        assert s.read_chunk(1) == bytes(want[4 * KIB : 8 * KIB])
        # Unaligned reads of one and of many chunks.
        assert s.read(4 * KIB - 1, 2) == bytes(want[4 * KIB - 1 : 4 * KIB + 1])
        assert s.read(17, 12000) == bytes(want[17:12017])
        # Zero-length reads and writes at the very end are fine.
        assert s.read(s.size, 0) == b""
        s.write(s.size, b"")
        s.write(s.size - 3, b"end")
        assert s.read(s.size - 4, 4) == b"\x00end"


@pytest.mark.parametrize("kind", ["file", "dir"])
def test_flushed_data_survives_a_reopen(tmp_path, kind):
    if kind == "file":
        spec = f"file:{tmp_path}/disk.img?size=256KiB&chunk=4KiB"
    else:
        spec = f"dir:{tmp_path}/chunks?size=256KiB&chunk=4KiB"
    data = pattern(10_000, seed=9)
    s = farmap.open_store(spec)
    s.write(12_345, data)
    s.write_chunk(60, pattern(4 * KIB, seed=11))
    s.flush()
    s.close()
    assert s.closed
    s.close()  # twice: nothing
    if kind == "file":
        with open(tmp_path / "disk.img", "rb") as f:
            f.seek(12_345)
            assert f.read(len(data)) == data  # on disk, in place
    with farmap.open_store(spec) as again:
        assert again.read(12_345, len(data)) == data
        assert again.read_chunk(60) == pattern(4 * KIB, seed=11)
        assert again.read_chunk(0) == bytes(4 * KIB)


def test_a_closed_store_raises_closed_error():
    s = farmap.open_store("memory:64KiB?chunk=4KiB")
    with s:
        s.write(0, b"x")
    assert s.closed
    with pytest.raises(farmap.ClosedError):
        s.read(0, 1)
    with pytest.raises(farmap.FarmapError):
        s.write_chunk(0, bytes(4 * KIB))


@pytest.mark.parametrize(
    "bad",
    ["", "memory", "nosuch:thing", "memory:12XB", "memory:64KiB?chunk=3KiB", "memory:1PiB"],
)
def test_bad_specs_raise_spec_error(bad):
    with pytest.raises(farmap.SpecError) as e:
        farmap.open_store(bad)
    assert isinstance(e.value, ValueError)
    assert isinstance(e.value, farmap.FarmapError)
    assert str(e.value)  # a message, not an empty exception


def test_a_missing_file_without_a_size_is_not_found(tmp_path):
    with pytest.raises(farmap.NotFoundError) as e:
        farmap.open_store(f"file:{tmp_path}/absent.img")
    assert isinstance(e.value, FileNotFoundError)
    assert "absent.img" in str(e.value)
    assert not (tmp_path / "absent.img").exists()


def test_out_of_range_and_wrong_lengths_raise_and_change_nothing(spec):
    with farmap.open_store(spec) as s:
        s.write(0, pattern(s.size, seed=5))
        before = s.read(0, s.size)
        for i in (-1, s.chunk_count, 1 << 62):
            with pytest.raises(farmap.OutOfRangeError) as e:
                s.read_chunk(i)
            assert isinstance(e.value, IndexError)
            with pytest.raises(farmap.OutOfRangeError):
                s.write_chunk(i, bytes(s.chunk_size))
        with pytest.raises(farmap.OutOfRangeError):
            s.read(s.size - 1, 2)
        with pytest.raises(farmap.OutOfRangeError):
            s.read(-1, 1)
        with pytest.raises(farmap.OutOfRangeError):
            s.read(0, -1)
        # A write that starts inside but ends outside writes nothing at all.
        with pytest.raises(farmap.OutOfRangeError):
            s.write(s.size - 10, b"\xff" * 20)
        for n in (0, s.chunk_size - 1, s.chunk_size + 1):
            with pytest.raises(farmap.InvalidInputError) as e:
                s.write_chunk(3, b"\xff" * n)
            assert isinstance(e.value, ValueError)
        assert s.read(0, s.size) == before


def test_typed_errors_form_one_hierarchy():
    for name in [
        "SpecError", "InvalidInputError", "OutOfRangeError", "NotFoundError",
        "PermissionDeniedError", "UnsupportedError", "StoreTimeoutError", "UnavailableError",
        "CorruptError", "ClosedError", "BusyError", "MountError", "MigrationError", "StoreIOError",
    ]:
        cls = getattr(farmap, name)
        assert issubclass(cls, farmap.FarmapError), name
        assert cls.__module__ == "farmap"
    assert issubclass(farmap.FarmapError, Exception)
    assert issubclass(farmap.OutOfRangeError, IndexError)
    assert issubclass(farmap.PermissionDeniedError, PermissionError)
    assert issubclass(farmap.StoreIOError, OSError)


def test_a_read_only_file_store_refuses_writes(tmp_path):
    path = tmp_path / "disk.img"
    with farmap.open_store(f"file:{path}?size=64KiB&chunk=4KiB") as s:
        s.write(0, b"keep")
    with farmap.open_store(f"file:{path}?ro") as s:
        assert s.read(0, 4) == b"keep"
        with pytest.raises(farmap.PermissionDeniedError):
            s.write(0, b"lost")
        assert s.read(0, 4) == b"keep"
    assert os.path.getsize(path) == 64 * KIB
