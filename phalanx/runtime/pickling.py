"""cloudpickle that keeps the file names of the code it sends by value.

From cloudpickle 3.1.3 on, every code object pickled by value (a function of ``__main__``, of a
notebook cell) arrives named ``<dynamic-code>``, so that the same function pickles to the same
bytes wherever it was defined.  A rank's traceback then names no file, and neither the rank nor
the driver can show the lines that raised.  ``dumps`` pickles as cloudpickle does, but gives each
such code object its own file name back when it is loaded (``cloudpickle.loads`` reads it).
"""

from __future__ import annotations

import io
import types
from collections import ChainMap
from collections.abc import Callable
from typing import Any

import cloudpickle

_cloudpickle_code = cloudpickle.Pickler.dispatch_table[types.CodeType]


def _named(make: Callable[..., types.CodeType], args: tuple[Any, ...], filename: str) -> types.CodeType:
    return make(*args).replace(co_filename=filename)


def _reduce_code(code: types.CodeType) -> tuple[Callable[..., types.CodeType], tuple[Any, ...]]:
    make, args = _cloudpickle_code(code)
    return _named, (make, args, code.co_filename)


class _Pickler(cloudpickle.Pickler):  # type: ignore[misc]  # cloudpickle ships no types (an Any base)
    dispatch_table = ChainMap({types.CodeType: _reduce_code}, cloudpickle.Pickler.dispatch_table)


def dumps(obj: Any, protocol: int = 5) -> bytes:
    """``cloudpickle.dumps(obj)``, code objects keeping their ``co_filename``."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=protocol).dump(obj)
    return buf.getvalue()


__all__ = ["dumps"]
