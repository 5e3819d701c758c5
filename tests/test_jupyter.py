"""phalanx in Jupyter (marker ``jupyter``), against a real ipykernel of this venv.

Each kernel comes from a kernelspec in a temporary directory (tests/jupyter_kernel.py) and is
tagged, so every process it starts — every rank — can be found in /proc, also after the kernel
is gone.  Cells are sent as a user's notebook sends them; what the tests read is what the
notebook shows: display, update and error messages.  Nothing here sleeps to pass: every wait is
for a condition, with a deadline.
"""

from __future__ import annotations

import html
import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.jupyter
ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
MISSING = [m for m in ("ipykernel", "jupyter_client", "nbclient", "nbformat") if importlib.util.find_spec(m) is None]
needs_kernel = pytest.mark.skipif(
    bool(MISSING), reason=f"{', '.join(MISSING)} not installed (pip install 'phalanx[jupyter]')"
)
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def plain(text: str) -> str:
    return ANSI.sub("", text)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def rank_blocks(page: str) -> dict[int, list[str]]:
    """rank → its output lines, from the final HTML picture of a run."""
    blocks = re.findall(r'<details class="px-rank-output" data-rank="(\d+)".*?<pre[^>]*>(.*?)</pre>', page, re.S)
    return {int(r): html.unescape(text).splitlines() for r, text in blocks}


