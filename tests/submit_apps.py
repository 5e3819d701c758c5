"""Stage apps of tests/test_submit.py: stages that wait for the test, and say where they run."""

import os
import time
from pathlib import Path

from apps import wf_generate


def gated_generate(env):
    """Writes its pid to params.dir/pid.<rank>, waits (bounded by params.wait_s) until the test
    creates params.dir/go, then makes rows as ``apps.wf_generate`` does (params rows, seed)."""
    d = Path(env.params["dir"])
    tmp = d / f".pid.{env.rank}.tmp"  # written whole, then renamed: a reader never sees it empty
    tmp.write_text(str(os.getpid()))
    os.replace(tmp, d / f"pid.{env.rank}")
    deadline = time.monotonic() + env.params.get("wait_s", 120)
    while not (d / "go").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{d / 'go'} never appeared")
        time.sleep(0.05)
    env.comm.barrier()
    wf_generate(env)
