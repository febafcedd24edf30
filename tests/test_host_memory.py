"""Tests for kvjax.host_memory: pages leave the resident set, data stays what it was."""

import subprocess
import sys

import numpy as np
import pytest

from kvjax import host_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc/self/smaps (Linux)")


def _resident_kib(path: str) -> int:
  """KiB of ``path``'s mappings resident in this process (/proc/self/smaps)."""
  total, inside = 0, False
  with open("/proc/self/smaps") as f:
    for line in f:
      fields = line.split()
      if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header
        inside = fields[-1] == path
      elif inside and fields[0] == "Rss:":
        total += int(fields[1])
  return total


def test_a_read_map_leaves_the_resident_set_and_reads_back_the_same(tmp_path):
  path = str(tmp_path / "weights.bin")
  data = np.random.default_rng(0).integers(0, 255, 8 << 20, dtype=np.uint8)
  data.tofile(path)
  file_map = np.memmap(path, mode="r")
  copy = np.array(file_map[1000:])  # reads every page
  assert _resident_kib(path) >= 8 * 1024 - 8
  host_memory.drop_file_pages(file_map[1000:], file_map)
  assert _resident_kib(path) <= 8  # at most a few pages (the kernel may map around)
  np.testing.assert_array_equal(file_map[1000:], copy)  # faulted back in from the file
  np.testing.assert_array_equal(file_map, data)


def test_a_view_outside_the_map_is_left_alone(tmp_path):
  path = str(tmp_path / "weights.bin")
  np.arange(1 << 16, dtype=np.uint8).tofile(path)
  file_map = np.memmap(path, mode="r")
  heap = np.random.default_rng(1).random(1 << 20)  # anonymous memory: dropping would zero it
  before = heap.copy()
  host_memory.drop_file_pages(heap, file_map)
  np.testing.assert_array_equal(heap, before)


def test_return_freed_memory_keeps_live_data():
  live = np.random.default_rng(2).random(1 << 20)
  before = live.copy()
  garbage = [np.ones(1 << 18) for _ in range(16)]
  del garbage
  host_memory.return_freed_memory()
  np.testing.assert_array_equal(live, before)



# Run in a fresh interpreter: in a process with free heap (a test worker after
# other tests), malloc serves a large block from that, whatever the threshold.
_LARGE_BLOCK_CHECK = """
import numpy as np
from kvjax import host_memory

def anonymous_kib():
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))

assert host_memory.map_large_blocks(1 << 20)
np.ones(3 << 20).sum()  # a 24 MiB free: glibc alone would now keep blocks up to 24 MiB
before = anonymous_kib()
block = np.ones(16 << 20, np.uint8)  # touched: 16 MiB resident
after = [np.ones(1000) for _ in range(100)]  # so the block is not the heap's top
grown = anonymous_kib() - before
del block  # no trim: its own pages go back with it
print(grown, anonymous_kib() - before, len(after))
"""


def test_a_large_block_goes_back_to_the_system_when_freed():
  out = subprocess.run([sys.executable, "-c", _LARGE_BLOCK_CHECK], capture_output=True,
                       text=True, check=True).stdout.split()
  grown, kept = int(out[0]), int(out[1])
  assert grown >= 15 * 1024
  # Without map_large_blocks the block stayed: 16.7 MiB measured.
  assert kept <= 2 * 1024


# Threads that allocate at the same time (ctypes calls release the GIL), then
# the number of heap arenas glibc reports (malloc_info). A fresh interpreter:
# a test worker's threads may already have arenas of their own.
_ARENA_CHECK = """
import ctypes, os, sys, tempfile, threading
from kvjax import host_memory

if sys.argv[1] == "single":
  assert host_memory.single_arena()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.fopen.restype = ctypes.c_void_p
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]

def allocate():
  for _ in range(2000):
    libc.free(libc.malloc(4096))

threads = [threading.Thread(target=allocate) for _ in range(4)]
for t in threads:
  t.start()
for t in threads:
  t.join()
path = os.path.join(tempfile.mkdtemp(), "malloc_info.xml")
f = libc.fopen(path.encode(), b"w")
libc.malloc_info(0, f)
libc.fclose(f)
print(open(path).read().count("<heap nr="))
"""


def _arenas(mode: str) -> int:
  return int(subprocess.run([sys.executable, "-c", _ARENA_CHECK, mode], capture_output=True,
                            text=True, check=True).stdout)


def test_single_arena_keeps_every_thread_on_the_main_heap():
  assert _arenas("default") > 1  # glibc's default: the threads' arenas of their own
  assert _arenas("single") == 1
