"""What the command-line tools share: their --help, errors on one line, quiet logs.

Used by ``kvjax.eval``, ``kvjax.bench`` and ``kvjax.main`` (the library itself
never imports it). Every tool runs through ``run``, which answers:

  --help, -h           the tool's own flags, grouped, with defaults; exit 0
                       (--helpfull: absl's listing, its own flags included)
  a bad flag or input  one line ``error: ...`` on stderr; exit 2
  Ctrl-C               one line ``interrupted...``; exit 130
  anything else        one line ``error: internal error: <type>: ...``; exit 1
                       (KVJAX_TRACEBACK=1 in the environment re-raises it, with
                       its traceback)

Bad input is what a user can fix: ``ValueError`` (kvjax's errors for bad
models, datasets, policies and budgets are ValueErrors), ``OSError`` (a file
that is missing, unreadable or unwritable, a full disk), ``MemoryError`` and
``NativeUnavailable`` (``--backend=native`` without a compiler).
"""

from __future__ import annotations

import logging
import os
import pathlib
import sys
import tempfile
import textwrap
from typing import Callable, NoReturn, Sequence

from absl import app
from absl import flags

from kvjax import backend
from kvjax import runtime

# "0" skips kvjax.runtime.setup() in the tools.
RUNTIME_SETUP_ENV = "KVJAX_RUNTIME_SETUP"
# "1" lets an unexpected exception end the tool with its traceback.
TRACEBACK_ENV = "KVJAX_TRACEBACK"
# What a tool's --help lists: (group title, flag names) in order.
HelpGroups = Sequence[tuple[str, Sequence[str]]]

_HELP_ARGS = ("-h", "-help", "--help", "-?", "--helpshort", "-helpshort")
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C


class UsageError(Exception):
  """A bad flag or input: printed on one line, exit code 2."""


def one_line(message: object) -> str:
  """``message`` with its line breaks and runs of spaces as single spaces."""
  return " ".join(str(message).split())


def _close_progress_bars() -> None:
  """Closes the tqdm bars still open, so that a message starts a line of its own.

  A bar left open by an exception ends without a newline: what is printed
  next would land on the bar's line.
  """
  tqdm = sys.modules.get("tqdm")
  for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
    bar.close()


def fail(message: object) -> NoReturn:
  """Prints ``error: message`` (on one line) on stderr and exits with code 2 (a usage error)."""
  _close_progress_bars()
  print(f"error: {one_line(message)}", file=sys.stderr)
  sys.exit(EXIT_USAGE)


def interrupted(message: str = "interrupted") -> NoReturn:
  """Prints ``message`` on stderr and exits with code 130 (ended by Ctrl-C)."""
  _close_progress_bars()
  print(one_line(message), file=sys.stderr)
  sys.exit(EXIT_INTERRUPTED)


def quiet_logs() -> None:
  """absl shows INFO logs; JAX's, matplotlib's and orbax's (through absl's, a dozen
  lines per checkpoint read: the duo policy's gates) are noise on a command line."""
  for noisy in ("jax", "matplotlib", "absl"):
    logging.getLogger(noisy).setLevel(logging.WARNING)


def check_out_folder(out: str | os.PathLike, flag: str = "--out") -> pathlib.Path:
  """Makes the output folder and writes (then removes) a probe file in it.

  Called before any work, so a folder that cannot take the results (a file of
  that name, a read-only disk, no permission) fails in one line at once
  instead of after the run. Raises UsageError.
  """
  path = pathlib.Path(out).expanduser()
  if path.exists() and not path.is_dir():
    raise UsageError(f"{flag} {path} is a file, not a folder")
  try:
    path.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path, prefix=".write-probe-"):
      pass
  except OSError as e:
    raise UsageError(f"{flag} {path} is not writable: {e.strerror or e}") from None
  return path


def check_backend(name: str) -> None:
  """Refuses (UsageError) a ``--backend`` that cannot run here, before any work.

  "native" without a C++ compiler (or off the CPU), "pallas" where it does not
  lower: the reason on one line. "auto" always runs (it falls back to XLA).
  """
  if name == "auto":
    return
  try:
    backend.resolve(name)
  except (backend.NativeUnavailable, ValueError) as e:
    raise UsageError(f"--backend={name}: {e}") from None


# ------------------------------------------------------------------- help

