"""px.ml: the store loader (rows per rank, batches, dtypes, prefetch) and DDP on a gang's Gloo group.

The row assignment is checked against torch's own DistributedSampler and, independently, by
counting the ids every rank yielded; DDP gradients against a full-batch gradient on the driver.
"""

from __future__ import annotations

import collections
import gc
import importlib.util
import shutil
import subprocess
import sys
import threading
import types
import warnings

import numpy as np
import pyarrow as pa
import pytest
import torch
from torch.utils.data import DistributedSampler

import phalanx as px
from phalanx.runtime.env import BSPEnv

SESSION = "ml-tests"
N = 1003  # divisible by none of 2, 3, 4: every multi-rank gang pads (or trims)
B = 64
NREG = 1200  # divisible by 1..4: equal shares, so DDP's mean of means is the full mean

pytestmark = pytest.mark.torch  # the torch extra's lane


def table_ids() -> pa.Table:
    ids = np.arange(N)
    return pa.table({"id": ids, "a": (ids * 2).astype(np.float32), "b": (ids % 7).astype(np.int16)})


def regression(n: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)).astype(np.float32)
    y = np.sin(x[:, 0]) + x[:, 1] * x[:, 2] + 0.5 * x[:, 2]
    return pa.table({"x0": x[:, 0], "x1": x[:, 1], "x2": x[:, 2], "y": y.astype(np.float32)})


def table_types(n: int = 400) -> pa.Table:
    rng = np.random.default_rng(2)
    return pa.table(
        {
            "i8": pa.array(rng.integers(-100, 100, n), pa.int8()),
            "u16": pa.array(rng.integers(0, 60000, n), pa.uint16()),
            "i32": pa.array(rng.integers(-(10**6), 10**6, n), pa.int32()),
            "i64": pa.array(rng.integers(-(10**6), 10**6, n), pa.int64()),
            "f16": pa.array(rng.normal(size=n).astype(np.float16)),
            "f64": pa.array(rng.normal(size=n)),
            "flag": pa.array(rng.random(n) < 0.5),
            "cls": pa.array(rng.integers(0, 5, n), pa.int32()),
            "nulls": pa.array(rng.normal(size=n), mask=np.arange(n) % 50 == 0),
            "text": pa.array([f"s{i}" for i in range(n)]),
        }
    )


FEATURES = ["i8", "u16", "i32", "i64", "f16", "f64", "flag"]


@pytest.fixture(scope="module")
def store():
    s = px.Store(session=SESSION)
    t = table_ids()
    # three uneven partitions, the middle one written as two record batches
    s.put("ids", [t.slice(0, 400), pa.concat_tables([t.slice(400, 100), t.slice(500, 300)]), t.slice(800)])
    reg = regression(NREG)
    s.put("reg", [reg.slice(0, 500), reg.slice(500)])
    s.put("mlp", regression(8192, seed=1))
    s.put("types", table_types())
    yield s
    s.delete_session()


# ---- apps (module level: ranks import them from this file) ---------------------------------
def app_ids(env, epochs, kwargs):
    ld = px.ml.loader(env, "ids", ["a", "b"], label="id", session=SESSION, **kwargs)
    out = []
    for e in epochs:
        ld.set_epoch(e)
        batches = [(x.numpy().copy(), y.numpy().copy()) for x, y in ld]
        for x, y in batches:  # the features belong to the label's row
            assert np.array_equal(x[:, 0], y * 2) and np.array_equal(x[:, 1], y % 7)
        out.append([y for _, y in batches])
    return out, len(ld), ld.num_samples


def run_ids(gang, epochs, **kwargs):
    """Per rank, per epoch: the id batches."""
    results = gang.run(app_ids, epochs, kwargs)
    for batches, n, _ in results:
        assert all(len(epoch) == n for epoch in batches)
    return [r[0] for r in results], results[0][1]


def sampler_rows(world, rank, epoch, seed, drop_last):
    s = DistributedSampler(range(N), num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=drop_last)
    s.set_epoch(epoch)
    return np.array(list(s))


