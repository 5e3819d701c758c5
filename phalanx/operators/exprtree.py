"""Arrow expressions read as trees, for the engines a rank's pipeline is rebuilt in
(``plan_polars`` for Polars, ``plan_sql`` for DuckDB).

Arrow expressions have no public walk of their tree, but their serialization (what ``pickle``
uses) is an Arrow IPC file whose schema metadata lists the tree in prefix order (``call`` /
``field_ref`` / ``literal`` / ``options`` / ``end``) and whose one row holds the literals and
the functions' options.  That is what is read here.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc


class Untranslatable(Exception):
    """The expression uses something an engine here does not rebuild (Acero runs it)."""


# ---- reading an Arrow expression's tree -----------------------------------------------------
@dataclass(frozen=True)
class Node:
    kind: str  # "call", "field", "literal"
    name: str = ""  # the function (call) or column (field)
    args: tuple[Node, ...] = ()
    value: Any = None  # a literal's pa.Scalar, or a call's options (a struct scalar or None)


def _metadata_pairs(schema_message: bytes) -> list[tuple[str, str]]:
    """The schema's custom metadata in order, duplicate keys kept (``Schema.metadata`` is a
    dict and loses them): a minimal flatbuffer walk of the IPC Schema message."""
    buf = memoryview(schema_message)
    # an IPC message: continuation marker 0xFFFFFFFF, int32 length, then the flatbuffer
    start = 8 if struct.unpack_from("<I", buf, 0)[0] == 0xFFFFFFFF else 4
    fb = buf[start:]

    def u32(pos: int) -> int:
        return struct.unpack_from("<I", fb, pos)[0]

    def field(table: int, index: int) -> int | None:
        vtable = table - struct.unpack_from("<i", fb, table)[0]
        vsize = struct.unpack_from("<H", fb, vtable)[0]
        off_at = 4 + 2 * index
        if off_at >= vsize:
            return None
        off = struct.unpack_from("<H", fb, vtable + off_at)[0]
        return table + off if off else None

    def deref(pos: int) -> int:
        return pos + u32(pos)

    def string(pos: int) -> str:
        target = deref(pos)
        return bytes(fb[target + 4 : target + 4 + u32(target)]).decode()

    message = u32(0)
    header = field(message, 2)  # Message.header: the Schema table
    if header is None:
        raise Untranslatable("no schema in the expression's serialization")
    schema = deref(header)
    kv = field(schema, 2)  # Schema.custom_metadata
    if kv is None:
        return []
    vec = deref(kv)
    pairs = []
    for i in range(u32(vec)):
        elem = vec + 4 + 4 * i
        item = deref(elem)
        k, v = field(item, 0), field(item, 1)
        pairs.append((string(k) if k else "", string(v) if v else ""))
    return pairs


@lru_cache(maxsize=4096)
def _parse(serialized: bytes) -> Node:
    reader = pa.ipc.open_file(pa.py_buffer(serialized))
    row = reader.read_all()
    tokens = _metadata_pairs(reader.schema.serialize().to_pybytes())
    pos = 0

    def node() -> Node:
        nonlocal pos
        key, value = tokens[pos]
        pos += 1
        if key == "field_ref":
            return Node("field", value)
        if key == "literal":
            return Node("literal", value=row.column(int(value))[0])
        if key != "call":
            raise Untranslatable(f"expression part {key!r}")
        args: list[Node] = []
        options = None
        while tokens[pos][0] != "end":
            if tokens[pos][0] == "options":
                options = row.column(int(tokens[pos][1]))[0]
                pos += 1
            else:
                args.append(node())
        pos += 1
        return Node("call", value, tuple(args), options)

    try:
        tree = node()
    except (IndexError, ValueError) as exc:
        raise Untranslatable(f"unreadable expression: {exc}") from None
    if pos != len(tokens):
        raise Untranslatable("trailing expression parts")
    return tree


def tree(expr: pc.Expression) -> Node:
    """The expression's tree (cached by its serialization)."""
    return _parse(expr.__reduce__()[1][0].to_pybytes())


def fields(n: Node) -> frozenset[str]:
    """The columns a tree reads."""
    if n.kind == "field":
        return frozenset([n.name])
    return frozenset().union(*(fields(a) for a in n.args))


def columns_read(expr: pc.Expression) -> frozenset[str]:
    """The columns an expression reads."""
    return fields(tree(expr))


_PLAIN_TYPES = (
    pa.types.is_integer,
    pa.types.is_floating,
    pa.types.is_boolean,
    pa.types.is_string,
    pa.types.is_large_string,
    pa.types.is_date32,
)


def plain_type(t: pa.DataType) -> bool:
    """Column types every rebuilding engine takes and gives back as the same Arrow type."""
    return any(test(t) for test in _PLAIN_TYPES)
