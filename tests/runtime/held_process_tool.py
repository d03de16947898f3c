"""A process tool whose calls cannot begin: imported while ``TREADLE_TEST_HOLD_IMPORT`` names a
file that does not exist, this module waits for that file before it is loaded.

tests/runtime/test_stubborn_tools.py imports it first without that variable, then sets it for
the child process that imports it again.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import treadle

_HOLD = os.environ.get("TREADLE_TEST_HOLD_IMPORT")
while _HOLD and not Path(_HOLD).exists():
    time.sleep(0.05)


@treadle.tool(isolation="process", timeout_s=2)
def held(n: int) -> int:
    """``n``, once this module is loaded."""
    return n