# ---- without a kernel ----------------------------------------------------------------------------
def test_import_phalanx_imports_no_notebook_or_airflow_package():
    code = """
import sys
import phalanx as px
g = px.Gang(1)
page = g._repr_html_()                    # renders outside a notebook, without IPython
assert "phalanx gang" in page and "not started" in page and "local" in page, page
px.Workflow, px.RunHandle                 # the workflow API and run handles
import phalanx.integrations.jupyter, phalanx.integrations.jupyter.ranks   # what ranks import
import phalanx.integrations.jupyter.hooks, phalanx.integrations.jupyter.frames
heavy = sorted(m for m in sys.modules if m.split(".")[0] in
               ("IPython", "ipywidgets", "ipykernel", "jupyter_client", "zmq", "airflow", "nbclient"))
print("HEAVY", heavy)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout, out.stdout


def test_collect_limit_brings_the_first_rows_of_the_frame_in_rank_order():
    import jupyter_apps

    import phalanx as px

    with px.Gang(2, echo=False) as gang:
        r0, r1 = gang.run(jupyter_apps.collect_limits)
    assert r0["all"] == {"r": [0, 0, 1, 1, 1], "i": [0, 1, 0, 1, 2]}
    assert r0["first3"] == r1["first3"] == {"r": [0, 0, 1], "i": [0, 1, 0]}
    assert (r0["zero"], r0["more"]) == (0, 5)
    assert r0["root"] is None and r1["root"] == {"r": [0, 0, 1, 1], "i": [0, 1, 0, 1]}
    assert "limit must be an integer ≥ 0" in r0["bad"]


# ---- one kernel for most tests ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def nb(tmp_path_factory):
    """A kernel with phalanx loaded, live views shown at once, and a started 2-rank ``gang``."""
    from jupyter_kernel import Kernel, until

    k = Kernel(tmp_path_factory.mktemp("kernel"))
    try:
        k.execute(
            "import os, jupyter_apps\nimport phalanx as px\n%load_ext phalanx\n"
            "from phalanx.integrations.jupyter import settings, kernel as _k\n"
            "settings.show_after = 0.0\ngang = px.Gang(2)\ngang.start();"
        )
        yield k
    finally:
        k.shutdown()
        until(lambda: not k.processes(), "the kernel and its ranks to end", within=30)


@needs_kernel
def test_gang_renders_executor_ranks_memory_and_logs(nb):
    pids, log_dir = nb.value("gang.pids"), nb.value("str(gang.log_dir)")
    res = nb.execute("gang")
    page, text = res.last("text/html"), res.last("text/plain")
    assert "phalanx gang" in page and 'data-state="running"' in page and "local" in page
    for pid in pids:
        assert re.search(rf">{pid}</td>", page), page
        assert f"pid {pid}" in text
    assert page.count("MiB (peak") == 2 and html.escape(log_dir) in page
    assert "communicator tcp" in text and f"logs {log_dir}" in text


@needs_kernel
@pytest.mark.parametrize(
    "widgets",
    [
        pytest.param(
            True,
            marks=pytest.mark.skipif(importlib.util.find_spec("ipywidgets") is None, reason="ipywidgets not installed"),
        ),
        False,
    ],
    ids=["ipywidgets", "html"],
)
def test_gang_run_shows_each_rank_live_and_its_output_grouped(nb, tmp_path, widgets):
    gate = tmp_path / "gate"
    nb.execute(f"settings.widgets = {widgets}")
    live: dict[str, str] = {}  # while the run goes on: widget id (or "html") → what it shows

    def watch(msg):
        c = msg["content"]
        if msg["msg_type"] == "comm_msg":
            outs = c["data"].get("state", {}).get("outputs")
            if outs is not None:
                live[c["comm_id"]] = "".join(o.get("text", "") for o in outs)
        elif msg["msg_type"] in ("display_data", "update_display_data") and not gate.exists():
            live["html"] = c["data"].get("text/plain", "")
        shown = list(live.values())
        if any("r0-line-4" in s for s in shown) and any("r1-line-4" in s for s in shown):
            gate.touch()  # both ranks' lines were on screen while their app still ran

    res = nb.execute(f"gang.run(jupyter_apps.chatty, 5, {str(gate)!r})", hook=watch)
    assert gate.exists(), f"the ranks' lines never showed while the run went on: {live}"
    assert res.data("text/plain", "execute_result") == ["[0, 1]"]
    if widgets:  # an output widget per rank, each with that rank's lines only
        assert res.of("display_data")[0]["content"]["data"].get("application/vnd.jupyter.widget-view+json")
        per_widget = {k: set(re.findall(r"r(\d)-line", s)) for k, s in live.items() if "line-" in s}
        assert sorted(per_widget.values(), key=sorted) == [{"0"}, {"1"}], live
    # the final picture (it replaces the live one): each rank's output whole, in order, apart
    final = res.data("text/html", "update_display_data")[-1]
    assert rank_blocks(final) == {r: [f"r{r}-line-{i}" for i in range(5)] + [f"r{r}-after-gate"] for r in (0, 1)}
    assert "[phalanx]" not in final  # control lines never show
    text = res.data("text/plain", "update_display_data")[-1]
    assert re.search(r"rank 0\s+done .* 6/6 done", text) and re.search(r"rank 1\s+done .* 6/6 done", text), text


@needs_kernel
def test_failing_rank_shows_its_traceback_and_the_gang_is_usable_again(nb):
    pids = nb.value("gang.pids")
    nb.execute(
        "def nb_app(env):\n    if env.rank == 1:\n        raise RuntimeError('raised in a notebook cell')\n"
        "    env.comm.barrier()\n    return env.rank"
    )
    res = nb.execute("gang.run(nb_app)", ok=False)
    err = res.error
    assert err["ename"] == "RankError"
    tb = plain("\n".join(err["traceback"]))
    assert "rank 1: RuntimeError: raised in a notebook cell" in tb
    assert "raise RuntimeError('raised in a notebook cell')" in tb  # the cell's line, from the driver's copy
    assert re.search(r'File "[^"<>]+\.py", line 3, in nb_app\n', tb) and "<dynamic-code>" not in tb, tb  # its file
    assert "worker.py" not in tb and "jupyter/ranks.py" not in tb  # phalanx's wrapper frames left out
    view = res.data("text/plain", "update_display_data", "display_data")[-1]
    assert re.search(r"rank 1\s+failed", view) and re.search(r"rank 0\s+stopped", view), view
    assert nb.value("gang.run(lambda env: env.rank)") == [0, 1]  # a fresh gang
    assert set(nb.value("gang.pids")).isdisjoint(pids)
    assert not [p for p in pids if alive(p)]


@needs_kernel
def test_interrupt_stops_every_rank_within_seconds(nb, tmp_path):
    from jupyter_kernel import processes_with_env, until

    # a running gang whatever the tests before left (one that failed midway leaves it stopped)
    assert nb.value("gang.run(lambda env: env.rank)") == [0, 1]
    gang_id, pids = nb.value("gang.gang_id"), nb.value("gang.pids")
    assert sorted(processes_with_env("PHALANX_GANG_ID", gang_id)) == sorted(pids)
    msg_id = nb.kc.execute(f"gang.run(jupyter_apps.write_pid_and_block, {str(tmp_path)!r})")
    until(lambda: all((tmp_path / f"pid.{r}").exists() for r in (0, 1)), "the ranks to run the app", within=60)
    t0 = time.monotonic()
    nb.km.interrupt_kernel()
    reply = until(lambda: _reply(nb, msg_id), "the interrupted cell to end", within=60)
    assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
    # what happened, in one line: not where the driver waited (magics, gang, queue, threading...)
    shown = plain("\n".join(reply["content"]["traceback"]))
    assert shown == f"KeyboardInterrupt: every rank of gang {gang_id} was stopped; its next run starts a fresh one", (
        shown
    )
    until(lambda: not processes_with_env("PHALANX_GANG_ID", gang_id), "every rank of the gang to end", within=10)
    stopped_s = time.monotonic() - t0
    assert stopped_s < 10, stopped_s
    assert not [p for p in pids if alive(p)]
    assert nb.value("gang.run(lambda env: env.world_size)") == [2, 2]  # usable again (a fresh gang)
    assert nb.value("gang.gang_id") != gang_id


@needs_kernel
def test_gang_card_counts_the_runs_of_the_gang_now_running(nb):
    """The card's "N runs since" counts the runs of the gang it shows (its id, its start time),
    not those of the gangs a failure or an interrupt replaced before it."""
    nb.execute("gang.run(lambda env: env.rank)\ngang.run(lambda env: env.rank)")
    nb.execute("gang.run(jupyter_apps.fails_on, 0)", ok=False)  # the gang is stopped
    nb.execute("gang.run(lambda env: env.rank)")  # a fresh gang: its first run
    text = nb.execute("gang").last("text/plain")
    assert re.search(r"started in .* · 1 run since", text), text
    page = html.unescape(re.sub(r"<[^>]+>", " ", nb.execute("gang").last("text/html")))
    assert re.search(r"started in .* · 1 run since", page), page


def _reply(nb, msg_id: str):
    import queue

    try:
        msg = nb.kc.get_shell_msg(timeout=0.2)
    except queue.Empty:
        return None
    return msg if msg["parent_header"].get("msg_id") == msg_id else None


# ---- %%px ---------------------------------------------------------------------------------------
@needs_kernel
def test_px_cells_run_on_every_rank_keep_their_names_and_gather_values(nb):
    nb.execute("settings.widgets = False")
    res = nb.execute("%px_gang 2 --site local")
    assert "phalanx gang" in res.last("text/html")
    res = nb.execute("%%px\nx = rank * 10\nprint('x is', x)\nx + 1")
    text = res.last("text/plain")
    assert re.search(r"\[stdout:0\] x is 0\nOut\[0:\d+\]: 1\n\[stdout:1\] x is 10\nOut\[1:\d+\]: 11", text), text
    nb.execute("%%px --out y\ny = x + 1")  # x is still there: the ranks keep their names
    assert nb.value("y") == [1, 11]
    # --ranks: every rank runs the cell (a collective here), only rank 1 is shown and gathered
    res = nb.execute("%%px --ranks 1 --out z\nprint('on', rank)\nz = env.comm.allreduce_scalar(rank + 1)\nz")
    text = res.last("text/plain")
    assert "[stdout:1] on 1" in text and "[stdout:0]" not in text and re.search(r"Out\[1:\d+\]: 3", text), text
    assert nb.value("z") == [3]
    # a cell that raises on every rank leaves the gang and its names as they were
    pids = nb.value("_k.named().pids")
    res = nb.execute("%%px\nprint('before the error')\nundefined_name + 1", ok=False)
    assert res.error["ename"] == "RankError"
    tb = plain("\n".join(res.error["traceback"]))
    assert "rank 0: NameError" in tb and "undefined_name + 1" in tb and "the same traceback as rank 0" in tb, tb
    assert "[stdout:0] before the error" in res.last("text/plain")
    nb.execute("%%px --out x2\nx2 = x")
    assert nb.value("x2") == [0, 10] and nb.value("_k.named().pids") == pids


@needs_kernel
def test_px_cell_where_one_rank_raises_and_the_others_hang_stops_the_gang(nb):
    from jupyter_kernel import processes_with_env, until

    gang_id = nb.value("_k.named().gang_id")
    nb.execute("settings.fail_grace = 1.0")
    res = nb.execute("%%px\nif rank == 0:\n    raise ValueError('only rank 0')\nenv.comm.barrier()", ok=False)
    tb = plain("\n".join(res.error["traceback"]))
    assert "rank 0: ValueError: only rank 0" in tb and "rank 1 still running" in tb, tb
    until(lambda: not processes_with_env("PHALANX_GANG_ID", gang_id), "the stopped gang's ranks to end", within=10)
    res = nb.execute("%%px\nprint('fresh', rank)\n'x' in dir()")
    assert "was stopped" in res.stream("stderr")
    text = res.last("text/plain")
    assert "[stdout:0] fresh 0" in text and re.search(r"Out\[0:\d+\]: False", text), text  # names are gone


@needs_kernel
def test_px_dataframe_preview_and_driver_side_frame(nb):
    res = nb.execute(
        "%%px\nimport pyarrow as pa\n"
        "df = px.DataFrame.from_arrow(pa.table({'k': [rank] * (3 + rank), 'v': list(range(3 + rank))}), env)\n"
        "df"
    )
    text, page = res.last("text/plain"), res.last("text/html")
    assert "7 rows × 2 columns on 2 ranks (3, 4)" in text and "<table" in page, text
    assert text.count("phalanx DataFrame") == 1  # one preview for the whole frame, not one per rank
    nb.execute("%%px --out df\npass")
    assert nb.value("type(df).__name__") == "RemoteFrame"
    res = nb.execute("df.head(4)")
    assert "<table" in res.last("text/html")
    assert nb.value("df.head(4)['v'].tolist()") == [0, 1, 2, 0]
    assert nb.value("df.collect(limit=5)['k'].tolist()") == [0, 0, 0, 1, 1]
    assert nb.value("df.collect()['v'].tolist()") == [0, 1, 2, 0, 1, 2, 3]
    assert nb.value("[df.num_rows, df.partition_sizes(), df.columns]") == [7, [3, 4], ["k", "v"]]
    assert "phalanx DataFrame" in nb.execute("df").last("text/html")
    pids = nb.value("_k.named().pids")
    res = nb.execute("from phalanx.integrations.jupyter import frame\nframe('nope')", ok=False)
    assert res.error["ename"] == "NameError" and "'nope' is not defined on rank 0" in res.error["evalue"]
    assert nb.value("_k.named().pids") == pids  # a typo does not stop the gang


# ---- workflows -------------------------------------------------------------------------------------
@needs_kernel
def test_px_run_shows_the_stage_table_live_and_the_timeline_at_the_end(nb):
    nb.execute("settings.widgets = False")
    nb.execute(
        "import pyarrow as pa\nwf = px.Workflow('nbwf')\n"
        "@wf.stage(ranks=1, outputs=['tx'])\ndef gen(env):\n"
        "    print('generating on', env.rank)\n"
        "    return {'tx': px.DataFrame.from_arrow(pa.table({'u': [1, 2, 1], 'a': [1.0, 2.0, 3.0]}), env)}\n"
        "@wf.stage(ranks=1, needs=[gen], inputs={'tx': 'tx'}, outputs=['tot'])\ndef tot(env):\n"
        "    return {'tot': env.input('tx').groupby('u').agg({'a': 'sum'})}"
    )
    res = nb.execute("result = px.run(wf, site='local')\nresult.ok")
    assert res.data("text/plain", "execute_result") == ["True"]
    pages = res.data("text/html", "display_data", "update_display_data")
    assert len(pages) >= 2 and "<svg" not in pages[0] and 'data-state="running"' in "".join(pages[:-1])
    final = pages[-1]
    assert "<svg" in final and 'data-stage="gen"' in final and 'data-stage="tot"' in final
    assert final.count('data-state="succeeded"') >= 3  # the run and its two stages
    assert "succeeded" not in res.stream()  # the table replaces px.run's text progress lines
    run_id = nb.value("result.run_id")
    res = nb.execute(f"h = px.submit(wf, site='local', resume={run_id!r})\nh.wait(60)\nh")  # all stages reused
    page = res.data("text/html", "execute_result")[-1]
    assert f"phalanx run</b> <code>{run_id}</code>" in page and "<svg" in page and "reused" in page
    assert "phalanx report " + run_id in page


@needs_kernel
def test_a_running_handle_shown_again_is_its_live_table_not_a_stale_picture(nb, tmp_path):
    """``h = px.submit(...); h`` while the run goes on: the cell's result is the live stage table
    once more (the same display id, updated with it), never an Out that stays "running" with every
    stage pending in the saved notebook.  A finished handle shows as usual (tested above)."""
    gate = tmp_path / "gate"
    nb.execute(
        f"wf_gate = px.Workflow('nbgate')\n@wf_gate.stage(ranks=1)\ndef waits(env):\n"
        f"    assert jupyter_apps.wait_for({str(gate)!r})"
    )
    res = nb.execute("h_gate = px.submit(wf_gate, site='local')\nh_gate")
    assert not res.of("execute_result"), res.data("text/plain", "execute_result")  # no picture of that moment
    shown = res.of("display_data")
    ids = {m["content"].get("transient", {}).get("display_id") for m in shown}
    assert len(shown) == 2 and len(ids) == 1 and None not in ids, shown  # the live table, twice: one display
    gate.touch()
    res = nb.execute("h_gate.wait(120)")
    final = [m for m in res.of("update_display_data") if m["content"]["transient"]["display_id"] in ids]
    page = final[-1]["content"]["data"]["text/html"]
    assert 'data-state="succeeded"' in page and "<svg" in page, page  # what both places show at the end
    assert "phalanx run" in nb.execute("h_gate").last("text/html")  # finished: shown as usual


# ---- cleanup: unreferenced gangs, kernel restart and shutdown ----------------------------------------
@needs_kernel
def test_no_rank_outlives_its_use_a_kernel_restart_or_shutdown(tmp_path):
    from jupyter_kernel import Kernel, processes_with_env, until

    k = Kernel(tmp_path)
    try:
        k.execute("import phalanx as px\n%load_ext phalanx\nfrom phalanx.integrations.jupyter import kernel as _k")
        res = k.execute("tmp = px.Gang(1)\ntmp.start()\ntmp_id, tmp_pids = tmp.gang_id, tmp.pids\ndel tmp")
        assert "is no longer referenced: closed" in res.stream("stderr")
        tmp_pids = k.value("tmp_pids")
        until(lambda: not [p for p in tmp_pids if alive(p)], "the unreferenced gang's rank to end", within=10)
        k.execute("%px_gang 1")
        k.execute("kept = px.Gang(1)\nkept.start();")
        ids = k.value("[kept.gang_id, _k.named().gang_id]")
        assert all(processes_with_env("PHALANX_GANG_ID", i) for i in ids)
        old_kernel = k.pid
        k.km.restart_kernel(now=False)  # as the notebook's "Restart kernel": a shutdown request first
        k.kc.wait_for_ready(timeout=120)
        until(
            lambda: not any(processes_with_env("PHALANX_GANG_ID", i) for i in ids), "ranks to end at restart", within=15
        )
        assert not alive(old_kernel)
        # the restarted kernel: a gang, then the kernel killed outright — its ranks go with it
        k.execute("import phalanx as px\ng = px.Gang(1)\ng.start();")
        gid = k.value("g.gang_id")
        assert processes_with_env("PHALANX_GANG_ID", gid)
    finally:
        k.shutdown(now=True)
    until(lambda: not k.processes(), "every process of the kernel to end", within=15)


# ---- the quickstart notebook -------------------------------------------------------------------------
@needs_kernel
def test_quickstart_notebook_runs_top_to_bottom(tmp_path):
    import nbformat
    from jupyter_client import KernelManager
    from jupyter_kernel import SPEC, kernelspec, tagged_processes, until
    from nbclient import NotebookClient

    tag = f"quickstart-{os.getpid()}-{time.monotonic_ns()}"
    nb = nbformat.read(ROOT / "docs" / "notebooks" / "quickstart.ipynb", as_version=4)
    km = KernelManager(kernel_name=SPEC, kernel_spec_manager=kernelspec(tmp_path, tag))
    try:
        NotebookClient(nb, km=km, timeout=600, resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        if km.has_kernel:  # a kernel manager it was given is the caller's to shut down
            km.shutdown_kernel()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    pages = [o.data["text/html"] for o in outputs if "text/html" in o.get("data", {})]
    texts = "\n".join(o.get("text", "") or o.get("data", {}).get("text/plain", "") for o in outputs)
    assert any("phalanx gang" in p and 'data-state="running"' in p for p in pages)  # the gang
    hello = next(p for p in pages if "gang.run(hello)" in p)  # grouped output
    assert rank_blocks(hello) == {r: [f"rank {r} of 2: step {s}" for s in range(3)] for r in (0, 1)}
    assert "[stdout:0] rank 0 holds" in texts and "50 rows × 2 columns on 2 ranks" in texts  # %%px, preview
    assert any("<svg" in p and "nb-quickstart" in p for p in pages)  # the timeline
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", texts).groups())  # training
    assert last < first / 10, (first, last)
    assert 'data-state="stopped"' in pages[-1]  # closed at the end
    until(lambda: not tagged_processes(tag), "the notebook kernel and its ranks to end", within=15)
