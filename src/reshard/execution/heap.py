"""Give the staging memory of a finished run back to the operating system.

A refit frees its staging arena at the end of each phase. glibc's allocator keeps freed heap
space for reuse, and after a large block is freed it raises its mmap threshold (up to 32 MiB),
so later arenas below it come from the heap. Executors built afresh for every refit then see the
process's resident memory climb by tens of MiB over a hundred refits although nothing is live
(``benchmarks/bench_soak.py`` measured 73-160 MiB). :func:`return_free_heap` asks glibc to
release free heap pages (``malloc_trim(0)``, about a millisecond here) after each run; on other
C libraries it does nothing.

>>> return_free_heap() in (True, False)
True
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def return_free_heap() -> bool:
    """Release the C heap's free pages to the OS; True if the C library could (glibc)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


__all__ = ["return_free_heap"]
