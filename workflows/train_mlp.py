"""Train a small MLP data-parallel on a gang: store dataset → px.ml.loader → px.ml.ddp.

    .venv/bin/python workflows/train_mlp.py [--ranks 2] [--rows 400000] [--epochs 5]

The driver puts a synthetic regression dataset in the store (a few partitions, as a previous
stage would have left it); every rank reads its share of a fresh global permutation each
epoch and trains a DDP replica; the driver then scores rank 0's model on rows it never saw.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import pyarrow as pa
import torch

import phalanx as px

SESSION = "train-mlp"
FEATURES = [f"x{i}" for i in range(8)]


def make_data(rows: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, len(FEATURES))).astype(np.float32)
    y = np.sin(2 * x[:, 0]) + x[:, 1] * x[:, 2] + 0.5 * x[:, 3] - 0.3 * x[:, 4] ** 2 + 0.1 * rng.normal(size=rows)
    return pa.table({**{f: x[:, i] for i, f in enumerate(FEATURES)}, "y": y.astype(np.float32)})


class MLP(torch.nn.Module):
    def __init__(self, inputs: int, hidden: int = 64):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(inputs, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(1)


def train(env, dataset: str, epochs: int, batch_size: int, lr: float):
    torch.manual_seed(0)
    model = px.ml.ddp(env, MLP(len(FEATURES)))  # DDP over the gang's Gloo group
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    loader = px.ml.loader(env, dataset, features=FEATURES, label="y", batch_size=batch_size, shuffle="global", seed=0)
    history = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)  # a new global permutation
        t0 = time.perf_counter()
        total, count = 0.0, 0
        for x, y in loader:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()  # gradients averaged over the ranks
            opt.step()
            total += loss.item() * len(y)
            count += len(y)
        seconds = time.perf_counter() - t0
        mean_loss = env.comm.allreduce_scalar(total) / env.comm.allreduce_scalar(count)
        s = loader.stats
        history.append(
            {"loss": mean_loss, "seconds": seconds, "rows": s["rows"], "build_s": s["build_s"], "wait_s": s["wait_s"]}
        )
    state = {k: v.clone() for k, v in model.module.state_dict().items()}
    return history, state if env.rank == 0 else None


def loader_only(env, dataset: str, epochs: int, batch_size: int):
    """Iterate the loader without training: how fast it can feed a rank."""
    loader = px.ml.loader(env, dataset, features=FEATURES, label="y", batch_size=batch_size)
    rows, t0 = 0, time.perf_counter()
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for x, _ in loader:
            rows += len(x)
    return rows / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rows", type=int, default=400_000)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()

    store = px.Store(session=SESSION)
    data = make_data(args.rows)
    cut = [args.rows * i // 3 for i in range(4)]  # three producer partitions, any gang size reads them
    store.put(
        "regression",
        [data.slice(cut[i], cut[i + 1] - cut[i]) for i in range(3)],
        replace=True,
        producer="train_mlp.make_data",
    )
    print(
        f"dataset 'regression': {args.rows:,} rows, {len(FEATURES)} features, "
        f"{store.info('regression').num_partitions} partitions in {store.root}"
    )
    try:
        with px.Gang(ranks=args.ranks, session=SESSION, echo=False) as gang:
            results = gang.run(train, "regression", args.epochs, args.batch_size, args.lr)
            feed = gang.run(loader_only, "regression", 3, args.batch_size)
    finally:
        store.delete_session()

    history = results[0][0]
    print(
        f"\n{'epoch':>5} {'train MSE':>10} {'epoch s':>8} {'rows/rank':>10} "
        f"{'loader build rows/s':>20} {'waited on loader s':>19}"
    )
    for e, h in enumerate(history):
        print(
            f"{e:>5} {h['loss']:>10.4f} {h['seconds']:>8.2f} {h['rows']:>10,} "
            f"{h['rows'] / max(h['build_s'], 1e-9):>20,.0f} {h['wait_s']:>19.3f}"
        )
    losses = [h["loss"] for h in history]
    print("\nloader alone (no training), rows/s per rank: " + ", ".join(f"{v:,.0f}" for v in feed))

    model = MLP(len(FEATURES))
    model.load_state_dict(results[0][1])
    test = make_data(20_000, seed=99)
    x = torch.from_numpy(np.column_stack([test[f].to_numpy() for f in FEATURES]))
    y = torch.from_numpy(test["y"].to_numpy().copy())
    with torch.no_grad():
        mse = torch.nn.functional.mse_loss(model(x), y).item()
    print(f"held-out MSE {mse:.4f} (variance of y {y.var().item():.4f})")
    if not losses[-1] < losses[0]:
        raise SystemExit(f"the training loss did not go down: {losses}")
    print("loss went down: " + " → ".join(f"{v:.4f}" for v in losses))


if __name__ == "__main__":
    main()
