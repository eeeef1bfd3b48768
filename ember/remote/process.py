"""What a peer process asks of its operating system: that malloc keep freed memory for the next
tensors and hand it back once the buffer pool let it go (glibc's arenas), and as many open files
as it may have (each connection costs the peer a file). ``ember serve`` and :class:`~ember.remote.server.Server`
call these at start and as the pool lets buffers go.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger("ember.serve")

# glibc's malloc options (malloc.h), and the values its own dynamic thresholds stop at on 64-bit
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
KEEP_FREED_BYTES = 64 << 20  # free memory an arena keeps on top before it hands it back to the kernel
MMAP_BYTES = 32 << 20        # allocations this large and above get their own mapping


def keep_freed_memory() -> bool:
    """Have this process's malloc keep freed memory for the next tensors; a peer process calls it
    at start (``ember serve``). True where it took (glibc), False elsewhere.

    Each session runs on its own thread, so glibc gives it its own arena, and an arena hands the
    free memory on top of its heap back to the kernel (``madvise(MADV_DONTNEED)``) once it passes
    a threshold that glibc adjusts as it goes. Whether an eager chain's freed 4 MB arrays sit
    there depends on the order of earlier allocations: in some runs of ``ember bench remote``
    the peer gave back and faulted in again about 23 MB per chain of 100 ops on 1M float32
    (5,766 page faults, 1.5× the chain's time). Fixed thresholds, the largest glibc's own
    adjustment reaches, keep up to 64 MiB an arena for reuse."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # the mapping threshold first: setting either turns glibc's adjustment of both off
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, KEEP_FREED_BYTES))


def return_freed_memory() -> bool:
    """Hand the free pages of every malloc arena back to the kernel (glibc's ``malloc_trim``): after
    the buffer pool let idle buffers go, which :func:`keep_freed_memory` would otherwise keep in
    the process. True where it ran (glibc), False elsewhere."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = (ctypes.c_size_t,), ctypes.c_int
    trim(0)
    return True


def raise_file_limit() -> tuple[int, int] | None:
    """Raise this process's soft limit of open files to its hard limit (each connection costs the
    peer a file; a soft limit of 1,024 is common, the hard one often far higher). The soft limit
    before and after, or None where the platform has no such limits; logged at debug level."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # an unlimited hard limit (macOS) is not a number setrlimit takes: the kernel's own cap there is 10,240 by default
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 10240)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        log.debug("open files: the soft limit is %s already (hard limit %s)", soft, hard)
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    except (OSError, ValueError) as error:
        log.debug("open files: could not raise the soft limit %d to %d: %s", soft, wanted, error)
        return soft, soft
    log.debug("open files: raised the soft limit from %d to %d (the hard limit)", soft, wanted)
    return soft, wanted
