"""cloudpickle that keeps the file names of the code it sends by value, and ships its source.

From cloudpickle 3.1.3 on, every code object pickled by value (a function of ``__main__``, of a
notebook cell) arrives named ``<dynamic-code>``, so that the same function pickles to the same
bytes wherever it was defined.  A rank's traceback then names no file, and neither the rank nor
the driver can show the lines that raised.  ``dumps`` pickles as cloudpickle does, but gives each
such code object its own file name back when it is loaded (``cloudpickle.loads`` and
``pickle.loads`` read it).

The file may not be there where the code is loaded: a notebook cell's "file" exists only in the
kernel's ``linecache``, a script may live on another host than its ranks.  So each code object
also carries its own lines of source, as the pickling process's ``linecache`` has them, and
loading it puts them into the loading process's ``linecache`` unless that process reads the same
lines from the file itself: a rank's traceback shows them like any other.
"""

from __future__ import annotations

import functools
import io
import linecache
import types
from collections import ChainMap
from collections.abc import Callable
from typing import Any

import cloudpickle

_cloudpickle_code = cloudpickle.Pickler.dispatch_table[types.CodeType]
MAX_SOURCE_LINES = 5000  # lines of one code object shipped with it, at most

Source = dict[int, str]  # line number → its text (with its newline), as the pickling side had it


def _named(
    make: Callable[..., types.CodeType], args: tuple[Any, ...], filename: str, source: Source | None = None
) -> types.CodeType:
    if source:
        register_source(filename, source)
    return make(*args).replace(co_filename=filename)


def _span(code: types.CodeType) -> range:
    last = max((line for _, _, line in code.co_lines() if line is not None), default=code.co_firstlineno)
    return range(code.co_firstlineno, min(last, code.co_firstlineno + MAX_SOURCE_LINES - 1) + 1)


def _reduce_code(
    shipped: set[tuple[str, int]], code: types.CodeType
) -> tuple[Callable[..., types.CodeType], tuple[Any, ...]]:
    """cloudpickle's reduction of ``code``, with its file name and its lines of source but those
    ``shipped`` in the same pickle already (an enclosing function's)."""
    make, args = _cloudpickle_code(code)
    filename = code.co_filename
    lines = linecache.getlines(filename)
    source = {n: lines[n - 1] for n in _span(code) if n <= len(lines) and (filename, n) not in shipped}
    shipped.update((filename, n) for n in source)
    return _named, (make, args, filename, source or None)


class _Pickler(cloudpickle.Pickler):  # type: ignore[misc]  # cloudpickle ships no types (an Any base)
    def __init__(self, file: io.BytesIO, protocol: int):
        # read by the C pickler when it is initialised: set first.  (No reference back to the
        # pickler: a cycle would keep it and its buffer until the garbage collector runs.)
        reduce_code = functools.partial(_reduce_code, set())
        self.dispatch_table = ChainMap({types.CodeType: reduce_code}, cloudpickle.Pickler.dispatch_table)
        super().__init__(file, protocol=protocol)


def dumps(obj: Any, protocol: int = 5) -> bytes:
    """``cloudpickle.dumps(obj)``, code objects keeping their ``co_filename`` and their source."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=protocol).dump(obj)
    return buf.getvalue()


def register_source(filename: str, source: Source) -> None:
    """Make ``linecache`` (tracebacks, pdb) show ``source`` for those lines of ``filename``,
    unless it reads them from the file already.  Lines of the same file registered before stay
    (each function of a script brings its own)."""
    if all(linecache.getline(filename, n) == text for n, text in source.items()):
        return
    entry = linecache.cache.get(filename)
    # lines registered rather than read from a file (mtime None): ours, or the notebook's cells
    lines = list(entry[2]) if entry is not None and len(entry) == 4 and entry[1] is None else []
    top = max(source)
    lines += ["\n"] * (top - len(lines))
    for n, text in source.items():
        lines[n - 1] = text if text.endswith("\n") else text + "\n"
    linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)


__all__ = ["dumps", "register_source"]