def _flag_usage(flag) -> str:
  if flag.flag_type() == "bool":
    return f"--[no]{flag.name}"
  values = getattr(flag.parser, "enum_values", None)
  kind = "|".join(values) if values else flag.flag_type().replace(
      "comma separated list of strings", "a,b,...")
  return f"--{flag.name}=<{kind}>"


def _flag_help(flag) -> str:
  text = flag.help
  if text.startswith("<") and ">: " in text:  # absl prefixes an enum's values (shown already)
    text = text.split(">: ", 1)[1]
  text = text.rstrip(".") + "."
  default = flag.default
  if default is None or default == "" or default == []:
    return text
  if isinstance(default, bool):
    default = str(default).lower()
  elif isinstance(default, (list, tuple)):
    default = ",".join(map(str, default))
  return f"{text} Default: {default}"


def _module_flags(module_name: str) -> list:
  """The flags ``module_name`` defined (absl keys a script run as __main__ by its path)."""
  by_module = flags.FLAGS.flags_by_module_dict()
  return list(by_module.get(module_name) or by_module.get(sys.argv[0]) or [])


def help_text(main: Callable, groups: HelpGroups = ()) -> str:
  """The tool's --help: its docstring, then its flags by group (others last)."""
  module = sys.modules.get(main.__module__)
  doc = (module.__doc__ or "").strip() if module else ""
  lines = [doc, ""] if doc else []
  own = {f.name: f for f in _module_flags(main.__module__)
         if not f.help.startswith("Internal:")}
  listed = [name for _, names in groups for name in names]
  rest = [name for name in own if name not in listed]
  for title, names in [*groups, *([("other", rest)] if rest else [])]:
    lines.append(f"{title}:")
    for name in names:
      flag = flags.FLAGS[name]
      lines.append(f"  {_flag_usage(flag)}")
      lines += textwrap.wrap(_flag_help(flag), 88, initial_indent=" " * 6,
                             subsequent_indent=" " * 6, break_long_words=False,
                             break_on_hyphens=False)
    lines.append("")
  lines.append("--helpfull also lists absl's own flags (logging, debugging).")
  return "\n".join(lines)


def _asks_for_help(args: Sequence[str]) -> bool:
  return any(a in _HELP_ARGS for a in args)


# ------------------------------------------------------------------- running

def _parse_flags(argv):
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    fail(str(e))


def call(main: Callable, argv: Sequence[str]) -> None:
  """Runs ``main(argv)`` (flags already parsed), answering its errors as the module says.

  Exits with 2 (bad input), 130 (Ctrl-C) or 1 (an unexpected exception; with
  KVJAX_TRACEBACK=1 it is raised instead).
  """
  try:
    main(argv)
  except KeyboardInterrupt:
    interrupted()
  except UsageError as e:
    fail(e)
  except backend.NativeUnavailable as e:
    fail(e)
  except MemoryError as e:
    fail(f"out of memory (MemoryError{': ' + str(e) if str(e) else ''}); "
         "try smaller lengths, batch or model")
  except (ValueError, OSError) as e:
    fail(e)
  except Exception as e:  # pylint: disable=broad-except
    if os.environ.get(TRACEBACK_ENV) == "1":
      raise
    _close_progress_bars()
    print(f"error: internal error: {type(e).__name__}: {one_line(e)} "
          f"({TRACEBACK_ENV}=1 shows the traceback)", file=sys.stderr)
    sys.exit(1)


def run(main: Callable, help_groups: HelpGroups = ()) -> None:
  """The tool's process: --help, set-up, flags parsed, ``main`` run through ``call``.

  The tool's process is set up first (``kvjax.runtime.setup``): its peak
  memory is what it holds. ``KVJAX_RUNTIME_SETUP=0`` in the environment leaves
  the process as it is (to measure what the setup changes; the bench's
  child processes inherit it). A bad flag is reported by ``fail``, not with a
  usage dump.

  Args:
    main: the tool's main(argv).
    help_groups: how --help groups the tool's flags; flags of main's module
      left out are listed under "other".
  """
  if _asks_for_help(sys.argv[1:]):
    print(help_text(main, help_groups))
    sys.exit(0)
  if os.environ.get(RUNTIME_SETUP_ENV, "1") != "0":
    runtime.setup()
  try:
    app.run(lambda argv: call(main, argv), flags_parser=_parse_flags)
  except KeyboardInterrupt:  # during flag parsing or absl's own set-up
    interrupted()
