"""BSPEnv: what a user's app receives on every rank.

The runtime is the lowest layer that runs apps, so the env knows nothing of the layers above
it; they plug in.  The store attaches how a rank opens ``env.store`` (``attach_store``, done by
``phalanx.store`` when it is imported, which ``import phalanx`` does), and a workflow stage's
runner (``phalanx.orchestrator.stage``) lends the env its inputs and outputs while the stage's
app runs (``in_stage``), for ``env.input`` / ``env.output``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from .comm.base import Communicator


class StageScope(Protocol):
    """What a workflow stage lends its ranks' env (the stage runner's object)."""

    name: str
    inputs: dict[str, dict[str, Any]]  # local name → how the stage reads it (store.get spec)
    outputs: list[str]

    def input(self, name: str) -> Any: ...

    def output(self, name: str, data: Any) -> Any: ...


_store_opener: Callable[[BSPEnv], Any] | None = None


def attach_store(opener: Callable[[BSPEnv], Any]) -> None:
    """How a rank opens ``env.store``: ``opener(env)`` on first use (the store layer calls this)."""
    global _store_opener
    _store_opener = opener


@dataclass
class BSPEnv:
    """The rank's view of its gang: who it is, how to talk to the others, its parameters."""

    rank: int
    world_size: int
    comm: Communicator
    params: dict[str, Any] = field(default_factory=dict)
    threads: int = 1
    gang_id: str = ""
    log: logging.Logger = field(default=None, repr=False)  # type: ignore[assignment]  # None only until __post_init__ sets the rank's logger
    _store: Any = field(default=None, repr=False)
    _stage: StageScope | None = field(default=None, repr=False)  # while a workflow stage's app runs

    def __post_init__(self) -> None:
        if self.log is None:
            self.log = rank_logger(self.rank)

    @property
    def store(self) -> Any:
        """The intermediate store, for collective ``put``/``get`` (opened on first use)."""
        if self._store is None:
            if _store_opener is None:
                raise RuntimeError(
                    "env.store: no store is attached to the runtime (phalanx.store "
                    "attaches itself when imported: import phalanx)"
                )
            self._store = _store_opener(self)  # the gang's PHALANX_STORE* settings
        return self._store

    def barrier(self) -> None:
        self.comm.barrier()

    # ---- a workflow stage's inputs and outputs (its runner's; empty outside a stage) ----------
    @contextmanager
    def in_stage(self, scope: StageScope) -> Iterator[BSPEnv]:
        """Lend this env ``scope`` (a stage's inputs and outputs) for as long as the block runs."""
        before, self._stage = self._stage, scope
        try:
            yield self
        finally:
            self._stage = before

    @property
    def stage(self) -> str:
        """The workflow stage this app runs as ("" outside one)."""
        return self._stage.name if self._stage is not None else ""

    @property
    def inputs(self) -> dict[str, dict[str, Any]]:
        """The stage's inputs: local name → dataset and how it is read."""
        return self._stage.inputs if self._stage is not None else {}

    @property
    def outputs(self) -> list[str]:
        """The datasets the stage seals."""
        return list(self._stage.outputs) if self._stage is not None else []

    def input(self, name: str) -> Any:
        """The stage input ``name`` as a DataFrame, repartitioned as the workflow says."""
        return self._scope(f"env.input({name!r})").input(name)

    def output(self, name: str, data: Any) -> Any:
        """Seal ``data`` as the stage output ``name`` (every rank passes its partition)."""
        return self._scope(f"env.output({name!r}, ...)").output(name, data)

    def _scope(self, call: str) -> StageScope:
        if self._stage is None:
            raise RuntimeError(
                f"{call} is for the app of a workflow stage (inputs and outputs come "
                "from the workflow); in a plain gang.run use env.store.get / put"
            )
        return self._stage


def rank_logger(rank: int) -> logging.Logger:
    """A logger whose lines start with ``[rank N]`` so interleaved output stays readable."""
    log = logging.getLogger(f"phalanx.rank{rank}")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"[rank {rank}] %(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log
