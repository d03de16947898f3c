"""Names of a package face loaded on first use (PEP 562 module ``__getattr__``).

A face lists ``{name: module}``; the name is imported from its module the first time it is
read, then cached in the face's namespace. ``import treadle`` thus loads no HTTP client and no
test kit until one is used (docs/design.md, "Start-up").
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(face: str, modules: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for package ``face`` serving ``modules`` (name -> module).

    Raises (from the returned function):
        AttributeError: ``face`` has no such name.
    """

    def __getattr__(name: str) -> Any:
        module = modules.get(name)
        if module is None:
            raise AttributeError(f"module {face!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[face], name, value)
        return value

    return __getattr__
