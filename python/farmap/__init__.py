"""farmap: make a Linux memory region live in a store.

A store holds a region's bytes in chunks: ``memory:64MiB``, ``file:./disk.img?size=1GiB``,
``dir:./chunks?size=1GiB&chunk=1MiB``, ``redis://...``, ``s3://...``, ``farmap://host:port``
(the spec reference is docs/store-specs.md). From Python:

- :func:`open_store` opens one by spec: chunks and byte ranges.
- :func:`open_region` maps a userfaultfd region over one: its memory is a writable buffer
  (``memoryview(region)``, ``numpy.frombuffer(region, dtype=...)``) that fetches chunks on
  first touch; :meth:`Region.sync` writes changes back.
- :func:`mount` serves one as a file on a FUSE mount; :meth:`Mount.unmount` ends it.
- :meth:`Region.seed` and :func:`leech` migrate a live region.

Every call that waits releases the GIL. Errors are :class:`FarmapError` subclasses, each also
the built-in exception a caller would expect (:class:`SpecError` is a ``ValueError``,
:class:`OutOfRangeError` an ``IndexError``, ...). See docs/python.md.
"""

from farmap._native import (
    DEFAULT_CHUNK_SIZE,
    BusyError,
    ClosedError,
    CorruptError,
    FarmapError,
    InvalidInputError,
    MigrationError,
    Mount,
    MountError,
    NotFoundError,
    OutOfRangeError,
    PermissionDeniedError,
    Region,
    Seeding,
    SpecError,
    Store,
    StoreIOError,
    StoreTimeoutError,
    UnavailableError,
    UnsupportedError,
    leech,
    mount,
    open_region,
    open_store,
    userfaultfd_support,
)

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "BusyError",
    "ClosedError",
    "CorruptError",
    "FarmapError",
    "InvalidInputError",
    "MigrationError",
    "Mount",
    "MountError",
    "NotFoundError",
    "OutOfRangeError",
    "PermissionDeniedError",
    "Region",
    "Seeding",
    "SpecError",
    "Store",
    "StoreIOError",
    "StoreTimeoutError",
    "UnavailableError",
    "UnsupportedError",
    "leech",
    "mount",
    "open_region",
    "open_store",
    "userfaultfd_support",
]
