"""The rank side of a workflow stage: wire inputs and outputs around the user's app."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from ..runtime.gpu import gpu_stats
from ..runtime.protocol import rank_host
from ..runtime.tasks import resolve_app


@dataclass
class StageContext:
    """A stage's inputs and outputs on one rank: what ``env.input`` and ``env.output`` reach
    while the stage's app runs (the env only forwards to it: ``BSPEnv.in_stage``)."""

    env: Any  # the rank's BSPEnv
    name: str
    inputs: dict[str, dict[str, Any]]  # local name → get() spec (with its dataset), or a gather of parts
    outputs: dict[str, str]  # the app's name of an output → the dataset sealed (OUT.i for a fan-out instance)
    # What each input() read on this rank: dataset, rows, bytes and the repartition path taken.
    input_stats: dict[str, dict[str, Any]] = field(default_factory=dict)

    def input(self, name: str):
        """The stage input ``name`` as a DataFrame, repartitioned as the workflow says; an input
        gathered from a fan-out's instances: one frame of all (concat) or a list, one per instance."""
        if name not in self.inputs:
            raise KeyError(f"stage {self.name!r} has no input {name!r}; inputs: {sorted(self.inputs)}")
        if "parts" in self.inputs[name]:
            return self._gather(name, self.inputs[name]["gather"], self.inputs[name]["parts"])
        spec = dict(self.inputs[name])
        dataset = spec.pop("dataset")
        if spec.get("shuffle") == "global":  # a per-epoch order for the ML loader: read as stored
            spec.pop("shuffle")
            spec.pop("seed", None)
        session, _, short = dataset.rpartition("/")  # "session/name": another run's dataset
        store = self.env.store.for_session(session) if session else self.env.store
        reads = store.store.reads  # partition bytes read on this host vs fetched from others
        here, fetched = reads.local, reads.fetched
        store.last_scan = None
        # lazy: a balanced share is read as the app uses it, only the columns its plan needs
        frame = store.get(short, lazy=True, **{k: v for k, v in spec.items() if v is not None})
        if store.last_scan is not None:  # its stats fill in as the app reads
            self.input_stats[name] = store.last_scan.stats
            self.input_stats[name].update(dataset=dataset, plan=store.last_plan)
            return frame
        table = frame.to_arrow()
        self.input_stats[name] = {
            "dataset": dataset,
            "rows": table.num_rows,
            "bytes": table.nbytes,
            "plan": store.last_plan,
            "read_here": reads.local - here,
            "fetched": reads.fetched - fetched,
        }
        return frame

    def _gather(self, name: str, mode: str, parts: list[str]):
        """The instances' datasets of a fan-out: a list of frames, or their rows on this rank
        concatenated (each part repartitioned as the input says, so a ``by:`` input stays
        partitioned by its key)."""
        frames = [self.input(part) for part in parts]
        if mode == "list":
            return frames
        if not frames:
            raise ValueError(f"stage {self.name!r}: input {name!r} gathers a fan-out whose instances all were skipped")
        import pyarrow as pa

        from ..operators.dataframe import DataFrame

        tables = [f.to_arrow() for f in frames]
        return DataFrame.from_arrow(pa.concat_tables(tables, promote_options="default"), self.env)

    def output(self, name: str, data: Any):
        """Seal ``data`` as the stage output ``name`` (every rank passes its partition)."""
        if name not in self.outputs:
            raise KeyError(f"stage {self.name!r} declares no output {name!r}; outputs: {list(self.outputs)}")
        return self.env.store.put(self.outputs[name], data, replace=True, producer=self.name)


def run_stage(
    env, stage: str, app: str, inputs: dict[str, dict[str, Any]], outputs: list[str] | dict[str, str]
) -> dict:
    """Run ``app(env)``; outputs are sealed with ``env.output`` or returned as ``{name: frame}``.

    Returns what every rank reports to the run database: its app's start and end time, host
    and pid, the rows/bytes/repartition path of each input it read, and (the same on every
    rank) rows and bytes of each sealed output.
    """
    started = time.time()
    named = dict(outputs) if isinstance(outputs, dict) else {o: o for o in outputs}
    ctx = StageContext(env, stage, inputs, named)
    with env.in_stage(ctx):
        result = resolve_app(app)(env)
    if isinstance(result, dict):
        for name in named:  # the declared order: every rank puts in the same order
            if name in result:
                ctx.output(name, result[name])
        extra = sorted(set(result) - set(named))
        if extra:
            raise KeyError(f"stage {stage!r} returned undeclared outputs {extra}; declared: {list(named)}")
    missing = [name for name, dataset in named.items() if not env.store.exists(dataset)]
    if missing:
        raise RuntimeError(
            f"stage {stage!r} finished without sealing its outputs {missing} "
            "(call env.output(name, df) or return {name: df})"
        )
    sizes = {dataset: env.store.info(dataset) for dataset in named.values()}
    return {
        "outputs": {name: (i.num_rows, i.nbytes) for name, i in sizes.items()},
        "inputs": ctx.input_stats,
        "started": started,
        "ended": time.time(),
        "host": rank_host(),
        "pid": os.getpid(),
        "gpu": gpu_stats(),  # device and peak GPU memory, None where the app did not use CUDA
    }
