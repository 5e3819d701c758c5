"""Stage apps of workflows/etl_to_training.yaml: synthetic data → features → a trained MLP.

    generate  each rank makes its share of transactions and users (seeded by (seed, rank))
    features  per-user aggregates of the transactions joined with the users table: one row a user
    train     a small MLP predicting ``churned`` from those features, DDP over the gang

The data has a hidden per-user trait: active, big-spending users churn less.  The features
see the trait only through the transactions, so the model has something real to learn.
"""

from __future__ import annotations

import datetime as dt
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import phalanx as px

CATEGORIES = ["grocery", "electronics", "fashion", "travel", "home", "games"]
COUNTRIES = ["US", "DE", "FR", "GB", "IN", "BR", "JP", "NG"]
TX_START = dt.datetime(2024, 1, 1)  # transactions fall in 2024
SIGNUP_START = dt.date(2019, 1, 1)  # users signed up in 2019–2023
NULL_AMOUNT = 0.03  # share of transactions with a missing amount
NULL_CATEGORY = 0.02
NULL_AGE = 0.05
YEAR_S = 365.25 * 86400

# The columns the model trains on (all float32, no nulls) and its label.
FEATURES = [
    "n_tx_log",
    "total_log",
    "avg_log",
    "max_log",
    "weekend_share",
    "online_share",
    "refund_share",
    "active_years",
    "tenure_years",
    "age_scaled",
    "age_missing",
]
LABEL = "label"


