"""phalanx as Parsl apps, with real Parsl (marker ``parsl``).

Three real Parsl setups, one DataFlowKernel each (class-scoped): a HighThroughputExecutor on
127.0.0.1 whose workers drive gangs of phalanx's local executor; an MPIExecutor on this machine
(a nodefile, and an ``mpiexec`` that takes Parsl's MPICH-style prefix: phalanx's wrapper for Open
MPI); an MPIExecutor on a SlurmProvider block of the project's test SLURM cluster (real
``sbatch``, ranks through ``srun`` on two nodes).  Each: a 2-rank merge/groupby app fed by another
app through dataset references and checked against DuckDB, and a failing rank that fails the
future with its traceback and leaves no process (or SLURM step/job).

The apps live in tests/parsl_apps.py: Parsl workers and ranks import them by reference.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import phalanx as px
from phalanx.procs import pid_alive

pytestmark = pytest.mark.parsl

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import parsl_apps  # noqa: E402

ROWS, SEED = 3000, 11


# ---- no Parsl needed ---------------------------------------------------------------------------
def test_import_phalanx_never_imports_parsl():
    code = (
        "import sys, phalanx as px\n"
        "px.Workflow, px.submit, px.Gang\n"
        "import phalanx.integrations.parsl as p\n"
        "from phalanx.integrations.parsl import DatasetRef, BSPResult, output\n"
        "import phalanx.integrations.parsl._rank\n"
        "print(sorted(m for m in sys.modules if m == 'parsl' or m.startswith('parsl.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_resource_specification_derived_and_checked():
    from phalanx.integrations.parsl import ResourceSpecError, check_resource_specification, resource_specification

    assert resource_specification(2) == {"num_nodes": 1, "ranks_per_node": 2, "num_ranks": 2}
    assert resource_specification(3, ranks_per_node=2) == {"num_nodes": 2, "ranks_per_node": 2, "num_ranks": 3}
    # ranks_per_node filled in as an integer (Parsl would write -ppn 1.5)
    assert check_resource_specification({"num_nodes": 2, "num_ranks": 3}, 3) == {
        "num_nodes": 2,
        "ranks_per_node": 2,
        "num_ranks": 3,
    }
    with pytest.raises(ResourceSpecError, match=r"no 'num_nodes'.*hang|no 'num_nodes'.*never returns"):
        check_resource_specification({"num_ranks": 2}, 2)
    with pytest.raises(ResourceSpecError, match="asks 4 ranks"):
        check_resource_specification({"num_nodes": 2, "ranks_per_node": 2}, 2)
    with pytest.raises(ResourceSpecError, match="blocks have 1"):
        check_resource_specification({"num_nodes": 2, "ranks_per_node": 1}, 2, nodes_per_block=1)
    with pytest.raises(ResourceSpecError, match="hold 1 CPUs per node"):
        check_resource_specification({"num_nodes": 1, "ranks_per_node": 2}, 2, nodes_per_block=2, cores_per_node=1)
    with pytest.raises(ResourceSpecError, match="unknown keys"):
        check_resource_specification({"num_nodes": 1, "cores": 2}, 2)
    with pytest.raises(ResourceSpecError, match="integer"):
        check_resource_specification({"num_nodes": 1.5}, 2)


def test_rank_error_survives_pickling():
    from phalanx.integrations.parsl import ParslRankError

    err = ParslRankError([px.RankFailure(1, "ValueError", "boom", traceback="Traceback ...\nValueError: boom")], [0])
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, px.RankError) and back.ranks == [1] and back.stopped == [0]
    assert "ValueError: boom" in str(back)


# ---- real Parsl --------------------------------------------------------------------------------
def _expected(rows: int = ROWS, seed: int = SEED):
    duckdb = pytest.importorskip("duckdb")
    tx, users = parsl_apps.make_tables(rows, seed)
    con = duckdb.connect()
    con.register("tx", tx)
    con.register("users", users)
    by_region = con.execute(
        "SELECT region, sum(amount) AS amount, count(tx.user) AS n FROM tx JOIN users "
        "USING (user) GROUP BY region ORDER BY region"
    ).fetchall()
    totals = con.execute("SELECT user, sum(amount) FROM tx GROUP BY user ORDER BY user").fetchall()
    return by_region, totals


def _rows(table, *cols):
    return sorted(zip(*(table.column(c).to_pylist() for c in cols)))


@pytest.fixture(scope="class")
def dfk_for(request, tmp_path_factory):
    """Load a Parsl config made by ``config_from_site`` for the class (``site_args``)."""
    parsl = pytest.importorskip("parsl", reason="parsl is not installed (pip install 'phalanx[parsl]')")
    from phalanx.integrations.parsl import config_from_site

    run_dir = tmp_path_factory.mktemp("parsl-runinfo")
    site, kwargs = request.cls.site_args(request)
    # workers (and the ranks they start) import tests/parsl_apps.py
    init = f"export PYTHONPATH={HERE}:${{PYTHONPATH:-}}"
    dfk = parsl.load(config_from_site(site, run_dir=run_dir, worker_init=init, **kwargs))
    yield dfk
    if not dfk.cleanup_called:
        dfk.cleanup()
    parsl.clear()


def _assert_chain(gen_fut, mg_fut, placement):
    """generate → merge_groupby, linked by dataset references, checked against DuckDB."""
    from phalanx.integrations.parsl import BSPResult, DatasetRef

    expected_regions, _ = _expected()
    gen, res = gen_fut.result(timeout=240), mg_fut.result(timeout=240)
    assert isinstance(res, BSPResult) and res.placement == placement
    assert len(res) == 2 and sum(r["local_rows"] for r in res) == len(expected_regions)
    ref = res.outputs["by_region"]
    assert isinstance(ref, DatasetRef) and ref.rows == len(expected_regions)
    # the data went through the store: both apps' outputs are sealed datasets of their sessions
    assert gen.outputs["tx"].session == gen.session != res.session == ref.session
    assert _rows(ref.read(), "region", "amount", "user") == expected_regions
    return gen, res


def _assert_failed(fut, pid_dir: Path, within_s: float = 0.0):
    exc = fut.exception(timeout=240)
    assert isinstance(exc, px.RankError), repr(exc)
    assert exc.ranks[0] == 1 and "boom on rank 1" in str(exc) and "fail_on_rank" in str(exc)  # its traceback
    pids = [int(p.read_text()) for p in pid_dir.glob("rank-*.pid")]
    assert len(pids) == 2
    deadline = time.monotonic() + within_s
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if pid_alive(p)], "rank processes left behind"


class TestHighThroughputExecutor:
    """HTEX on 127.0.0.1: the worker drives gangs of phalanx's local executor (placement 'site')."""

    @staticmethod
    def site_args(request):
        return "local", {}

    def test_chain_on_a_persistent_gang_matches_duckdb(self, dfk_for):
        from phalanx.integrations.parsl import bsp_app, output

        gen = bsp_app(ranks=2, outputs=["tx", "users"], persistent=True)(parsl_apps.generate)
        mg = bsp_app(ranks=2, outputs=["by_region"], persistent=True)(parsl_apps.merge_groupby)
        top = bsp_app(ranks=2, outputs=["top"], persistent=True)(parsl_apps.top_regions)
        a = gen(ROWS, SEED)
        b = mg(output(a, "tx"), users=output(a, "users").result().hashed("user"))
        c = top(b, 3)  # a future with one output: its reference
        first, second = _assert_chain(a, b, "site")
        expected_regions, _ = _expected()
        best = sorted(expected_regions, key=lambda r: -r[1])[:3]
        assert _rows(c.result(timeout=240).outputs["top"].read(), "region", "amount", "user") == sorted(best)
        # one warm gang served all three apps: the same rank processes
        assert [r["pid"] for r in first] == [r["pid"] for r in second]
        assert first.gang_id == second.gang_id == c.result().gang_id

    def test_failing_rank_fails_the_future(self, dfk_for, tmp_path):
        from phalanx.integrations.parsl import bsp_app

        fail = bsp_app(ranks=2)(parsl_apps.fail_on_rank)
        _assert_failed(fail(1, str(tmp_path)), tmp_path)

    def test_an_app_sent_by_value_shows_its_file_line_and_source_in_the_traceback(self, dfk_for, tmp_path):
        """An app of a script or notebook goes to the ranks by value: its traceback still names
        its file and line and shows the line (cloudpickle alone names it <dynamic-code>)."""
        import cloudpickle

        from phalanx.integrations.parsl import bsp_app

        cloudpickle.register_pickle_by_value(parsl_apps)  # as if defined in the user's script
        try:
            fail = bsp_app(ranks=2)(parsl_apps.fail_on_rank)
            exc = fail(1, str(tmp_path)).exception(timeout=240)
        finally:
            cloudpickle.unregister_pickle_by_value(parsl_apps)
        assert isinstance(exc, px.RankError), repr(exc)
        tb = exc.failures[0].traceback
        assert "<dynamic-code>" not in tb
        assert f'File "{parsl_apps.__file__}", line 67, in fail_on_rank' in tb, tb
        assert 'raise ValueError(f"boom on rank {env.rank}")' in tb, tb

    def test_workflow_as_parsl_app(self, dfk_for, tmp_path):
        from phalanx.integrations.parsl import WorkflowResult, bsp_app, output

        gen = bsp_app(ranks=2, outputs=["tx", "users"], persistent=True)(parsl_apps.generate)
        wf = px.Workflow("parsl-totals")
        wf.stage(ranks=2, inputs={"tx": {"dataset": "tx", "by": ["user"]}}, outputs=["totals"])(parsl_apps.totals_stage)
        run = wf.as_parsl_app(site="local", state=tmp_path)
        fut = run(tx=output(gen(ROWS, SEED), "tx"))  # a workflow: one node of the Parsl DAG
        result = fut.result(timeout=240)
        assert isinstance(result, WorkflowResult)
        _, expected_totals = _expected()
        assert _rows(result.outputs["totals"].read(), "user", "amount") == expected_totals
        assert result.run_id and result.session.startswith("parsl-totals-")
        with pytest.raises(TypeError, match="no external input"):
            run(nope=result.outputs["totals"]).result(timeout=60)

    def test_failed_workflow_fails_the_future(self, dfk_for, tmp_path):
        from parsl.dataflow.errors import JoinError

        from phalanx.integrations.parsl import WorkflowFailed

        wf = px.Workflow("parsl-broken")
        wf.stage(ranks=1, outputs=["x"])(parsl_apps.failing_stage)
        exc = wf.as_parsl_app(site="local", state=tmp_path)().exception(timeout=240)
        assert isinstance(exc, JoinError)  # Parsl's wrapper of a join app's failure
        cause = exc.dependent_exceptions_tids[0][0]
        assert isinstance(cause, WorkflowFailed)
        for text in (str(exc), str(cause)):  # run, stage and the rank's error, both ways
            assert "stage failing_stage failed" in text and "RuntimeError: stage boom" in text


