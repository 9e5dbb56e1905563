"""Programs that run inside the code sandbox, shipped as package data.

They are plain Python 3 for the sandbox's system interpreter (standard library
only) and are never imported here: `source(name)` reads one as text so it can
travel in an `ExecRequest` (as the main program or as an extra file; the
sandbox's working directory is on `sys.path`, so they import each other by
module name).
"""

from __future__ import annotations

import functools
import importlib.resources

COMMON = "harness_common.py"
CODEC = "harness_codec.py"
STDIO_RUNNER = "stdio_runner.py"
FUNCTION_DRIVER = "function_driver.py"
ORACLE = "oracle.py"
GENERATOR_BOOTSTRAP = "generator_bootstrap.py"


@functools.cache
def source(name: str) -> str:
  """The text of the harness program `name` (one of the constants above)."""
  return importlib.resources.files(__name__).joinpath(name).read_text("utf-8")
