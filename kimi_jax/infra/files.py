"""Result files a killed run never leaves half-written."""

from __future__ import annotations

import json
import os
from typing import Any


def write_json(path: str, value: Any) -> None:
  """Writes `value` as indented JSON to `path` atomically (a temporary file
  beside it, then a rename), creating the directory if needed."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path + ".tmp", "w") as f:
    json.dump(value, f, indent=2)
  os.replace(path + ".tmp", path)
