"""The CPU ranks' allocator setting (autopar/runtime/cpu_allocator.py): after `keep_freed_memory()`
a block freed and allocated again reuses its pages instead of faulting fresh ones in, as a step's
gather buffers are freed and made again every step."""
import pathlib
import subprocess
import sys

import pytest

MODULE = pathlib.Path(__file__).resolve().parents[1] / "autopar" / "runtime" / "cpu_allocator.py"

# in a fresh process (the setting is process-wide), without torch: the module alone, then an 8 MiB
# block written, freed, and written again; prints whether the setting took and the second's page faults
SCRIPT = """
import ctypes, importlib.util, resource, sys
spec = importlib.util.spec_from_file_location("cpu_allocator", sys.argv[1])
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
kept = mod.keep_freed_memory() if sys.argv[2] == "keep" else True
libc = ctypes.CDLL(None); libc.malloc.restype = ctypes.c_void_p; libc.free.argtypes = [ctypes.c_void_p]
n = 8 * 2 ** 20
def faults_writing_a_block():
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(n); ctypes.memset(p, 1, n); libc.free(p)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
faults_writing_a_block()
print(kept, faults_writing_a_block())
"""


def _second_block_faults(mode: str) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(MODULE), mode], capture_output=True, text=True,
                         check=True).stdout.split()
    return out[0] == "True", int(out[1])


def test_freed_blocks_are_reused_without_page_faults():
    kept, faults = _second_block_faults("keep")
    if not kept:
        pytest.skip("not glibc: keep_freed_memory() leaves the allocator as it is")
    pages = 8 * 2 ** 20 // 4096
    assert faults < pages // 20
    # glibc's default maps the second block afresh: the setting is what makes the difference
    assert _second_block_faults("default")[1] > pages // 2
