"""Apps importable as "apps:function" (the tests directory is on the ranks' path)."""

import os
import time


def rank_info(env):
    return env.rank, env.world_size, dict(env.params), os.getpid()


def exchange_ranks(env):
    got = env.comm.exchange([bytes([env.rank]) * (dest + 1) for dest in range(env.world_size)])
    return [bytes(b) for b in got]


def sleep_forever(env):
    while True:
        time.sleep(0.1)


# ---- workflow stage apps (see tests/test_scheduler.py) -----------------------------------
def wf_seal_then_sleep(env):
    import pyarrow as pa

    env.output("early", pa.table({"x": list(range(10))}))
    sleep_forever(env)


def wf_generate(env):
    """Each rank makes rows; env.params: rows, seed."""
    import numpy as np
    import pyarrow as pa

    import phalanx as px

    n, seed = env.params["rows"], env.params.get("seed", 0)
    rng = np.random.default_rng([seed, env.rank])
    part = pa.table(
        {"user": rng.integers(0, 50, n // env.world_size), "amount": rng.integers(1, 100, n // env.world_size)}
    )
    env.output("tx", px.DataFrame.from_arrow(part, env))


def wf_generate_reference(rows: int, ranks: int, seed: int = 0):
    """What wf_generate makes over ``ranks`` ranks, as one pandas frame, made here on its own
    (the tests' independent reference)."""
    import numpy as np
    import pandas as pd

    parts = []
    for r in range(ranks):
        rng = np.random.default_rng([seed, r])
        n = rows // ranks
        parts.append(pd.DataFrame({"user": rng.integers(0, 50, n), "amount": rng.integers(1, 100, n)}))
    return pd.concat(parts)


def wf_totals(env):
    """Per-user totals of the input ``tx``; optionally fails (params: fail_marker, fail_times)."""
    marker = env.params.get("fail_marker")
    if marker:
        from pathlib import Path

        p = Path(marker)
        count = int(p.read_text()) if p.exists() else 0
        if count < env.params.get("fail_times", 1):
            env.comm.barrier()
            if env.rank == 0:
                p.write_text(str(count + 1))
            raise RuntimeError(f"planned failure {count + 1}")
    totals = env.input("tx").groupby("user").agg({"amount": "sum"})
    return {env.params.get("output", "totals"): totals}


def wf_totals_losing_input(env):
    """wf_totals whose first attempt finds partition 1 of its input ``tx`` gone (as when the
    host holding it in memory is lost): rank 0 removes the file, then every rank reads."""
    from pathlib import Path

    marker = Path(env.params["lost_marker"])
    lose = not marker.exists()
    env.comm.barrier()  # every rank has looked before rank 0 marks it: all take the same branch
    if lose:
        if env.rank == 0:
            marker.touch()
            info = env.store.info("tx")
            (Path(info.location) / "part-00001.arrow").unlink()
        env.comm.barrier()
    return wf_totals(env)


def wf_meet(env):
    """Waits (bounded) until the stage named in params.peer has started: proves concurrency."""
    from pathlib import Path

    d = Path(env.params["dir"])
    (d / env.stage).touch()
    deadline = time.monotonic() + 60
    while not (d / env.params["peer"]).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"stage {env.params['peer']!r} never ran alongside {env.stage!r}")
        time.sleep(0.05)
    env.comm.barrier()


def wf_mark(env):
    """Records when it ran (for ordering checks): writes dir/<stage>.<rank>."""
    from pathlib import Path

    Path(env.params["dir"], f"{env.stage}.{env.rank}").write_text(str(time.time()))


def wf_say(env):
    """Prints a line naming its stage (log routing checks) and passes ``tx`` on as ``out``."""
    print(f"stage {env.stage} on rank {env.rank}", flush=True)
    df = env.input("tx")
    return {env.outputs[0]: df} if env.outputs else None


def wf_divide_by_zero(env):
    """Rank 1 fails two frames deep (the CLI's traceback summary is checked)."""

    def ratio(x):
        return 1 / x

    if env.rank == 1:
        ratio(0)
    env.comm.barrier()


def wf_sum_amount(env):
    """The sum of the input ``tx``'s ``amount`` (only that column: the read is lazy, so the
    ``user`` column is never read) as one row."""
    return {"total": env.input("tx").agg(total=("amount", "sum"))}
