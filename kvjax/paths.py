"""Where kvjax keeps its files: one cache folder for downloaded models and built kernels.

A leaf module: the registry (models) and the backend switch (native kernels)
both need the folder, and neither may import the other.
"""

from __future__ import annotations

import os
import pathlib

import platformdirs

CACHE_ENV = "KVJAX_CACHE_DIR"


def cache_dir(override: str | os.PathLike | None = None) -> pathlib.Path:
  """kvjax's cache folder: ``override``, else ``$KVJAX_CACHE_DIR``, else the user cache.

  Nothing is created here: whoever writes into the folder makes it, and must
  expect it to be unwritable.
  """
  if override is None:
    override = os.environ.get(CACHE_ENV) or platformdirs.user_cache_dir("kvjax")
  return pathlib.Path(override)
