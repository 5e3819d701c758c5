"""Loading models from YAML with errors that name the file, line and field.

    workflows/etl.yaml:14: stages.features.ranks: must be ≥ 1
    --set stages.features.ranks: stages.features.ranks: must be ≥ 1

Every way a file can be wrong ends in a ``ConfigError`` worded so: bytes that are not UTF-8,
characters YAML forbids, nesting or alias expansion past sane limits, duplicate keys, scalars
PyYAML cannot convert (``2024-13-45``), and then the models' own checks.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional, TypeVar, cast

import yaml
from pydantic import BaseModel, PrivateAttr, ValidationError
from pydantic_core import ErrorDetails
from yaml.composer import ComposerError
from yaml.constructor import ConstructorError

from ..errors import PhalanxError

M = TypeVar("M", bound=BaseModel)
MAX_DEPTH = 100  # nested collections; PyYAML's composer recurses (3000 levels: RecursionError)
MAX_VALUES = 1_000_000  # values a document expands to through aliases ("billion laughs")
_MERGE = "tag:yaml.org,2002:merge"


class ConfigError(PhalanxError):
    """A workflow or site file is invalid; ``problems`` lists every "file:line: field: message"."""

    def __init__(self, problems: list[str]):
        self.problems = [" ".join(p.splitlines()) for p in problems]  # one line each
        super().__init__("\n".join(problems))


def _line_of(node: yaml.Node | None, loc: tuple) -> int | None:
    """The line of the deepest YAML node along ``loc`` (1-based)."""
    line = node.start_mark.line + 1 if node is not None else None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if key.value == str(part):
                    node, line = value, key.start_mark.line + 1
                    break
            else:
                return line
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def _part(key: Any) -> str:
    """A key in a field path: as written when plain, else quoted ('a/../b', '', 'two words')."""
    text = str(key)
    return text if re.fullmatch(r"[\w-]+", text) else repr(key)


def field_path(loc: Iterable) -> str:
    """``("stages", "a/b", "ranks")`` → "stages.'a/b'.ranks"."""
    return ".".join(map(_part, loc)) or "(top level)"


def locate(loc: tuple, source: str, root: yaml.Node | None = None, overridden: Iterable[tuple] = ()) -> str:
    """ "file:line: field" of a field, or "--set KEY: field" when an override gave its value."""
    field = field_path(loc)
    for keys in overridden:
        if tuple(map(str, loc[: len(keys)])) == keys:
            return f"--set {'.'.join(keys)}: {field}"
    line = _line_of(root, loc)
    return f"{source}:{line}: {field}" if line else f"{source}: {field}"


class Located(BaseModel):
    """A model that remembers where it was read from, so later checks name file and line."""

    _source: str = PrivateAttr("<python>")
    _root: Optional[yaml.Node] = PrivateAttr(None)
    _overridden: tuple = PrivateAttr(())

    def where(self, loc: tuple) -> str:
        return locate(loc, self._source, self._root, self._overridden)


def _message(err: ErrorDetails) -> str:
    kind, ctx = err["type"], err.get("ctx", {})
    if kind == "greater_than_equal":
        return f"must be ≥ {ctx['ge']}"
    if kind == "greater_than":
        return f"must be > {ctx['gt']}"
    if kind == "less_than_equal":
        return f"must be ≤ {ctx['le']}"
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "missing":
        return "required"
    if kind == "literal_error":
        return f"must be one of {ctx['expected']}"
    if kind in ("int_parsing", "int_type", "int_from_float"):
        return "must be an integer"
    if kind in ("float_parsing", "float_type"):
        return "must be a number"
    if kind == "finite_number":
        return "must be a finite number"
    if kind == "too_short":
        return "must not be empty"
    if kind in ("model_type", "dict_type"):
        return "must be a mapping"
    if kind == "string_type":
        return "must be a string"
    if kind == "list_type":
        return "must be a list"
    if kind == "value_error":
        return str(ctx.get("error", err["msg"]))
    return err["msg"]


def _data_path(err: ErrorDetails) -> tuple:
    """The field path, without pydantic's validator steps ('function-after[...]', '[key]'),
    down to the key a section check names."""
    path = tuple(p for p in err["loc"] if not (isinstance(p, str) and "[" in p))
    return path + tuple(err.get("ctx", {}).get("keys", ())) if err["type"] == "section" else path


def problems_from(
    exc: ValidationError, data: Any, source: str, root: yaml.Node | None, overridden: Iterable[tuple] = ()
) -> list[str]:
    seen: dict[tuple, str] = {}
    for err in exc.errors():
        seen.setdefault(_data_path(err), _message(err))
    return [f"{locate(path, source, root, overridden)}: {msg}" for path, msg in seen.items()]


class _Loader(yaml.SafeLoader):
    """PyYAML's SafeLoader, strict where a config file must be: bounded nesting and alias
    expansion, no recursive aliases, no duplicate keys, no NUL in strings, and a scalar it cannot
    convert (``2024-13-45``, ``!!int 0x``) is a YAML error at that scalar, not a ValueError."""

    def __init__(self, text: str):
        super().__init__(text)
        self._open: list[str | None] = []  # anchors of the nodes being composed: one per level
        self._values: dict[int, int] = {}  # id(node) → values it expands to

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        event = self.peek_event()
        # the pure-Python parser's marks (the stubs also allow the C parser's yaml._yaml.Mark)
        mark = cast("yaml.Mark | None", event.start_mark)
        if isinstance(event, yaml.AliasEvent) and event.anchor in self._open:
            raise ComposerError(None, None, f"alias *{event.anchor} refers to a node that contains it", mark)
        if len(self._open) >= MAX_DEPTH:
            raise ComposerError(None, None, f"nested deeper than {MAX_DEPTH} levels", mark)
        self._open.append(getattr(event, "anchor", None))
        try:
            node = super().compose_node(parent, index)
        finally:
            self._open.pop()
        if node is not None and id(node) not in self._values:  # an alias's node is counted where it was defined
            self._count(node)
        return node

    def _count(self, node: yaml.Node) -> None:
        children: list[yaml.Node] = []
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            first: dict[tuple, int] = {}
            for key, value in node.value:
                children += [key, value]
                if isinstance(key, yaml.ScalarNode) and key.tag != _MERGE:
                    if (key.tag, key.value) in first:
                        raise ComposerError(
                            None,
                            None,
                            f"duplicate key {key.value!r} (first on line {first[key.tag, key.value]})",
                            key.start_mark,
                        )
                    first[key.tag, key.value] = key.start_mark.line + 1
        values = self._values[id(node)] = 1 + sum(self._values[id(c)] for c in children)
        if values > MAX_VALUES:
            raise ComposerError(None, None, f"expands to more than {MAX_VALUES} values (aliases)", node.start_mark)

    def construct_scalar(self, node: yaml.ScalarNode | yaml.MappingNode) -> Any:
        value = super().construct_scalar(node)
        if isinstance(value, str) and "\0" in value:
            raise ConstructorError(None, None, "a NUL character in a string", node.start_mark)
        return value

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except yaml.YAMLError:
            raise
        except Exception as exc:  # PyYAML's converters raise ValueError, AttributeError...
            what = repr(node.value[:40]) if isinstance(node, yaml.ScalarNode) else "this node"
            why = f": {exc}" if isinstance(exc, ValueError) else ""
            raise ConstructorError(
                None, None, f"cannot read {what} as !!{node.tag.rsplit(':', 1)[-1]}{why}", node.start_mark
            ) from None


def _yaml_problem(exc: yaml.YAMLError, text: str) -> tuple[int, str]:
    """(line, what is wrong) of a PyYAML error."""
    if isinstance(exc, yaml.reader.ReaderError):  # a character YAML forbids; a position, no line
        char = exc.character if isinstance(exc.character, str) else chr(exc.character)
        return text.count("\n", 0, exc.position) + 1, f"character {char!r} (#x{ord(char):x}) is not allowed"
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or getattr(exc, "context", None) or str(exc)
    return (mark.line + 1 if mark else 1), problem


def parse_yaml(text: str, source: str, lines: bool = True) -> tuple[Any, yaml.Node]:
    """YAML text → (data, its node tree); a ConfigError says "source:line" (``lines=False``:
    just "source", for a ``--set`` value)."""
    loader = None
    try:
        loader = _Loader(text)  # checks the characters at once
        root = loader.get_single_node() or yaml.ScalarNode(  # an empty document: a null at line 1
            "tag:yaml.org,2002:null", "", yaml.Mark(source, 0, 0, 0, None, 0)
        )
        return loader.construct_document(root), root
    except yaml.YAMLError as exc:
        line, problem = _yaml_problem(exc, text)
        raise ConfigError(
            [f"{source}:{line}: not valid YAML: {problem}" if lines else f"{source}: not valid YAML: {problem}"]
        ) from None
    finally:
        if loader is not None:
            loader.dispose()


def load_yaml(path: str | Path) -> tuple[Any, yaml.Node, str]:
    source = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError([f"{source}: cannot read: {exc.strerror or exc}"]) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - raw.rfind(b"\n", 0, exc.start)
        raise ConfigError([f"{source}:{line}: not UTF-8: byte 0x{raw[exc.start]:02x} at column {column}"]) from None
    data, root = parse_yaml(text, source)
    return data, root, source


def parse(
    model: type[M], data: Any, source: str = "<python>", root: yaml.Node | None = None, overridden: Iterable[tuple] = ()
) -> M:
    """``data`` as ``model``; ``overridden``: key paths a ``--set`` gave (errors there name it)."""
    overridden = tuple(overridden)
    if not isinstance(data, dict):
        got = "an empty document" if data is None else f"a {type(data).__name__}"
        raise ConfigError([f"{locate((), source, root)}: must be a mapping, not {got}"])
    try:
        obj = model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(problems_from(exc, data, source, root, overridden)) from None
    if isinstance(obj, Located):
        obj._source, obj._root, obj._overridden = source, root, overridden
    return obj


def load_model(model: type[M], path: str | Path) -> M:
    data, root, source = load_yaml(path)
    return parse(model, data, source, root)
