"""acrobat.memory: malloc keeps freed memory for the next mini-batch (config.HOLD_MEMORY)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import acrobat
from acrobat import config, memory

_PROBE = """
import ctypes, torch
from acrobat import memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks",
                "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

lib = memory._glibc()
lib.mallinfo2.restype = MallInfo2

def mmapped_after_alloc():
    before = lib.mallinfo2().hblks
    big = torch.empty(2 << 20)  # 8 MiB
    return lib.mallinfo2().hblks - before

print(mmapped_after_alloc(), memory.hold(), mmapped_after_alloc(), mmapped_after_alloc())
memory.release()
print(memory.held())
"""


def test_held_memory_serves_large_buffers_from_the_heap():
    """In a fresh process (malloc's state depends on its history): an 8 MiB buffer is an
    mmap of its own at first, and comes from the heap once memory is held."""
    lib = memory._glibc()
    if not lib or not hasattr(lib, "mallinfo2"):
        pytest.skip("needs glibc >= 2.33 (mallinfo2)")
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=True
    )
    first, second = done.stdout.split("\n")[:2]
    assert first.split() == ["1", "True", "0", "0"]
    assert second == "False"


def test_the_first_map_holds_memory_unless_switched_off():
    @acrobat.autobatch
    def double(x):
        return x * 2

    memory.release()
    with config.override(HOLD_MEMORY=False):
        double.map([torch.ones(2)])
    assert not memory.held()
    got = double.map([torch.ones(2), torch.zeros(2)])
    assert memory.held() == bool(memory._glibc())
    torch.testing.assert_close(torch.stack(got), torch.tensor([[2.0, 2.0], [0.0, 0.0]]))