@pytest.mark.mpi
class TestMPIExecutorHere:
    """An MPIExecutor on this machine: ranks through $PARSL_MPI_PREFIX (mpiexec), MPI communicator."""

    @staticmethod
    def site_args(request):
        if not (shutil.which("mpiexec") or shutil.which("mpirun")):
            pytest.skip("no mpiexec (apt-get install openmpi-bin)")
        pytest.importorskip("mpi4py", reason="mpi4py is not installed (pip install 'phalanx[mpi]')")
        return "local", {"mode": "mpi"}

    def test_chain_matches_duckdb(self, dfk_for):
        from phalanx.integrations.parsl import bsp_app, output

        gen = bsp_app(ranks=2, communicator="mpi", outputs=["tx", "users"])(parsl_apps.generate)
        mg = bsp_app(ranks=2, communicator="mpi", outputs=["by_region"], launcher="mpiexec")(
            parsl_apps.merge_groupby
        )  # $PARSL_MPIEXEC_PREFIX, here the same launcher
        a = gen(ROWS, SEED)
        b = mg(output(a, "tx"), output(a, "users"))
        assert a.task_record["resource_specification"] == {"num_nodes": 1, "ranks_per_node": 2, "num_ranks": 2}
        first, second = _assert_chain(a, b, "mpi")
        assert {r["pid"] for r in first}.isdisjoint(r["pid"] for r in second)  # a gang per task

    def test_failing_rank_fails_the_future(self, dfk_for, tmp_path):
        from phalanx.integrations.parsl import bsp_app

        fail = bsp_app(ranks=2, communicator="mpi")(parsl_apps.fail_on_rank)
        _assert_failed(fail(1, str(tmp_path)), tmp_path)

    def test_spec_without_num_nodes_is_refused_before_submission(self, dfk_for):
        from phalanx.integrations.parsl import ResourceSpecError, bsp_app

        app = bsp_app(ranks=2)(parsl_apps.trivial)
        before = dfk_for.task_count
        with pytest.raises(ResourceSpecError, match="num_nodes"):
            app(parsl_resource_specification={"num_ranks": 2})
        with pytest.raises(ResourceSpecError, match="blocks have 1"):
            app(parsl_resource_specification={"num_nodes": 2, "ranks_per_node": 1})
        with pytest.raises(ValueError, match="persistent"):
            bsp_app(ranks=2, persistent=True)(parsl_apps.trivial)()
        assert dfk_for.task_count == before  # nothing reached Parsl


