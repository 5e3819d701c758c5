"""The ``ray:`` section of a site file (and of a stage, over the site's), as a typed model.

Light on purpose: pydantic and ``executors.base`` only — never ``ray`` — so ``phalanx
validate`` and the published JSON Schemas read it where Ray is not installed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Field, ValidationError, WithJsonSchema, field_validator
from pydantic_core import ErrorDetails, PydanticCustomError

from ...errors import PhalanxError
from ..base import ExecutorConfig, suggest

STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
_MAX_SECONDS = 366 * 86400  # a year: longer timeouts are typos

Strategy = Annotated[
    Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"],
    # the model takes any case (spread, Spread); editors get both common spellings
    WithJsonSchema({"type": "string", "enum": [*STRATEGIES, *(s.lower() for s in STRATEGIES)], "default": "PACK"}),
]
Bundle = dict[str, Annotated[float, Field(ge=0)]]  # resource → amount (checked by _check_bundle)


class RayConfig(ExecutorConfig):
    """The ``ray:`` section: which cluster, and what each rank's bundle of the gang's placement
    group holds.  A stage's own ``ray:`` section overrides keys of the site's for its gangs."""

    address: str = Field(
        "auto",
        strict=True,
        description="the cluster: auto (RAY_ADDRESS, else the latest cluster started on "
        "this host) | host:port of the GCS | ray://host:10001 (Ray Client) | local (a new one in this process)",
    )
    namespace: Optional[str] = Field(
        "phalanx", description="Ray namespace of the driver's job and the rank actors (null: Ray's own)"
    )
    strategy: Strategy = Field(
        "PACK",
        description="placement strategy of a gang's group (any case): STRICT_PACK (one node) | PACK | "
        "SPREAD | STRICT_SPREAD (one rank a node)",
    )
    cpus_per_rank: float = Field(
        1,
        gt=0,
        allow_inf_nan=False,
        strict=True,
        description="CPUs in every rank's bundle; also each rank's thread count (PHALANX_THREADS, at least 1)",
    )
    resources: Union[Bundle, list[Bundle]] = Field(
        default_factory=dict,
        description="further resources of every bundle ({GPU: 1}, {node_a: 1}...), or a "
        "list with one mapping per rank (a gang must then have that many ranks)",
    )
    ready_timeout_s: float = Field(
        60,
        gt=0,
        le=_MAX_SECONDS,
        allow_inf_nan=False,
        strict=True,
        description="seconds to wait for the whole "
        "placement group (all or nothing) before the gang fails with Ray's reason",
    )
    runtime_env: Optional[dict[str, Any]] = Field(
        None, description="Ray runtime_env of the rank actors (pip, env_vars, working_dir...)"
    )
    init: dict[str, Any] = Field(default_factory=dict, description="further keyword arguments of ray.init()")

    @field_validator("namespace", mode="before")
    @classmethod
    def _namespace(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, str):
            raise ValueError("must be a string or null")
        return value

    @field_validator("strategy", mode="before")
    @classmethod
    def _strategy(cls, value: Any) -> Any:
        if not isinstance(value, str):
            raise ValueError("must be a string")
        upper = value.upper()
        if upper not in STRATEGIES:
            raise ValueError(f"unknown strategy {value!r}{suggest(upper, STRATEGIES)}")
        return upper

    @field_validator("resources", mode="before")
    @classmethod
    def _resources(cls, value: Any) -> Any:
        """Checked here, not by the union (whose errors would name both of its branches): the
        first bad entry, at its own key (``ray.resources.1.node_a: must be a number``)."""
        if value is None:
            return {}
        if isinstance(value, dict):
            _check_bundle(value, ())
        elif isinstance(value, list):
            for i, bundle in enumerate(value):
                _check_bundle(bundle, (i,))
        else:
            raise ValueError("must be a mapping (added to every bundle) or a list of mappings (one per rank)")
        return value

    def bundles(self, ranks: int) -> list[dict[str, float]]:
        """The placement group's bundles for a gang of ``ranks``: ``{CPU: cpus_per_rank}`` and
        the resources, one bundle a rank; ``ValueError`` when a list does not match the gang."""
        per_rank = self.resources if isinstance(self.resources, list) else [self.resources] * ranks
        if len(per_rank) != ranks:
            raise ValueError(f"resources lists {len(per_rank)} bundles for a gang of {ranks} ranks")
        return [{"CPU": self.cpus_per_rank, **res} for res in per_rank]

    def threads(self) -> int:
        """Each rank's thread count: its bundle's CPUs (at least one)."""
        return max(1, int(self.cpus_per_rank))


SITE_KEYS = tuple(RayConfig.known_keys())


def _check_bundle(bundle: Any, at: tuple) -> None:
    if not isinstance(bundle, dict):
        raise _section_error(at, "must be a mapping of resource names to amounts")
    for name, amount in bundle.items():
        if not isinstance(name, str):
            raise _section_error(at + (name,), "a resource name must be a string")
        if isinstance(amount, bool) or not isinstance(amount, (int, float)):
            raise _section_error(at + (name,), "must be a number")
        if not math.isfinite(amount) or amount < 0:
            raise _section_error(at + (name,), "must be a finite number ≥ 0")


def _section_error(keys: tuple, message: str) -> PydanticCustomError:
    """An error at ``keys`` inside the field (the "section" type carries them to their line)."""
    return PydanticCustomError("section", "{message}", {"keys": keys, "message": message})


def ray_config(section: RayConfig | Mapping[str, Any] | None, site: str = "ray") -> RayConfig:
    """``section`` as a ``RayConfig``; a bad one raises ``PhalanxError`` naming every bad key
    (``site 'gpu' (ray): ray.strategy: unknown strategy 'TIGHT'; known: ...``)."""
    if isinstance(section, RayConfig):
        return section
    try:
        return RayConfig.model_validate(dict(section or {}))
    except ValidationError as exc:
        raise PhalanxError(f"site {site!r} (ray): " + "; ".join(_problem(e) for e in exc.errors())) from None


def _problem(err: ErrorDetails) -> str:
    """One pydantic error as ``ray.key: message`` (the section check's keys, no union tags)."""
    path = [p for p in err["loc"] if not (isinstance(p, str) and "[" in p)]
    path += list(err.get("ctx", {}).get("keys", ())) if err["type"] == "section" else []
    message = str(err["ctx"]["error"]) if err["type"] == "value_error" else err["msg"]
    return ".".join(["ray", *map(str, path)]) + f": {message}"