# ---- which rows ----------------------------------------------------------------------------
@pytest.mark.parametrize("drop_last", [False, True], ids=["keep", "drop_last"])
def test_global_shuffle_covers_every_row_once_per_epoch(gang, store, drop_last):
    W = gang.world_size
    ranks, nbatches = run_ids(gang, [0, 1, 0], batch_size=B, shuffle="global", seed=5, drop_last=drop_last)
    per = N // W if drop_last else -(-N // W)
    if drop_last:
        per = per // B * B
    assert nbatches == -(-per // B)  # every rank the same number of batches
    for epoch in range(3):
        sizes = [[len(b) for b in r[epoch]] for r in ranks]
        assert all(s == sizes[0] for s in sizes)
        assert all(n == B for n in sizes[0][:-1]) and 0 < sizes[0][-1] <= B
        assert not drop_last or sizes[0][-1] == B
        ids = np.concatenate([np.concatenate(r[epoch]) for r in ranks])
        counts = collections.Counter(ids.tolist())
        if drop_last:  # disjoint shares, only full batches: some rows skipped this epoch
            assert max(counts.values()) == 1 and len(ids) == W * per
        else:  # every row, and the padding (ceil(N/W)*W - N rows) a second time
            assert set(counts) == set(range(N))
            assert len(ids) == per * W and sum(c - 1 for c in counts.values()) == per * W - N
    for rank, r in enumerate(ranks):  # the same rows, in the same order, as DistributedSampler
        for epoch, e in [(0, 0), (1, 1), (2, 0)]:
            expected = sampler_rows(W, rank, e, 5, drop_last)[:per]
            assert np.array_equal(np.concatenate(r[epoch]), expected), (rank, epoch)
    first, second, again = (np.concatenate([np.concatenate(r[e]) for r in ranks]) for e in range(3))
    assert not np.array_equal(first, second)  # a new permutation each epoch
    assert np.array_equal(first, again)  # deterministic for (seed, epoch)


def test_global_shuffle_depends_on_the_seed(gang, store):
    a, _ = run_ids(gang, [0], batch_size=B, seed=1)
    b, _ = run_ids(gang, [0], batch_size=B, seed=2)
    assert not np.array_equal(np.concatenate(a[0][0]), np.concatenate(b[0][0]))


@pytest.mark.parametrize("drop_last", [False, True], ids=["keep", "drop_last"])
def test_local_and_in_order_shares(gang, store, drop_last):
    W = gang.world_size
    per = N // W if drop_last else -(-N // W)
    local, _ = run_ids(gang, [0, 1], batch_size=B, shuffle="local", seed=3, drop_last=drop_last)
    ordered, _ = run_ids(gang, [0, 1], batch_size=B, shuffle=None, drop_last=drop_last)
    kept = per // B * B if drop_last else per
    for rank in range(W):
        block = np.arange(rank * per, (rank + 1) * per) % N  # contiguous, the last wraps around
        for epoch in range(2):
            got = np.concatenate(ordered[rank][epoch])
            assert np.array_equal(got, block[:kept])
            mine = np.concatenate(local[rank][epoch])
            assert len(mine) == kept and set(mine) <= set(block)
            if not drop_last:
                assert np.array_equal(np.sort(mine), np.sort(block))
        e0, e1 = (np.concatenate(local[rank][e]) for e in range(2))
        assert not np.array_equal(e0, e1) and not np.array_equal(e0, block[:kept])
    again, _ = run_ids(gang, [0], batch_size=B, shuffle="local", seed=3, drop_last=drop_last)
    assert all(np.array_equal(np.concatenate(again[r][0]), np.concatenate(local[r][0])) for r in range(W))


@pytest.mark.parametrize("batch_size", [1, 7, 300, 5000])
def test_batch_sizes_and_drop_last(gang, store, batch_size):
    W = gang.world_size
    for drop_last in (False, True):
        ranks, n = run_ids(gang, [0], batch_size=batch_size, shuffle=None, drop_last=drop_last)
        per = N // W if drop_last else -(-N // W)
        full, rest = divmod(per, batch_size)
        assert n == (full if drop_last else full + (rest > 0))
        sizes = [len(b) for b in ranks[0][0]]
        expected = [batch_size] * full + ([] if drop_last or rest == 0 else [rest])
        assert sizes == expected


# ---- chunks, prefetch, restarts ----------------------------------------------------------
def app_chunked(env, kwargs):
    ld = px.ml.loader(env, "ids", ["a"], label="id", batch_size=B, session=SESSION, **kwargs)
    epochs = []
    for e in range(3):
        ld.set_epoch(e)
        epochs.append(np.concatenate([y.numpy() for _, y in ld]))
    ld.set_epoch(1)
    for i, _ in enumerate(ld):  # leave an epoch half-way...
        if i == 2:
            break
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restarted = np.concatenate([y.numpy() for _, y in ld])  # ...then iterate it again
        assert not caught  # epoch 1 had not been finished this time round: no warning
        again = np.concatenate([y.numpy() for _, y in ld])  # no set_epoch: the same order, a warning
    assert np.array_equal(again, restarted)
    assert [str(w.message) for w in caught] == [
        "px.ml.loader: epoch 1 iterated again with the same order; call loader.set_epoch(epoch) "
        "before each epoch for a new permutation"
    ]
    chunks = ld.stats["chunks"]
    del ld
    gc.collect()
    threads = [t.name for t in threading.enumerate() if t.name == "phalanx-ml-loader"]
    return epochs, restarted, chunks, threads


@pytest.mark.parametrize("gang", [2], indirect=True)
def test_chunks_and_prefetch_give_the_same_batches(gang, store):
    reference = gang.run(app_chunked, {"prefetch": 0})
    row_bytes = 4 + 8  # a float32 feature, an int64 label
    for kwargs in ({"prefetch": 1}, {"prefetch": 3, "chunk_bytes": 1}, {"prefetch": 0, "chunk_bytes": 2000}):
        got = gang.run(app_chunked, kwargs)
        for (ep_ref, _, _, _), (ep, restarted, chunks, threads) in zip(reference, got):
            assert all(np.array_equal(a, b) for a, b in zip(ep_ref, ep))
            assert np.array_equal(restarted, ep_ref[1])
            assert threads == []  # dropping the loader stops its prefetch thread
            chunk_rows = max(B, kwargs.get("chunk_bytes", 1 << 28) // row_bytes // B * B)
            assert chunks == -(-len(ep_ref[0]) // chunk_rows)


# ---- dtypes and errors -----------------------------------------------------------------------
def app_types(env, features, label, kwargs):
    ld = px.ml.loader(env, "types", features, label=label, shuffle=None, batch_size=64, session=SESSION, **kwargs)
    batches = list(ld)
    if label is None:
        return [b.clone() for b in batches]
    return [b[0].clone() for b in batches], [b[1].clone() for b in batches]


@pytest.mark.parametrize("gang", [2], indirect=True)
def test_dtype_conversion(gang, store):
    t = table_types()
    cols = np.column_stack([t[c].to_numpy(zero_copy_only=False).astype(np.float64) for c in FEATURES])

    def whole(results, part=None):
        return torch.cat([torch.cat(r if part is None else r[part]) for r in results])

    res = gang.run(app_types, FEATURES, "cls", {})
    x, y = whole(res, 0), whole(res, 1)
    assert x.dtype == torch.float32 and x.shape == (400, len(FEATURES))
    assert torch.equal(x, torch.from_numpy(cols.astype(np.float32)))
    assert y.dtype == torch.int64 and torch.equal(y, torch.from_numpy(t["cls"].to_numpy().astype(np.int64)))

    res = gang.run(app_types, FEATURES, "f64", {"dtype": torch.float64})
    x, y = whole(res, 0), whole(res, 1)
    assert x.dtype == y.dtype == torch.float64
    assert torch.equal(x, torch.from_numpy(cols)) and torch.equal(y, torch.from_numpy(t["f64"].to_numpy().copy()))

    res = gang.run(app_types, ["f64", "i32"], "flag", {"dtype": torch.bfloat16, "label_dtype": torch.float32})
    x, y = whole(res, 0), whole(res, 1)
    assert x.dtype == torch.bfloat16 and torch.equal(x, torch.from_numpy(cols[:, [5, 2]]).to(torch.bfloat16))
    flag = t["flag"].to_numpy(zero_copy_only=False).astype(np.float32)
    assert y.dtype == torch.float32 and torch.equal(y, torch.from_numpy(flag))

    res = gang.run(app_types, "i8", None, {"dtype": torch.int16})  # no label: x alone
    x = whole(res)
    assert x.dtype == torch.int16 and x.shape == (400, 1)
    assert torch.equal(x[:, 0], torch.from_numpy(t["i8"].to_numpy().astype(np.int16)))


def app_errors(env):
    messages = []
    for features, label, kwargs in [
        (["f64", "nulls"], None, {}),
        (["f64"], "text", {}),
        (["missing"], None, {}),
        (["f64"], None, {"shuffle": "random"}),
        (["f64"], None, {"batch_size": 0}),
        (["f64"], None, {"dtype": np.float32}),
    ]:
        try:
            px.ml.loader(env, "types", features, label=label, session=SESSION, **kwargs)
            messages.append(None)
        except Exception as exc:  # raised the same way on every rank: no collective left open
            messages.append(f"{type(exc).__name__}: {exc}")
    try:
        px.ml.loader(env, "no-such-dataset", ["x"], session=SESSION)
    except Exception as exc:
        messages.append(f"{type(exc).__name__}: {exc}")
    return messages


@pytest.mark.parametrize("gang", [2], indirect=True)
def test_bad_columns_and_arguments_name_the_problem(gang, store):
    nulls, text, missing, shuffle, batch, dtype, dataset = gang.run(app_errors)[0]
    assert nulls.startswith("ValueError") and "column 'nulls' has 8 null(s)" in nulls
    assert text.startswith("TypeError") and "label column 'text'" in text and "string" in text
    assert missing.startswith("ValueError") and "no feature column 'missing'" in missing
    assert "shuffle must be 'global', 'local' or None" in shuffle
    assert "batch_size must be an integer ≥ 1" in batch
    assert "dtype must be a torch dtype" in dtype
    assert dataset.startswith("DatasetNotFoundError") and "no-such-dataset" in dataset


# ---- DDP ------------------------------------------------------------------------------------
class Net(torch.nn.Module):
    def __init__(self, hidden: int = 16):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(3, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))

    def forward(self, x):
        return self.body(x).squeeze(1)


def app_ddp_grads(env):
    torch.manual_seed(100 + env.rank)  # different on every rank: DDP must start from rank 0's
    net = Net()
    model = px.ml.ddp(env, net)
    ld = px.ml.loader(
        env, "reg", ["x0", "x1", "x2"], label="y", batch_size=NREG, shuffle="global", seed=4, session=SESSION
    )
    ((x, y),) = list(ld)  # the rank's whole share as one batch
    torch.nn.functional.mse_loss(model(x), y).backward()
    grads = [p.grad.numpy().copy() for p in net.parameters()]
    return {k: v.clone() for k, v in net.state_dict().items()}, env.comm.allgather_obj(grads)


def test_ddp_gradients_agree_and_equal_the_full_batch_gradient(gang, store):
    results = gang.run(app_ddp_grads)
    state = results[0][0]
    for st, _ in results:  # everyone holds rank 0's initial weights
        assert all(torch.equal(st[k], state[k]) for k in state)
    gathered = results[0][1]
    for grads in gathered[1:]:  # identical (averaged) gradients on every rank
        assert all(np.array_equal(a, b) for a, b in zip(gathered[0], grads))
    ref = Net()
    ref.load_state_dict(state)
    data = regression(NREG)
    x = torch.from_numpy(np.column_stack([data[c].to_numpy() for c in ("x0", "x1", "x2")]))
    y = torch.from_numpy(data["y"].to_numpy().copy())
    torch.nn.functional.mse_loss(ref(x), y).backward()
    for got, p in zip(gathered[0], ref.parameters()):
        np.testing.assert_allclose(got, p.grad.numpy(), rtol=1e-4, atol=1e-6)


def app_train(env, epochs):
    torch.manual_seed(0)
    model = px.ml.ddp(env, Net(32))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ld = px.ml.loader(env, "mlp", ["x0", "x1", "x2"], label="y", batch_size=128, seed=0, session=SESSION)
    losses = []
    for epoch in range(epochs):
        ld.set_epoch(epoch)
        total = count = 0.0
        for x, y in ld:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            total, count = total + loss.item() * len(y), count + len(y)
        losses.append(env.comm.allreduce_scalar(total) / env.comm.allreduce_scalar(count))
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("gang", [2], indirect=True)
def test_mlp_loss_decreases_on_two_ranks(gang, store):
    (losses, params0), (losses1, params1) = gang.run(app_train, 5)
    assert losses == losses1
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.3 * losses[0], losses
    assert all(torch.equal(a, b) for a, b in zip(params0, params1))  # replicas stayed in sync


def test_ddp_outside_a_gang_or_without_the_gloo_group_fails_clearly():
    model = Net()
    with pytest.raises(RuntimeError, match="needs the env of a gang rank"):
        px.ml.ddp(None, model)
    fake_gloo = BSPEnv(rank=0, world_size=1, comm=types.SimpleNamespace(name="gloo"))
    with pytest.raises(RuntimeError, match="process group is not initialised"):
        px.ml.ddp(fake_gloo, model)
    with pytest.raises(TypeError, match="wraps a torch.nn.Module, got str"):
        px.ml.ddp(fake_gloo, "not a model")


def app_ddp_step(env):
    """One DDP step from different initial weights: every rank ends with the same parameters,
    and torch's group is Gloo over exactly the gang's ranks."""
    import torch.distributed as dist

    torch.manual_seed(env.rank)
    net = Net()
    model = px.ml.ddp(env, net)
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(env.rank))
    torch.nn.functional.mse_loss(model(x), x.sum(1)).backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    again = px.ml.ddp(env, Net())  # a second model reuses the group
    return (
        [p.detach().numpy().copy() for p in net.parameters()],
        dist.get_backend(),
        dist.get_world_size(),
        isinstance(again, torch.nn.parallel.DistributedDataParallel),
    )


def _assert_ddp_step(results, ranks):
    params0 = results[0][0]
    for params, backend, world, wrapped in results:
        assert backend == "gloo" and world == ranks and wrapped
        assert all(np.array_equal(a, b) for a, b in zip(params0, params))


@pytest.mark.parametrize("communicator", ["tcp", "shm", "gloo"])
def test_ddp_on_every_communicator(communicator):
    """tcp/shm ranks hold no torch group until DDP asks for one; gloo's is reused."""
    with px.Gang(ranks=2, communicator=communicator, echo=False) as g:
        _assert_ddp_step(g.run(app_ddp_step), 2)


@pytest.mark.skipif(
    shutil.which("mpirun") is None or importlib.util.find_spec("mpi4py") is None, reason="needs mpirun and mpi4py"
)
def test_ddp_on_an_mpi_gang():
    with px.Gang(ranks=2, communicator="mpi", executor="mpirun", echo=False) as g:
        _assert_ddp_step(g.run(app_ddp_step), 2)


def test_import_phalanx_does_not_import_torch():
    code = (
        "import sys, phalanx as px; assert 'torch' not in sys.modules; "
        "assert callable(px.ml.loader) and callable(px.ml.ddp); assert 'torch' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- another run's dataset by its SESSION/NAME (as a stage's inputs name it) -----------------
def app_ids_by_reference(env):
    """The same batches from ``SESSION/ids`` as from ``ids`` with ``session=``."""
    a = px.ml.loader(env, f"{SESSION}/ids", ["a", "b"], label="id", shuffle=None, batch_size=B)
    b = px.ml.loader(env, "ids", ["a", "b"], label="id", shuffle=None, batch_size=B, session=SESSION)
    return [y.numpy().tolist() for _, y in a], [y.numpy().tolist() for _, y in b]


def test_a_dataset_of_another_session_is_named_session_slash_name(gang, store):
    for by_ref, by_arg in gang.run(app_ids_by_reference):
        assert by_ref == by_arg and sum(map(len, by_ref)) > 0