@pytest.mark.slurm
@pytest.mark.mpi
class TestSlurmProviderMPI:
    """The MPI communicator on a SlurmProvider block: the site's ``slurm.mpi: pmix`` becomes the
    block's SLURM_MPI_TYPE, so Parsl's srun prefix starts one MPI world.  One fake node: PMIx
    cannot span this machine's fake nodes (they share /tmp, where it keeps per-step files)."""

    @staticmethod
    def site_args(request):
        request.getfixturevalue("slurm_cluster")
        pytest.importorskip("mpi4py", reason="mpi4py is not installed (pip install 'phalanx[mpi]')")
        site = yaml.safe_load((ROOT / "site-configs" / "slurm-local.yaml").read_text())
        site["slurm"]["mpi"] = "pmix"
        path = request.getfixturevalue("tmp_path_factory").mktemp("site") / "slurm-mpi.yaml"
        path.write_text(yaml.safe_dump(site))
        return str(path), {"mode": "mpi", "nodes_per_block": 1, "ranks_per_node": 2}

    def test_chain_in_one_mpi_world_matches_duckdb(self, dfk_for):
        from phalanx.integrations.parsl import bsp_app, output

        gen = bsp_app(ranks=2, ranks_per_node=2, communicator="mpi", outputs=["tx", "users"])(parsl_apps.generate)
        mg = bsp_app(ranks=2, ranks_per_node=2, communicator="mpi", launcher="srun", outputs=["by_region"])(
            parsl_apps.merge_groupby
        )
        a = gen(ROWS, SEED)
        b = mg(output(a, "tx"), output(a, "users"))
        _assert_chain(a, b, "mpi")


