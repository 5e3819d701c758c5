"""The communicator contract, once: every backend and world size passes the same tests.

A communicator's tests subclass ``CommContract`` and say which communicator it is; the mix-in
starts one gang per world size for the class::

    from phalanx.testing.communicator import CommContract

    class TestMyComm(CommContract):
        @pytest.fixture(scope="class")
        @classmethod
        def communicator(cls):
            return "mine"  # its name in phalanx.communicators (a registry line or an entry point)

Override ``world_size`` (class-scoped, parametrised: 1-4 ranks) or ``executor`` ("local";
"mpirun" for "mpi") to change the gangs, or ``comm_gang`` itself (a started ``px.Gang``) to
make them some other way, as tests/test_comm.py does for the built-in communicators.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest

import phalanx as px
from phalanx.testing.comm_apps import (
    ALLGATHER_KEY,
    BCAST_KEY,
    app_allgather_bytes,
    app_allreduce,
    app_alltoallv_large,
    app_alltoallv_slices_kept,
    app_barrier,
    app_broadcast_bytes,
    app_exchange,
    app_exchange_results_kept,
    app_exchange_wrong_length,
    app_identity,
    app_objects,
    big_size,
    payload,
    rank_array,
)

WORLD_SIZES = (1, 2, 3, 4)


class CommContract:
    """A communicator's contract; a subclass provides the ``communicator`` fixture (its name),
    or the ``comm_gang`` fixture (a started ``px.Gang`` on the communicator under test)."""

    @pytest.fixture(scope="class")
    @classmethod
    def communicator(cls) -> str:
        pytest.fail(f"{cls.__name__}: override the 'communicator' fixture (or 'comm_gang')")

    @pytest.fixture(scope="class", params=WORLD_SIZES, ids=lambda n: f"ranks{n}")
    @classmethod
    def world_size(cls, request: pytest.FixtureRequest) -> int:
        return request.param

    @pytest.fixture(scope="class")
    @classmethod
    def executor(cls, communicator: str) -> str:
        return "mpirun" if communicator == "mpi" else "local"  # MPI's ranks are MPI_COMM_WORLD

    @pytest.fixture(scope="class")
    @classmethod
    def comm_gang(cls, communicator: str, world_size: int, executor: str) -> Iterator[px.Gang]:
        """One started gang per world size for the class (starting one costs ~2 s)."""
        g = px.Gang(ranks=world_size, executor=executor, communicator=communicator, echo=False)
        g.start()
        yield g
        g.close()

    def test_identity(self, comm_gang):
        n = comm_gang.world_size
        results = comm_gang.run(app_identity)
        assert [r[:4] for r in results] == [(r, n, r, n) for r in range(n)]
        assert {r[4] for r in results} == {comm_gang.communicator}
        if comm_gang.communicator == "mpi":
            assert [r[6] for r in results] == [str(r) for r in range(n)]
        cpus = sorted(os.sched_getaffinity(0))
        if n <= len(cpus):  # pinned: disjoint, non-empty CPU sets (PHALANX_CPUS / _CPUS_BY_RANK)
            sets = [set(r[5]) for r in results]
            assert all(sets) and sum(map(len, sets)) == len(set().union(*sets))
            assert [r[8] for r in results] == [{tuple(r[5])} for r in results], "a thread off its rank's CPUs"
        # the rank's kernel-thread share sizes polars' pool (sized at import, before the app)
        assert [r[7][1] for r in results] == [r[7][0] for r in results]

    @pytest.mark.parametrize("sizes", ["small", "empty"])
    def test_exchange_uneven(self, comm_gang, sizes):
        assert comm_gang.run(app_exchange, sizes) == [[]] * comm_gang.world_size

    def test_exchange_large(self, comm_gang):
        assert comm_gang.run(app_exchange, "big") == [[]] * comm_gang.world_size

    def test_alltoallv_large(self, comm_gang):
        n = comm_gang.world_size
        for rank, (dtype, counts, problems) in enumerate(comm_gang.run(app_alltoallv_large)):
            assert dtype == "|u1"
            assert counts == [big_size(s, rank, n) for s in range(n)]
            assert problems == []

    def test_exchange_results_outlive_later_exchanges(self, comm_gang):
        assert comm_gang.run(app_exchange_results_kept, 8) == [[]] * comm_gang.world_size

    def test_alltoallv_results_outlive_later_alltoallvs(self, comm_gang):
        assert comm_gang.run(app_alltoallv_slices_kept, 6) == [[]] * comm_gang.world_size

    def test_exchange_wrong_length(self, comm_gang):
        msgs = comm_gang.run(app_exchange_wrong_length)
        assert all(m and "exchange needs" in m for m in msgs)

    @pytest.mark.parametrize("empty", [False, True])
    def test_allgather_bytes(self, comm_gang, empty):
        n = comm_gang.world_size
        want = [b"" if empty else bytes(payload(r, ALLGATHER_KEY, 100 * r)) for r in range(n)]
        assert comm_gang.run(app_allgather_bytes, empty) == [want] * n

    @pytest.mark.parametrize("nbytes", [0, 1, 3_000_001])
    def test_broadcast_bytes_from_last_rank(self, comm_gang, nbytes):
        root = comm_gang.world_size - 1  # non-zero whenever there is more than one rank
        want = bytes(payload(root, BCAST_KEY, nbytes))
        assert comm_gang.run(app_broadcast_bytes, root, nbytes) == [want] * comm_gang.world_size

    @pytest.mark.parametrize("dtype", ["int64", "float64", "int32", "float32"])
    @pytest.mark.parametrize("op", ["sum", "min", "max"])
    def test_allreduce(self, comm_gang, dtype, op):
        """The reduction keeps the dtype on every backend and at every world size."""
        stacked = np.stack([rank_array(r, dtype, op) for r in range(comm_gang.world_size)])
        want = {"sum": np.sum, "min": np.min, "max": np.max}[op](stacked, axis=0)
        results = comm_gang.run(app_allreduce, dtype, op)
        for got in results:
            assert got.dtype == np.dtype(dtype) and got.shape == want.shape
            if dtype.startswith("float") and op == "sum":  # summation order may differ from numpy's
                tol = 1e-12 if dtype == "float64" else 1e-5
                np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
            else:
                np.testing.assert_array_equal(got, want)

    def test_barrier(self, comm_gang):
        times = comm_gang.run(app_barrier)
        last_in = max(entered for entered, _ in times)
        assert all(left >= last_in for _, left in times)  # nobody left before the last arrived

    def test_object_helpers(self, comm_gang):
        n = comm_gang.world_size
        gathered = [{"rank": r, "items": list(range(r))} if r % 2 == 0 else None for r in range(n)]
        bcast = {"from": n - 1, "blob": b"x" * 100_000}
        want = (gathered, bcast, n * (n + 1) // 2, 0.5 * (n - 1), -(n - 1))
        assert comm_gang.run(app_objects) == [want] * n
