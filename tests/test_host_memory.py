"""kvjax.host_memory and kvjax.runtime: process-wide settings only where a process opts in.

The library changes nothing process-wide; ``kvjax.runtime.setup()`` (what the
command-line tools and benchmarks call) sets glibc's allocator and generate's
XLA:CPU compiler options.
"""

import ast
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="glibc and /proc (Linux)")

# What changes the host process: allocator calls, forced collection, page advice.
PROCESS_CALLS = {"malloc_trim", "mallopt", "madvise", "map_large_blocks", "single_arena"}
# The modules allowed to name them: the glibc wrappers and the opt-in set-up.
ALLOWED = {ROOT / "kvjax" / "host_memory.py", ROOT / "kvjax" / "runtime.py"}


def _library_files():
  files = [*(ROOT / "kvjax").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")]
  return [f for f in files if "__pycache__" not in f.parts]


def _process_tweaks(path: pathlib.Path) -> list[str]:
  """Where ``path`` names a process-wide call, or sets an XLA option or flag."""
  found = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    name = (node.attr if isinstance(node, ast.Attribute)
            else node.id if isinstance(node, ast.Name) else None)
    if name in PROCESS_CALLS:
      found.append(f"{path.name}:{node.lineno} {name}")
    if (isinstance(node, ast.Attribute) and node.attr == "collect"
        and isinstance(node.value, ast.Name) and node.value.id == "gc"):
      found.append(f"{path.name}:{node.lineno} gc.collect")
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and (
        node.value == "XLA_FLAGS" or node.value.startswith(("xla_", "--xla_"))):
      found.append(f"{path.name}:{node.lineno} {node.value}")
  return found


def test_only_the_runtime_setup_changes_the_process():
  found = {str(f.relative_to(ROOT)): _process_tweaks(f) for f in _library_files()
           if f not in ALLOWED}
  assert {f: calls for f, calls in found.items() if calls} == {}
  # The scan sees them where they are.
  assert _process_tweaks(ROOT / "kvjax" / "runtime.py")


# A fresh interpreter: generate on a tiny random model with every glibc call and
# forced collection raising, then what it left of generate's compiler options.
_PLAIN_GENERATE = """
import gc, json
from kvjax import host_memory

class NoCalls:
  def __getattr__(self, name):
    raise AssertionError(f"the library called libc's {name}")

def no_collect(*args):
  raise AssertionError("the library forced a garbage collection")

host_memory._libc = lambda: NoCalls()
gc.collect = no_collect

import kvjax
config = kvjax.LlamaConfig(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=8, intermediate_size=64,
                           max_position_embeddings=128)
lm = kvjax.init_random(config, seed=0)
for policy, budget in (("full", None), (kvjax.policies.get("snapkv", window=8), 24)):
  result = kvjax.generate(lm, [list(range(1, 40))], policy=policy, budget=budget,
                          max_new_tokens=3, stop_ids=[])
  assert len(result.token_ids[0]) == 3
from kvjax.generation import compile as compile_lib
print(json.dumps(compile_lib.cpu_compiler_options))
"""


def _python(code: str, *args: str) -> str:
  done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                        cwd=ROOT, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stdout.strip().splitlines()[-1]


def test_plain_generate_changes_no_process_wide_state():
  assert json.loads(_python(_PLAIN_GENERATE)) == {}


_SETUP = """
import json
from kvjax import runtime
first = runtime.setup()
assert runtime.setup() == first  # again: the same values
from kvjax.generation import compile as compile_lib
print(json.dumps({"applied": first, "options": compile_lib.cpu_compiler_options}))
"""


@linux_only
def test_runtime_setup_sets_the_allocator_and_generates_compiler_options():
  out = json.loads(_python(_SETUP))
  assert out["applied"] == {"mmap_threshold": True, "single_arena": True,
                            "cpu_compiler_options": True}
  lean = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}
  assert out["options"] == {"*": {"xla_cpu_use_fusion_emitters": False},
                            "prefill_chunk": lean, "decode": lean}


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


@linux_only
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


@linux_only
def test_single_arena_keeps_every_thread_on_the_main_heap():
  assert _arenas("default") > 1  # glibc's default: the threads' arenas of their own
  assert _arenas("single") == 1


@pytest.mark.parametrize("env,calls", [("1", 1), ("0", 0)])
def test_the_tools_set_up_the_process_unless_told_not_to(monkeypatch, env, calls):
  from kvjax import cli, runtime  # pylint: disable=g-import-not-at-top
  made = []
  monkeypatch.setenv(cli.RUNTIME_SETUP_ENV, env)
  monkeypatch.setattr(runtime, "setup", lambda: made.append(True))
  monkeypatch.setattr(sys, "argv", ["tool"])
  with pytest.raises(SystemExit):
    cli.run(lambda argv: sys.exit(0))
  assert len(made) == calls
