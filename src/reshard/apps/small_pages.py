"""Let numpy's arrays take small memory pages while a planning command runs.

numpy asks Linux for transparent huge pages (``madvise``) for every array of 4 MB or more. The
planner allocates and frees many arrays of tens of megabytes, so it keeps touching fresh memory;
on a virtual machine whose host backs the guest's memory in small pages, a fresh 2 MB page costs
far more than 512 small ones. On the 2-core VM this project is developed on, writing 1 GiB of
fresh numpy arrays took 8-10 s with huge pages and 0.4 s without, and the largest ``reshard
simulate`` row spent 7.5 of its 10 s of pipelined-traffic modeling in the kernel.

``reshard plan`` and ``reshard simulate`` run inside :func:`small_pages`. numpy's own switch wins:
with ``NUMPY_MADVISE_HUGEPAGE`` set (``1`` keeps huge pages) nothing is changed. Worker processes
started inside inherit the setting through the environment; both are restored on leaving.

==========================  ==========================================
``NUMPY_MADVISE_HUGEPAGE``  inside ``with small_pages():``
==========================  ==========================================
unset                       small pages, here and in workers started
``0`` or ``1``              as numpy read it (left alone)
==========================  ==========================================
"""

from __future__ import annotations

import os
from contextlib import contextmanager

SWITCH = "NUMPY_MADVISE_HUGEPAGE"  # numpy reads it when imported


def _numpy_switch():
    try:
        from numpy._core import multiarray
    except ImportError:  # numpy 1.x
        from numpy.core import multiarray
    return multiarray._get_madvise_hugepage, multiarray._set_madvise_hugepage


@contextmanager
def small_pages():
    """numpy's huge-page advice off in this process and the processes it starts, unless
    ``NUMPY_MADVISE_HUGEPAGE`` says otherwise; as before on leaving (also on error)."""
    if SWITCH in os.environ:
        yield
        return
    get, set_ = _numpy_switch()
    before = get()
    os.environ[SWITCH] = "0"
    set_(False)  # numpy is imported already: set what its import set from the variable
    try:
        yield
    finally:
        set_(before)
        os.environ.pop(SWITCH, None)


__all__ = ["small_pages"]