def _share(total: int, rank: int, world: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of ``total`` that ``rank`` makes: contiguous, near-equal."""
    return total * rank // world, total * (rank + 1) // world


def user_traits(users: int, seed: int) -> np.ndarray:
    """The hidden trait in [0, 1) of every user: the same on every rank (seeded by seed only)."""
    return np.random.default_rng([seed, 1 << 20]).random(users)


def make_transactions(rows: int, users: int, seed: int, rank: int, world: int) -> pa.Table:
    """Rank ``rank``'s transactions: a pure function of its arguments."""
    lo, hi = _share(rows, rank, world)
    n = hi - lo
    rng = np.random.default_rng([seed, rank])
    trait = user_traits(users, seed)
    weight = 0.25 + trait  # active users buy more often
    user_id = rng.choice(users, size=n, p=weight / weight.sum()).astype(np.int64)
    t = trait[user_id]
    amount = np.round(np.exp(rng.normal(2.5 + 1.5 * t, 0.7)), 2)  # big spenders buy bigger
    seconds = rng.integers(0, 366 * 86400, n)
    category = rng.integers(0, len(CATEGORIES), n).astype(np.int32)
    online = rng.random(n) < 0.3 + 0.4 * t
    channel = np.where(online, np.where(rng.random(n) < 0.5, 1, 2), 0).astype(np.int32)
    refund = rng.random(n) < 0.06 - 0.04 * t
    base = int(TX_START.replace(tzinfo=dt.timezone.utc).timestamp())
    return pa.table(
        {
            "tx_id": pa.array(np.arange(lo, hi, dtype=np.int64)),
            "user_id": pa.array(user_id),
            "amount": pa.array(amount, mask=rng.random(n) < NULL_AMOUNT),
            "ts": pa.array(base + seconds, pa.int64()).cast(pa.timestamp("s")),
            "category": pa.DictionaryArray.from_arrays(
                pa.array(category, mask=rng.random(n) < NULL_CATEGORY), CATEGORIES
            ).cast(pa.string()),
            "channel": pa.DictionaryArray.from_arrays(channel, ["store", "web", "app"]).cast(pa.string()),
            "is_refund": pa.array(refund),
        }
    )


def make_users(users: int, seed: int, rank: int, world: int) -> pa.Table:
    """Rank ``rank``'s users (a contiguous range of ids), with the ``churned`` label."""
    lo, hi = _share(users, rank, world)
    n = hi - lo
    rng = np.random.default_rng([seed, rank, 1])  # (seed, rank), apart from the transactions
    t = user_traits(users, seed)[lo:hi]
    churn_p = 1 / (1 + np.exp(-(2.0 - 5.0 * t)))  # low-trait users churn
    signup = (np.datetime64(SIGNUP_START) + rng.integers(0, 5 * 365, n)).astype("datetime64[D]")
    return pa.table(
        {
            "user_id": pa.array(np.arange(lo, hi, dtype=np.int64)),
            "country": pa.DictionaryArray.from_arrays(
                rng.integers(0, len(COUNTRIES), n).astype(np.int32), COUNTRIES
            ).cast(pa.string()),
            "signup_date": pa.array(signup, pa.date32()),
            "age": pa.array(rng.integers(18, 81, n), pa.int64(), mask=rng.random(n) < NULL_AGE),
            "churned": pa.array(rng.random(n) < churn_p),
        }
    )


def generate(env):
    """params: rows (transactions in all), users (default rows // 20), seed."""
    rows = int(env.params.get("rows", 2_000_000))
    users = int(env.params.get("users", max(1, rows // 20)))
    seed = int(env.params.get("seed", 0))
    tx = make_transactions(rows, users, seed, env.rank, env.world_size)
    us = make_users(users, seed, env.rank, env.world_size)
    env.log.info("generated %d transactions and %d users", tx.num_rows, us.num_rows)
    return {"transactions": px.DataFrame.from_arrow(tx, env), "users": px.DataFrame.from_arrow(us, env)}


def _f(name: str) -> pc.Expression:
    return pc.field(name)


def _f64(name: str) -> pc.Expression:
    return pc.field(name).cast(pa.float64())


def _log1p(expr: pc.Expression) -> pc.Expression:
    return pc.ln(expr + 1.0)


def features(env):
    """Per-user features: aggregate the transactions by user, join the users, derive columns.

    Inputs: ``tx`` (the transactions, any partitioning) and ``users`` (hash-partitioned by
    user_id for this gang, so the join with the per-user aggregates — partitioned the same way
    by the groupby — moves no rows).  Users without transactions get no row.
    """
    tx = env.input("tx").assign(
        weekend=(pc.day_of_week(_f("ts")) >= 5).cast(pa.int64()),  # Mon=0 ... Sat=5, Sun=6
        online=(_f("channel") != "store").cast(pa.int64()),
        refund=_f("is_refund").cast(pa.int64()),
    )
    per_user = tx.groupby("user_id").agg(
        n_tx=("tx_id", "count"),
        total_amount=("amount", "sum"),  # nulls skipped; all-null → 0
        avg_amount=("amount", "mean"),  # all-null → null
        max_amount=("amount", "max"),
        n_weekend=("weekend", "sum"),
        n_online=("online", "sum"),
        n_refund=("refund", "sum"),
        first_ts=("ts", "min"),
        last_ts=("ts", "max"),
    )
    joined = per_user.merge(env.input("users"), on="user_id", how="inner")
    days = lambda name: _f(name).cast(pa.int64()).cast(pa.float64())  # noqa: E731
    out = joined.assign(
        n_tx_log=_log1p(_f64("n_tx")),
        total_log=_log1p(_f("total_amount")),
        avg_log=_log1p(pc.coalesce(_f("avg_amount"), pc.scalar(0.0))),
        max_log=_log1p(pc.coalesce(_f("max_amount"), pc.scalar(0.0))),
        weekend_share=_f64("n_weekend") / _f64("n_tx"),
        online_share=_f64("n_online") / _f64("n_tx"),
        refund_share=_f64("n_refund") / _f64("n_tx"),
        active_years=(days("last_ts") - days("first_ts")) / YEAR_S,
        tenure_years=(days("last_ts") / 86400.0 - _f("signup_date").cast(pa.int32()).cast(pa.float64())) / 365.25,
        age_scaled=pc.coalesce(_f64("age"), pc.scalar(40.0)) / 100.0,
        age_missing=_f("age").is_null().cast(pa.float64()),
        label=_f("churned").cast(pa.float32()),
    )
    out = out.assign(**{c: _f(c).cast(pa.float32()) for c in FEATURES})
    # The groupby and the join emit a partition's rows in no fixed order (it depends on which
    # peer's rows arrived first); sorted by user_id, in one record batch, the partition is the
    # same bytes on every run — the store's checksums then match from run to run and the
    # trainer's global permutation draws the same rows.  Rows stay on their rank, so the frame
    # keeps its hash partitioning by user_id.
    local = out.to_arrow().sort_by([("user_id", "ascending")]).combine_chunks()
    out = px.DataFrame(local, env, out.partitioned_by)
    env.log.info("%d users here", out.local_num_rows)
    return {"features": out}


def _mlp(inputs: int, hidden: int):
    import torch

    return torch.nn.Sequential(
        torch.nn.Linear(inputs, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 1),
        torch.nn.Flatten(0),
    )


def train(env):
    """Binary classifier of ``label`` (churned) on FEATURES with px.ml.loader + px.ml.ddp.

    Input ``data``: the features dataset (read by the loader: a new global permutation per
    epoch).  params: epochs, batch_size, lr, hidden, seed, keep_checkpoints.  Seals
    ``train_metrics`` (one row per epoch: loss, accuracy, rows_seen over all ranks) when the
    stage declares it.  The seconds an epoch took go to the log (``epoch N: ... 1.2s``), not
    into the dataset: the sealed metrics are a pure function of the data and the params, so two
    runs of the workflow seal byte-identical datasets (the run database times every stage
    besides).

    Every epoch ends with a checkpoint (``px.ml.Checkpoints``: model, optimizer, the metrics so
    far) sealed in the run's session, so a retried attempt or ``phalanx run --resume``
    continues at the next epoch.  A resumed run seals the same metrics as one never
    interrupted: the model's initial weights are seeded, the loader's order depends only on
    (seed, epoch), Adam's state comes back exactly and Gloo's sum of two ranks' gradients does
    not depend on how DDP buckets them.  Once the outputs are sealed the checkpoints are
    removed (``keep_checkpoints: true`` keeps the last ones: ``px.ml.load_checkpoint``).
    """
    import torch

    p = env.params
    epochs, batch_size = int(p.get("epochs", 3)), int(p.get("batch_size", 1024))
    lr, hidden = float(p.get("lr", 3e-3)), int(p.get("hidden", 32))
    spec = env.inputs["data"]
    torch.manual_seed(int(p.get("seed", 0)))
    # DDP on the rank's device (its GPU where it has one: NCCL if every rank has, else Gloo)
    model = px.ml.ddp(env, _mlp(len(FEATURES), hidden))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    ckpt = px.ml.Checkpoints(env, every=1)  # <stage>.ckpt.<epoch> in the run's session
    start = ckpt.restore(model, opt)  # 0, or the epochs a previous attempt finished
    history = list(ckpt.extra.get("history", []))
    if start:
        env.log.info("resuming from checkpoint %s: epoch %d of %d", ckpt.restored, start, epochs)
    with px.ml.loader(
        env,
        spec["dataset"],
        features=FEATURES,
        label=LABEL,
        batch_size=batch_size,
        shuffle="global",
        seed=spec.get("seed", 0),
        device=model.px_device,  # batches on the model's device (the CPU: as before)
    ) as loader:
        for epoch in range(start, epochs):
            loader.set_epoch(epoch)  # a new global permutation
            t0 = time.perf_counter()
            total, count, correct = 0.0, 0, 0
            for x, y in loader:
                opt.zero_grad()
                logits = model(x)
                loss = loss_fn(logits, y)
                loss.backward()  # gradients averaged over the ranks
                opt.step()
                total += loss.item() * len(y)
                count += len(y)
                correct += int(((logits > 0) == (y > 0.5)).sum())
            count = int(env.comm.allreduce_scalar(count))
            row = {
                "epoch": epoch,
                "loss": env.comm.allreduce_scalar(total) / count,
                "accuracy": env.comm.allreduce_scalar(correct) / count,
                "rows_seen": count,
            }
            history.append(row)
            env.log.info(
                "epoch %d: loss %.4f accuracy %.3f (%d rows, %.1fs)",
                epoch,
                row["loss"],
                row["accuracy"],
                count,
                time.perf_counter() - t0,
            )
            ckpt.save(epoch + 1, model, opt, history=history)
    if "train_metrics" in env.outputs:
        schema = pa.schema(
            [("epoch", pa.int64()), ("loss", pa.float64()), ("accuracy", pa.float64()), ("rows_seen", pa.int64())]
        )
        table = pa.Table.from_pylist(history, schema) if env.rank == 0 else schema.empty_table()
        env.output("train_metrics", px.DataFrame.from_arrow(table, env))
    if not p.get("keep_checkpoints", False):
        ckpt.clear()  # the outputs are sealed: a resume reuses them, not the checkpoints
