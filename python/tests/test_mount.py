"""FUSE mounts: a store as one file, written through the file, unmounted, data in the store.

Needs root and /dev/fuse (skipped with the reason otherwise; under CI=true it fails)."""

import os

import pytest

import farmap
from conftest import need

KIB = 1024


@pytest.fixture
def fuse():
    need(os.geteuid() == 0, "FUSE mounts: not root")
    need(os.path.exists("/dev/fuse"), "FUSE mounts: no /dev/fuse")


def test_mount_serves_the_store_as_a_file_and_unmount_flushes_it(tmp_path, fuse):
    spec = f"file:{tmp_path}/disk.img?size=1MiB&chunk=64KiB"
    with farmap.open_store(spec) as s:
        s.write(70_000, b"already there")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    m = farmap.mount(spec, mnt)
    try:
        assert m.mounted
        assert os.path.ismount(mnt)
        path = os.fspath(m.path)
        assert os.path.dirname(path) == os.fspath(mnt)
        assert os.path.getsize(path) == 1 << 20 == m.size
        fd = os.open(path, os.O_RDWR)
        try:
            assert os.pread(fd, 13, 70_000) == b"already there"
            assert os.pwrite(fd, b"through the mount", 200_000) == 17
        finally:
            os.close(fd)
        # A second mount at the same place is refused with a typed error.
        with pytest.raises(farmap.FarmapError):
            farmap.mount("memory:1MiB", mnt)
    finally:
        m.unmount()
    assert not m.mounted
    assert not os.path.ismount(mnt)
    m.unmount()  # twice: nothing
    with farmap.open_store(spec) as s:
        assert s.read(200_000, 17) == b"through the mount"
        assert s.read(70_000, 13) == b"already there"


def test_mount_arguments_are_checked(tmp_path, fuse):
    with pytest.raises(farmap.FarmapError):
        farmap.mount("memory:1MiB", tmp_path / "absent")
    (tmp_path / "mnt").mkdir()
    with pytest.raises(farmap.InvalidInputError):
        farmap.mount("memory:1MiB", tmp_path / "mnt", name="a/b")
    with pytest.raises(farmap.SpecError):
        farmap.mount("memory:much", tmp_path / "mnt")
    assert not os.path.ismount(tmp_path / "mnt")
