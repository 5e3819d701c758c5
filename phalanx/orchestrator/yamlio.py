"""Loading models from YAML with errors that name the file, line and field.

    workflows/etl.yaml:14: stages.features.ranks: must be ≥ 1
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from ..errors import PhalanxError

M = TypeVar("M", bound=BaseModel)


class ConfigError(PhalanxError):
    """A workflow or site file is invalid; ``problems`` lists every "file:line: field: message"."""

    def __init__(self, problems: list[str]):
        self.problems = problems
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


def _message(err: dict) -> str:
    kind, ctx = err["type"], err.get("ctx", {})
    if kind == "greater_than_equal":
        return f"must be ≥ {ctx['ge']}"
    if kind == "greater_than":
        return f"must be > {ctx['gt']}"
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "missing":
        return "required"
    if kind == "literal_error":
        return f"must be one of {ctx['expected']}"
    if kind in ("int_parsing", "int_type", "int_from_float"):
        return "must be an integer"
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


def _data_path(loc: tuple) -> tuple:
    """The field path, without pydantic's validator steps ('function-after[...]')."""
    return tuple(p for p in loc if not (isinstance(p, str) and "[" in p))


def problems_from(exc: ValidationError, data: Any, source: str, root: yaml.Node | None) -> list[str]:
    seen: dict[tuple, str] = {}
    for err in exc.errors():
        seen.setdefault(_data_path(err["loc"]), _message(err))
    out = []
    for path, msg in seen.items():
        line = _line_of(root, path)
        where = f"{source}:{line}" if line else source
        field = ".".join(map(str, path)) or "(top level)"
        out.append(f"{where}: {field}: {msg}")
    return out


def load_yaml(path: str | Path) -> tuple[Any, yaml.Node | None, str]:
    source = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError([f"{source}: cannot read: {exc.strerror or exc}"]) from None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else source
        raise ConfigError([f"{where}: not valid YAML: {getattr(exc, 'problem', exc)}"]) from None
    return data, root, source


def parse(model: type[M], data: Any, source: str = "<python>", root: yaml.Node | None = None) -> M:
    if not isinstance(data, dict):
        raise ConfigError([f"{source}: expected a mapping at the top level, got {type(data).__name__}"])
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(problems_from(exc, data, source, root)) from None


def load_model(model: type[M], path: str | Path) -> M:
    data, root, source = load_yaml(path)
    return parse(model, data, source, root)
