"""The CPU ranks' allocator setting: glibc's malloc told to keep the memory a step frees, so that the
next step's buffers of the same sizes reuse it instead of faulting fresh pages in.

By default glibc serves a large block (above a threshold that starts at 128 KiB) with its own mmap
and returns it to the OS when freed, and trims the heap's free top beyond 128 KiB: a step that
gathers a layer's parameters into a new flat buffer, frees it and gathers the next then touches
fresh pages every time (measured: ZeRO-3 of benchmarks/bench_cpu_plans.py, rank 0 alone on torch's
fake process group, 7,500 minor page faults a step, about 30 MB, at 2.2 us a fault on this VM; with
the setting below, 34-224 faults and 98-100 ms of CPU a step against 109-113). PyTorch's CPU
performance guide makes the same point with jemalloc or tcmalloc preloaded; this is the setting that
needs no other library. `autopar calibrate` applies it on its CPU ranks and benchmarks/
bench_cpu_plans.py on its training ranks, so calibration and the runs it prices see the same
machine; a user's CPU ranks apply it by calling `keep_freed_memory()` first thing.

What it costs: a rank's resident memory stays at its high-water mark (freed blocks are kept for
reuse), as with a caching allocator; torch's allocated bytes, which the memory model prices, are
unchanged."""
from __future__ import annotations

import ctypes
import ctypes.util

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
# the largest mmap threshold glibc accepts on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX, 4 MiB x sizeof(long)):
# blocks up to 32 MiB come from the heap and are reused; larger ones are still mapped and unmapped
MMAP_THRESHOLD_MAX = 32 * 2 ** 20
# the heap's free top is never given back within a run (the largest value mallopt's int takes)
TRIM_THRESHOLD_KEEP = 2 ** 31 - 1


def keep_freed_memory() -> bool:
    """Tell this process's glibc malloc to keep freed blocks up to MMAP_THRESHOLD_MAX for reuse (no
    mmap per block, no trimming). True where set; False where the C library is not glibc (no
    `mallopt`: musl, macOS), which leaves the allocator as it was."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None or not hasattr(libc, "gnu_get_libc_version"):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_KEEP))
