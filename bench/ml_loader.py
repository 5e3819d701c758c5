#!/usr/bin/env python
"""Loader benchmark: ``px.ml.loader`` against a plain torch DataLoader over pandas, per rank.

    .venv/bin/python bench/ml_loader.py                  # 4M rows, 16 float32 features, 2 ranks
    .venv/bin/python bench/ml_loader.py --quick          # 1M rows, 2 epochs
    .venv/bin/python bench/ml_loader.py --rows 8000000 --ranks 4 --epochs 5

Data: ``--rows`` rows of ``--features`` float32 features and a float32 label ``y``, put in the
store (one partition per rank) and written to one Parquet file.  Both sides run on the same
gang, iterate every batch of their share without training, global shuffle, ``--batch-size``:

- phalanx: ``px.ml.loader(env, name, features, label="y", shuffle="global")``, ``set_epoch``
  each epoch.  With no training step to hide it behind, an epoch costs about what building its
  matrix costs (the prefetch thread only gets ahead while a rank waits at the epoch barrier);
  epoch 0 also pays the first touch of the memory-mapped files.
- torch: each rank ``pandas.read_parquet`` → ``TensorDataset`` of the frame's values →
  ``DataLoader(batch_size, sampler=DistributedSampler(shuffle=True))`` (the gang's version of
  ``shuffle=True``; the same rows per rank as phalanx), ``num_workers=0``.  Setup (read,
  conversion) is reported apart and not counted in rows/s.
- pandas: a map-style ``Dataset`` whose ``__getitem__`` indexes the frame (``df.iloc[i]``),
  same DataLoader; only ``--pandas-batches`` batches (it is slow).

rows/s per rank = rows a rank yielded / seconds it spent iterating, averaged over ranks; the
ratio compares phalanx's steady epochs with torch's.  Results also go to
bench/out/ml_loader-<timestamp>.json.

Feeding a device (``--device cuda``, default cuda where there is one, else cpu; ``--device-only``
skips the comparison above), one rank, the same rows and the same MLP on both sides:

- phalanx: ``px.ml.loader(..., device=device)`` (pinned chunks, async copies on a side stream);
- torch: ``DataLoader(TensorDataset, batch_size, sampler=DistributedSampler(shuffle=True),
  pin_memory=<on a GPU>, num_workers=--workers)``, each batch ``.to(device, non_blocking=True)``.

Two numbers each: rows/s of iterating the batches on the device (synchronised at the epoch's
end), and the time of a training step (forward, backward, Adam) per batch, epochs after the first.
On the CPU this exercises the code path; the GPU numbers are the ones that matter.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import phalanx as px

HERE = Path(__file__).resolve().parent


def make_table(rows: int, features: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    x = rng.random((rows, features), dtype=np.float32)
    cols = {f"f{i}": x[:, i] for i in range(features)}
    cols["y"] = x.sum(axis=1, dtype=np.float32)
    return pa.table(cols)


def timed_epochs(env, batches, set_epoch, epochs: int, extra=lambda: ()) -> list[tuple]:
    """Per epoch: (rows seen, seconds, *extra()) with every rank starting together."""
    out = []
    for epoch in range(epochs):
        set_epoch(epoch)
        env.comm.barrier()
        rows = 0
        t = time.perf_counter()
        for x, _ in batches:
            rows += len(x)
        out.append((rows, time.perf_counter() - t, *extra()))
    return out


def app_phalanx(env, session: str, name: str, features: list[str], batch_size: int, epochs: int):
    t0 = time.perf_counter()
    ld = px.ml.loader(env, name, features, label="y", batch_size=batch_size, shuffle="global", seed=0, session=session)
    setup = time.perf_counter() - t0
    out = timed_epochs(env, ld, ld.set_epoch, epochs, extra=lambda: (ld.stats["build_s"],))
    ld.close()
    return setup, out


def app_torch(env, parquet: str, features: list[str], batch_size: int, epochs: int, pandas_batches: int):
    import pandas as pd
    import torch
    from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

    t0 = time.perf_counter()
    df = pd.read_parquet(parquet)
    x = torch.from_numpy(df[features].to_numpy(dtype=np.float32))
    y = torch.from_numpy(df["y"].to_numpy(dtype=np.float32))
    setup = time.perf_counter() - t0
    ds = TensorDataset(x, y)
    sampler = DistributedSampler(ds, num_replicas=env.world_size, rank=env.rank, shuffle=True, seed=0)
    dl = DataLoader(ds, batch_size=batch_size, sampler=sampler)
    out = timed_epochs(env, dl, sampler.set_epoch, epochs)

    class PandasRows(Dataset):
        def __len__(self):
            return len(df)

        def __getitem__(self, i):
            row = df.iloc[i]
            return torch.tensor(row[features].to_numpy(dtype=np.float32)), torch.tensor(np.float32(row["y"]))

    pandas = None
    if pandas_batches:
        sampler = DistributedSampler(PandasRows(), num_replicas=env.world_size, rank=env.rank, shuffle=True, seed=0)
        env.comm.barrier()
        rows = 0
        t = time.perf_counter()
        for i, (xb, _yb) in enumerate(DataLoader(PandasRows(), batch_size=batch_size, sampler=sampler)):
            rows += len(xb)
            if i + 1 == pandas_batches:
                break
        pandas = (rows, time.perf_counter() - t)
    return setup, out, pandas


def bench_loader(
    rows: int = 4_000_000,
    features: int = 16,
    ranks: int = 2,
    batch_size: int = 1024,
    epochs: int = 3,
    pandas_batches: int = 20,
) -> dict:
    """Run both loaders on one gang; returns the numbers (also printed)."""
    names = [f"f{i}" for i in range(features)]
    table = make_table(rows, features)
    store = px.Store(session=f"bench-ml-{os.getpid()}-{int(time.time())}")
    tmp = tempfile.mkdtemp(prefix="phalanx-bench-ml-")
    parquet = os.path.join(tmp, "data.parquet")
    try:
        bounds = [rows * i // ranks for i in range(ranks + 1)]
        store.put("features", [table.slice(bounds[i], bounds[i + 1] - bounds[i]) for i in range(ranks)])
        pq.write_table(table, parquet)
        del table
        with px.Gang(ranks=ranks, echo=False, store=store.root, session=store.session) as gang:
            ph = gang.run(app_phalanx, store.session, "features", names, batch_size, epochs)
            th = gang.run(app_torch, parquet, names, batch_size, epochs, pandas_batches)
    finally:
        store.delete_session()
        for f in Path(tmp).iterdir():
            f.unlink()
        os.rmdir(tmp)

    def per_rank(runs, epoch):  # mean over ranks of rows/s in one epoch
        return statistics.mean(r[epoch][0] / r[epoch][1] for r in runs)

    ph_epochs = [per_rank([r[1] for r in ph], e) for e in range(epochs)]
    th_epochs = [per_rank([r[1] for r in th], e) for e in range(epochs)]
    ph_steady = statistics.mean(ph_epochs[1:]) if epochs > 1 else ph_epochs[0]
    th_mean = statistics.mean(th_epochs)
    build = statistics.mean(sum(e[0] for e in r[1]) / sum(e[2] for e in r[1]) for r in ph)
    pandas = None
    if pandas_batches:
        pandas = statistics.mean(r[2][0] / r[2][1] for r in th)
    result = {
        "rows": rows,
        "features": features,
        "ranks": ranks,
        "batch_size": batch_size,
        "epochs": epochs,
        "phalanx_rows_per_s_per_rank_by_epoch": ph_epochs,
        "phalanx_rows_per_s_per_rank": ph_steady,
        "phalanx_build_rows_per_s": build,
        "phalanx_setup_s": statistics.mean(r[0] for r in ph),
        "torch_rows_per_s_per_rank_by_epoch": th_epochs,
        "torch_rows_per_s_per_rank": th_mean,
        "torch_setup_s": statistics.mean(r[0] for r in th),
        "pandas_dataset_rows_per_s_per_rank": pandas,
        "ratio": ph_steady / th_mean,
        "ratio_epoch0": ph_epochs[0] / th_mean,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
    }
    print(
        f"\n## loader throughput: {rows:,} rows × {features} float32 features, {ranks} ranks, "
        f"batch {batch_size}, global shuffle, {os.cpu_count()} CPUs"
    )
    print(f"{'loader':<52} {'rows/s per rank':>16}")
    for e, v in enumerate(ph_epochs):
        note = " (cold: first touch of the mapped files)" if e == 0 else ""
        print(f"{f'px.ml.loader epoch {e}{note}':<52} {v:>16,.0f}")
    print(f"{'px.ml.loader matrix build alone (background thread)':<52} {build:>16,.0f}")
    print(
        f"{'torch DataLoader(TensorDataset from pandas)':<52} {th_mean:>16,.0f}   "
        f"(epochs: {', '.join(f'{v:,.0f}' for v in th_epochs)})"
    )
    if pandas is not None:
        print(f"{'torch DataLoader(Dataset indexing pandas .iloc)':<52} {pandas:>16,.0f}   ({pandas_batches} batches)")
    print(
        f"setup: px.ml.loader {result['phalanx_setup_s']:.3f} s (open + collective checks); "
        f"torch {result['torch_setup_s']:.3f} s (read_parquet + tensors)"
    )
    print(
        f"ratio px.ml.loader / torch DataLoader: {result['ratio']:.1f}x steady, {result['ratio_epoch0']:.1f}x epoch 0"
    )
    return result


def _mlp(features: int, hidden: int):
    import torch

    return torch.nn.Sequential(
        torch.nn.Linear(features, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 1),
    )


def _device_epochs(env, device, make_batches, set_epoch, epochs: int, train: bool, hidden: int, features: int):
    """Per epoch: (rows, seconds, batches); with ``train`` a step of the same MLP per batch."""
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    model = _mlp(features, hidden).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    out = []
    for epoch in range(epochs):
        set_epoch(epoch)
        sync()
        rows = batches = 0
        t = time.perf_counter()
        for x, y in make_batches():
            if train:
                opt.zero_grad(set_to_none=True)
                torch.nn.functional.mse_loss(model(x).squeeze(1), y).backward()
                opt.step()
            rows += len(x)
            batches += 1
        sync()
        out.append((rows, time.perf_counter() - t, batches))
    return out


def app_device(env, session, name, features, batch_size, epochs, device, workers, hidden, parquet):
    import pandas as pd
    import torch
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    dev = torch.device(device)
    ld = px.ml.loader(env, name, features, label="y", batch_size=batch_size, session=session, device=dev)
    df = pd.read_parquet(parquet)
    ds = TensorDataset(
        torch.from_numpy(df[features].to_numpy(dtype=np.float32)), torch.from_numpy(df["y"].to_numpy(np.float32))
    )
    sampler = DistributedSampler(ds, num_replicas=env.world_size, rank=env.rank, shuffle=True, seed=0)
    dl = DataLoader(
        ds,
        batch_size=batch_size,
        sampler=sampler,
        pin_memory=dev.type == "cuda",
        num_workers=workers,
        persistent_workers=workers > 0,
    )

    def torch_batches():
        for x, y in dl:
            yield x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)

    res = {}
    for train in (False, True):
        res[("phalanx", train)] = _device_epochs(
            env, dev, lambda: ld, ld.set_epoch, epochs, train, hidden, len(features)
        )
        res[("torch", train)] = _device_epochs(
            env, dev, torch_batches, sampler.set_epoch, epochs, train, hidden, len(features)
        )
    ld.close()
    return {f"{k[0]}_{'train' if k[1] else 'iterate'}": v for k, v in res.items()}


def bench_device(
    rows: int = 1_000_000,
    features: int = 16,
    batch_size: int = 1024,
    epochs: int = 3,
    device: str | None = None,
    workers: int = 2,
    hidden: int = 256,
) -> dict:
    """px.ml.loader(device=) vs DataLoader(pin_memory, num_workers) feeding the same MLP, one rank."""
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    names = [f"f{i}" for i in range(features)]
    table = make_table(rows, features)
    store = px.Store(session=f"bench-ml-dev-{os.getpid()}-{int(time.time())}")
    tmp = tempfile.mkdtemp(prefix="phalanx-bench-ml-")
    parquet = os.path.join(tmp, "data.parquet")
    try:
        store.put("features", table)
        pq.write_table(table, parquet)
        del table
        with px.Gang(ranks=1, echo=False, store=store.root, session=store.session) as gang:
            [res] = gang.run(
                app_device, store.session, "features", names, batch_size, epochs, device, workers, hidden, parquet
            )
    finally:
        store.delete_session()
        for f in Path(tmp).iterdir():
            f.unlink()
        os.rmdir(tmp)
    steady = slice(1, None) if epochs > 1 else slice(0, None)

    def rate(key):  # rows/s over the steady epochs
        e = res[key][steady]
        return sum(r for r, _, _ in e) / sum(s for _, s, _ in e)

    def step_ms(key):  # ms per batch over the steady epochs
        e = res[key][steady]
        return 1000 * sum(s for _, s, _ in e) / sum(b for _, _, b in e)

    result = {
        "device": device,
        "gpu": torch.cuda.get_device_name(0) if device.startswith("cuda") else None,
        "rows": rows,
        "features": features,
        "batch_size": batch_size,
        "epochs": epochs,
        "workers": workers,
        "hidden": hidden,
        "phalanx_iterate_rows_per_s": rate("phalanx_iterate"),
        "torch_iterate_rows_per_s": rate("torch_iterate"),
        "phalanx_train_step_ms": step_ms("phalanx_train"),
        "torch_train_step_ms": step_ms("torch_train"),
        "raw": res,
    }
    result["iterate_ratio"] = result["phalanx_iterate_rows_per_s"] / result["torch_iterate_rows_per_s"]
    result["train_step_ratio"] = result["torch_train_step_ms"] / result["phalanx_train_step_ms"]
    gpu_name = f" ({result['gpu']})" if result["gpu"] else ""
    pinned = device.startswith("cuda")
    print(
        f"\n## feeding {device}{gpu_name}: {rows:,} rows × {features} "
        f"float32, batch {batch_size}, 1 rank, MLP {features}-{hidden}-{hidden}-1, epochs after the first"
    )
    print(f"{'':<58} {'rows/s':>12} {'ms/step':>9}")
    print(
        f"{'px.ml.loader(device=)':<58} {result['phalanx_iterate_rows_per_s']:>12,.0f} "
        f"{result['phalanx_train_step_ms']:>9.3f}"
    )
    print(
        f"{f'DataLoader(pin_memory={pinned}, num_workers={workers}) + .to(non_blocking)':<58} "
        f"{result['torch_iterate_rows_per_s']:>12,.0f} {result['torch_train_step_ms']:>9.3f}"
    )
    print(
        f"ratio px.ml.loader / DataLoader: {result['iterate_ratio']:.1f}x rows/s iterating, "
        f"{result['train_step_ratio']:.2f}x training step time (DataLoader's / phalanx's)"
    )
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--features", type=int, default=16)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--pandas-batches", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="1M rows, 2 epochs")
    ap.add_argument(
        "--device", default=None, help="where the device comparison trains (default: cuda if any, else cpu)"
    )
    ap.add_argument("--workers", type=int, default=2, help="the DataLoader's num_workers in the device comparison")
    ap.add_argument("--hidden", type=int, default=256, help="the MLP's hidden width in the device comparison")
    ap.add_argument("--device-only", action="store_true", help="only the device comparison")
    args = ap.parse_args()
    if args.quick:
        args.rows, args.epochs = 1_000_000, 2
    result: dict = {}
    if not args.device_only:
        result = bench_loader(args.rows, args.features, args.ranks, args.batch_size, args.epochs, args.pandas_batches)
    result["device"] = bench_device(
        args.rows, args.features, args.batch_size, args.epochs, args.device, args.workers, args.hidden
    )
    out = HERE / "out"
    out.mkdir(exist_ok=True)
    path = out / f"ml_loader-{_dt.datetime.now():%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
