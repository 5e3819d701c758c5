"""The rank side of a workflow stage: wire inputs and outputs around the user's app."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from ..runtime.tasks import resolve_app


def run_stage(env, stage: str, app: str, inputs: dict[str, dict[str, Any]], outputs: list[str]) -> dict:
    """Run ``app(env)``; outputs are sealed with ``env.output`` or returned as ``{name: frame}``.

    Returns what every rank reports to the run database: its app's start and end time, host
    and pid, the rows/bytes/repartition path of each input it read, and (the same on every
    rank) rows and bytes of each sealed output.
    """
    started = time.time()
    env.stage, env.inputs, env.outputs, env.input_stats = stage, inputs, list(outputs), {}
    result = resolve_app(app)(env)
    if isinstance(result, dict):
        for name in outputs:  # the declared order: every rank puts in the same order
            if name in result:
                env.output(name, result[name])
        extra = sorted(set(result) - set(outputs))
        if extra:
            raise KeyError(f"stage {stage!r} returned undeclared outputs {extra}; declared: {outputs}")
    missing = [name for name in outputs if not env.store.exists(name)]
    if missing:
        raise RuntimeError(f"stage {stage!r} finished without sealing its outputs {missing} "
                           "(call env.output(name, df) or return {name: df})")
    sizes = {name: env.store.info(name) for name in outputs}
    return {"outputs": {name: (i.num_rows, i.nbytes) for name, i in sizes.items()},
            "inputs": env.input_stats, "started": started, "ended": time.time(),
            "host": socket.gethostname(), "pid": os.getpid()}
