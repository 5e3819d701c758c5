"""BSPEnv: what a user's app receives on every rank."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import Any

from .comm.base import Communicator


@dataclass
class BSPEnv:
    """The rank's view of its gang: who it is, how to talk to the others, its parameters."""

    rank: int
    world_size: int
    comm: Communicator
    params: dict[str, Any] = field(default_factory=dict)
    threads: int = 1
    gang_id: str = ""
    log: logging.Logger = field(default=None, repr=False)  # type: ignore[assignment]
    _store: Any = field(default=None, repr=False)
    # Set when the app runs as a workflow stage (see phalanx.orchestrator.stage).
    stage: str = ""
    inputs: dict[str, dict[str, Any]] = field(default_factory=dict)   # local name → get() spec
    outputs: list[str] = field(default_factory=list)
    # What each input() read on this rank: dataset, rows, bytes and the repartition path taken.
    input_stats: dict[str, dict[str, Any]] = field(default_factory=dict)

    def input(self, name: str):
        """The stage input ``name`` as a DataFrame, repartitioned as the workflow says."""
        if name not in self.inputs:
            raise KeyError(f"stage {self.stage!r} has no input {name!r}; inputs: {sorted(self.inputs)}")
        spec = dict(self.inputs[name])
        dataset = spec.pop("dataset")
        if spec.get("shuffle") == "global":  # a per-epoch order for the ML loader: read as stored
            spec.pop("shuffle")
            spec.pop("seed", None)
        session, _, short = dataset.rpartition("/")  # "session/name": another run's dataset
        store = self.store.for_session(session) if session else self.store
        frame = store.get(short, **{k: v for k, v in spec.items() if v is not None})
        table = frame.to_arrow()
        self.input_stats[name] = {"dataset": dataset, "rows": table.num_rows, "bytes": table.nbytes,
                                  "plan": store.last_plan}
        return frame

    def output(self, name: str, data: Any):
        """Seal ``data`` as the stage output ``name`` (every rank passes its partition)."""
        if name not in self.outputs:
            raise KeyError(f"stage {self.stage!r} declares no output {name!r}; outputs: {self.outputs}")
        return self.store.put(name, data, replace=True, producer=self.stage)

    def __post_init__(self) -> None:
        if self.log is None:
            self.log = rank_logger(self.rank)

    @property
    def store(self):
        """The intermediate store, for collective ``put``/``get`` (opened on first use)."""
        if self._store is None:
            from ..store.rank import RankStore
            from ..store.store import Store

            self._store = RankStore(self, Store.from_env())  # the gang's PHALANX_STORE* settings
        return self._store

    def barrier(self) -> None:
        self.comm.barrier()


def rank_logger(rank: int) -> logging.Logger:
    """A logger whose lines start with ``[rank N]`` so interleaved output stays readable."""
    log = logging.getLogger(f"phalanx.rank{rank}")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(
            f"[rank {rank}] %(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log
