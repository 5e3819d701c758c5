"""What a phalanx Parsl app hands on: references to store datasets, never the data.

No Parsl here: ranks and the driver both import this module.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import pyarrow as pa

    from ...store import DatasetInfo, Store


@dataclass(frozen=True)
class DatasetRef:
    """A sealed dataset of the store: ``session/name`` in the store at ``root``.

    Small and picklable: it travels through Parsl (as an app's output, another app's argument)
    where the dataset's partitions stay in the store.  Given to a ``bsp_app`` it arrives on every
    rank as a ``px.DataFrame`` (this rank's share, read as ``by``/``shuffle``/``columns`` say);
    ``str(ref)`` is ``"session/name"``, what a workflow stage takes as an input from another run.
    """

    name: str
    session: str
    root: str
    metadata: Optional[str] = None  # the store's catalogue URL (default: SQLite beside the root)
    rows: Optional[int] = None  # rows when it was sealed (for show; the store is the truth)
    by: Optional[tuple[str, ...]] = None  # read options for the consumer's ranks
    shuffle: Optional[str] = None
    seed: int = 0
    columns: Optional[tuple[str, ...]] = None

    def __str__(self) -> str:
        return f"{self.session}/{self.name}"

    # ---- how the next app reads it -------------------------------------------------------------
    def hashed(self, *keys: str) -> DatasetRef:
        """The same dataset, hash-partitioned by ``keys`` for the consumer's ranks."""
        return dataclasses.replace(self, by=tuple(keys), shuffle=None)

    def shuffled(self, seed: int = 0) -> DatasetRef:
        """The same dataset as a seeded random permutation of its rows."""
        return dataclasses.replace(self, by=None, shuffle="random", seed=seed)

    def select(self, *columns: str) -> DatasetRef:
        """Only these columns (and the keys of ``hashed``)."""
        return dataclasses.replace(self, columns=tuple(columns))

    def get_options(self) -> dict[str, Any]:
        """``env.store.get`` keywords of this reference."""
        opts: dict[str, Any] = {}
        if self.by:
            opts["by"] = list(self.by)
        if self.shuffle:
            opts["shuffle"], opts["seed"] = self.shuffle, self.seed
        if self.columns is not None:
            opts["columns"] = list(self.columns)
        return opts

    # ---- outside a gang ------------------------------------------------------------------------
    def store(self) -> Store:
        from ...store import Store

        return Store(self.root, self.session, metadata=self.metadata)

    def read(self, columns: Sequence[str] | None = None) -> pa.Table:
        """The whole dataset as one Arrow table (checksums verified)."""
        return self.store().read(self.name, columns=columns)

    def info(self) -> DatasetInfo:
        return self.store().info(self.name)

    def exists(self) -> bool:
        return self.store().exists(self.name)

    def delete(self) -> None:
        self.store().delete(self.name)

    @classmethod
    def of(cls, store: Store, name: str) -> DatasetRef:
        """The reference of dataset ``name`` as ``store`` holds it now."""
        info = store.info(name)
        return cls(name=name, session=store.session, root=str(store.root), metadata=store.meta.url, rows=info.num_rows)


class BSPResult(list):
    """What a ``bsp_app``'s future gives: one result per rank (what the function returned, less
    the frames it sealed), and ``outputs``: a ``DatasetRef`` per sealed dataset."""

    def __init__(
        self,
        per_rank: Sequence[Any] = (),
        outputs: dict[str, DatasetRef] | None = None,
        session: str = "",
        gang_id: str = "",
        placement: str = "",
        seconds: float = 0.0,
    ):
        super().__init__(per_rank)
        self.outputs: dict[str, DatasetRef] = dict(outputs or {})
        self.session, self.gang_id, self.placement, self.seconds = session, gang_id, placement, seconds

    def __reduce__(self):
        return (BSPResult, (list(self), self.outputs, self.session, self.gang_id, self.placement, self.seconds))

    def __repr__(self) -> str:
        outs = ", ".join(f"{k}={v}" for k, v in self.outputs.items())
        return f"BSPResult({list.__repr__(self)}, outputs={{{outs}}})"


@dataclass
class WorkflowResult:
    """What ``Workflow.as_parsl_app()``'s future gives: the run and a ``DatasetRef`` per output
    of its stages (another app's input, or ``ref.read()``)."""

    run_id: str
    session: str
    outputs: dict[str, DatasetRef] = field(default_factory=dict)


def single_output(value: Any, what: str = "argument") -> Any:
    """A ``BSPResult``/``WorkflowResult`` given where a dataset goes: its only output's reference."""
    if isinstance(value, (BSPResult, WorkflowResult)):
        if len(value.outputs) != 1:
            raise TypeError(
                f"{what}: an app result with outputs {sorted(value.outputs)} is not one dataset; "
                "pass phalanx.integrations.parsl.output(future, NAME)"
            )
        return next(iter(value.outputs.values()))
    return value


def new_session(name: str) -> str:
    """A store session of its own for one app call: ``parsl-<app>-<date>-<time>-<6 hex>``."""
    stem = "".join(c if c.isalnum() or c in "_.-" else "-" for c in name)[:40].strip("-.") or "app"
    return f"parsl-{stem}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
