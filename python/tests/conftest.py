"""What farmap's Python tests share: skipping only what this machine cannot run.

A test that cannot run here (no userfaultfd, no /dev/fuse, not root) is skipped with a line
``skipped: <why>`` on stderr; under CI=true it fails instead (CI's machine has everything).
"""

import os
import sys

import pytest

import farmap


def need(ok: bool, why: str) -> None:
    """Skips the calling test unless `ok` (fails it under CI=true)."""
    if ok:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and this cannot run: {why}")
    print(f"skipped: {why}", file=sys.stderr)
    pytest.skip(why)


def userfaultfd_reason():
    """None if regions can be opened here, else why not."""
    try:
        farmap.userfaultfd_support()
    except farmap.UnsupportedError as e:
        return str(e)
    return None


@pytest.fixture
def uffd():
    """Skips (or fails under CI) a test that needs userfaultfd regions."""
    why = userfaultfd_reason()
    need(why is None, f"userfaultfd regions: {why}")