@pytest.mark.slurm
class TestSlurmProvider:
    """An MPIExecutor on a SlurmProvider block (real sbatch) of the test cluster: ranks via srun on
    two nodes, Gloo between them."""

    @staticmethod
    def site_args(request):
        request.getfixturevalue("slurm_cluster")
        return str(ROOT / "site-configs" / "slurm-local.yaml"), {"mode": "mpi", "nodes_per_block": 2}

    def _job(self, dfk):
        (executor,) = [e for label, e in dfk.executors.items() if label != "_parsl_internal"]
        return executor, list(executor.blocks_to_job_id.values())

    def test_chain_on_two_nodes_matches_duckdb(self, dfk_for):
        from phalanx.integrations.parsl import bsp_app, output

        # ranks_per_node from the block: it holds one CPU per node for ranks (cores_per_node=1)
        gen = bsp_app(ranks=2, outputs=["tx", "users"])(parsl_apps.generate)
        mg = bsp_app(ranks=2, ranks_per_node=1, outputs=["by_region"])(parsl_apps.merge_groupby)
        a = gen(ROWS, SEED)
        b = mg(output(a, "tx"), output(a, "users"))
        assert a.task_record["resource_specification"] == {"num_nodes": 2, "ranks_per_node": 1, "num_ranks": 2}
        first, _ = _assert_chain(a, b, "mpi")
        assert sorted(r["node"] for r in first) == ["n1", "n2"]  # one rank on each node of the block

    def test_failing_rank_leaves_no_step_or_job(self, dfk_for, tmp_path, slurm_cluster):
        from phalanx.integrations.parsl import bsp_app

        fail = bsp_app(ranks=2, ranks_per_node=1)(parsl_apps.fail_on_rank)
        _assert_failed(fail(1, str(tmp_path)), tmp_path, within_s=10)
        env = {**os.environ, "SLURM_CONF": slurm_cluster}
        _, jobs = self._job(dfk_for)
        assert jobs
        for job in jobs:
            steps = subprocess.run(
                ["squeue", "-h", "-s", "-j", str(job), "-o", "%i"], env=env, capture_output=True, text=True, timeout=30
            ).stdout.split()
            assert not [s for s in steps if re.fullmatch(rf"{job}\.\d+", s)], f"steps left: {steps}"

    def test_block_job_ends_with_the_dataflow_kernel(self, dfk_for, slurm_cluster):
        # last in the class: ends this class's DataFlowKernel itself and checks SLURM lets go
        import parsl

        executor, jobs = self._job(dfk_for)
        assert jobs
        dfk_for.cleanup()
        parsl.clear()
        env = {**os.environ, "SLURM_CONF": slurm_cluster}
        deadline = time.monotonic() + 30
        while True:
            states = subprocess.run(
                ["squeue", "-h", "-t", "all", "-j", ",".join(map(str, jobs)), "-o", "%T"],
                env=env,
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout.split()
            live = [s for s in states if s in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED")]
            if not live or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert not live, f"block jobs {jobs} still {states}"
