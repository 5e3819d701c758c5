"""The rank side of the Jupyter integration: what a notebook sends to the ranks of a gang.

Imported on the ranks (by reference, when a notebook's app arrives), so it imports nothing of
IPython and little of phalanx.

- ``Watched`` wraps the app of a ``gang.run`` made in a notebook: after the app it writes one
  end line to the rank's output (``[phalanx] end TOKEN ok 0.012``).  Output reaches the driver
  through pipes (or log files on other hosts) apart from the app's result; the end line tells
  the driver that every line this rank printed during the run has arrived, so the notebook
  shows each rank's output whole, in order and grouped by rank, and never a line late.
- ``run_cell`` runs a ``%%px`` cell: plain Python executed in a namespace kept per gang on each
  rank, so names assigned in one cell are there in the next; the last expression's value comes
  back for display, ``--out NAME`` sends a name's value back.  A cell that raises returns its
  error instead of raising: the gang and its namespace live on.
- ``frame_part`` sends (part of) a ``px.DataFrame`` of that namespace back (``RemoteFrame``).
- ``progress(done, total)`` is for apps: a per-rank progress bar in the notebook (a line
  ``[phalanx] progress 3/10`` in the rank's log elsewhere).
"""

from __future__ import annotations

import ast
import builtins
import json
import linecache
import sys
import time
from dataclasses import dataclass
from typing import Any

from ...runtime import tasks
from ...runtime.tasks import resolve_app

MARK = "[phalanx] "  # every control line starts so; never shown as rank output
END = MARK + "end "  # "[phalanx] end TOKEN ok|error SECONDS [JSON]"
PROGRESS = MARK + "progress "  # "[phalanx] progress DONE/TOTAL LABEL"
_TEXT_MAX = 20_000  # characters of a value's text shown per rank
_HTML_MAX = 200_000


def _write_line(text: str) -> None:
    """One line on the rank's output after what the app wrote (stderr shares the pipe)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or replaced stream
            pass
    out = sys.__stdout__ or sys.stdout
    print(text, file=out, flush=True)


def progress(done: float, total: float | None = None, label: str = "") -> None:
    """Report this rank's progress: ``progress(i + 1, n, "epoch 3")`` — a bar per rank in a
    notebook's view of the run; elsewhere a line in the rank's log."""
    label = " ".join(str(label).split())[:80]
    _write_line(f"{PROGRESS}{done:g}/{'' if total is None else f'{total:g}'} {label}".rstrip())


class Watched:
    """The app of a notebook's ``gang.run``, followed by its end line (see the module doc)."""

    def __init__(self, app: Any, token: str):
        self.app, self.token = app, token

    def __reduce__(self) -> tuple:
        # the app of a cell travels by value: keep its cell's file name, which cloudpickle
        # (3.1.3 on) drops, so that the driver can show the cell's lines in a rank's traceback
        from ...runtime.pickling import dumps

        return _watched, (dumps(self.app), self.token)

    def __call__(self, env, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        status, detail = "error", None
        try:
            result = resolve_app(self.app)(env, *args, **kwargs)
            failure = getattr(result, "failure", None)  # a %%px cell that raised returns its error
            status, detail = ("error", failure) if failure else ("ok", None)
            return result
        except BaseException as exc:
            detail = {"exc_type": type(exc).__name__, "message": str(exc)[:2000], "traceback": format_exception(exc)}
            raise
        finally:
            line = f"{END}{self.token} {status} {time.perf_counter() - t0:.6f}"
            _write_line(line + (" " + json.dumps(detail) if detail else ""))


def _watched(app: bytes, token: str) -> Watched:
    import cloudpickle

    return Watched(cloudpickle.loads(app), token)


def format_exception(exc: BaseException) -> str:
    """The traceback without the frames of this module (the wrapper and the cell runner)."""
    return tasks.format_exception(exc, lambda f: f.filename == __file__ or tasks.is_wrapper(f))


# ---- %%px cells ---------------------------------------------------------------------------------
_SPACES: dict[str, dict[str, Any]] = {}  # gang id → the names that cells assigned on this rank


@dataclass
class CellReply:
    """What one rank sends back for a ``%%px`` cell."""

    failure: dict | None = None  # exc_type, message, traceback: the cell raised here
    value: dict | None = None  # the last expression's value: {"text/plain": ..., "text/html": ...}
    frame: dict | None = None  # ... when it is a px.DataFrame: rows here and its first rows
    out: bytes | None = None  # --out NAME: the value, cloudpickled
    out_frame: dict | None = None  # --out NAME of a px.DataFrame: rows here and its first rows


def namespace(env) -> dict[str, Any]:
    """This rank's namespace for the cells of its gang (made by the first cell)."""
    key = env.gang_id or f"env-{id(env)}"
    ns = _SPACES.get(key)
    if ns is None:
        ns = _SPACES[key] = {
            "__name__": "__px__",
            "__builtins__": builtins,
            "px": sys.modules["phalanx"],
            "rank": env.rank,
            "world_size": env.world_size,
        }
    ns["env"] = env
    return ns


def run_cell(env, code: str, filename: str, shown: list[int], out: str | None, preview_rows: int) -> CellReply:
    """Run ``code`` in the gang's namespace; ``shown``: the ranks whose value and ``out`` are wanted."""
    ns = namespace(env)
    show = env.rank in shown
    reply = CellReply()
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)  # the cell's lines in tracebacks
    try:
        tree = ast.parse(code, filename, "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body[-1].value)
            tree.body.pop()
        exec(compile(tree, filename, "exec"), ns)
        value = eval(compile(last, filename, "eval"), ns) if last is not None else None
        if last is not None:
            ns["_"] = value
    except Exception as exc:
        reply.failure = {"exc_type": type(exc).__name__, "message": str(exc), "traceback": format_exception(exc)}
        return reply
    if value is not None:
        if _is_frame(value):  # a global preview: every rank sends its first rows
            reply.frame = _frame_head(value, preview_rows)
        elif show:
            reply.value = mime_bundle(value)
    if out and (show or _is_frame(ns.get(out))):
        if out not in ns:
            reply.failure = {
                "exc_type": "NameError",
                "message": f"--out {out}: name {out!r} is not defined on rank {env.rank}",
                "traceback": "",
            }
        elif _is_frame(ns[out]):
            reply.out_frame = _frame_head(ns[out], preview_rows)
        else:
            import cloudpickle

            try:
                reply.out = cloudpickle.dumps(ns[out], protocol=5)
            except Exception as exc:
                reply.failure = {
                    "exc_type": type(exc).__name__,
                    "traceback": "",
                    "message": f"--out {out}: cannot send {type(ns[out]).__name__} back: {exc}",
                }
    return reply


def mime_bundle(value: Any) -> dict[str, str]:
    """What the notebook shows of a value: its repr, and its HTML where it has one (pandas)."""
    try:
        text = repr(value)
    except Exception as exc:
        text = f"<{type(value).__name__}: repr failed: {exc}>"
    bundle = {"text/plain": text if len(text) <= _TEXT_MAX else text[:_TEXT_MAX] + " …"}
    html = getattr(value, "_repr_html_", None)
    if callable(html) and not isinstance(value, type):
        try:
            page = html()
        except Exception:
            page = None
        if isinstance(page, str) and len(page) <= _HTML_MAX:
            bundle["text/html"] = page
    return bundle


def _is_frame(value: Any) -> bool:
    frame = sys.modules.get("phalanx.operators.dataframe")
    return frame is not None and isinstance(value, frame.DataFrame)


def _frame_head(df, rows: int) -> dict:
    table = df.to_arrow()
    return {
        "rows": table.num_rows,
        "head": table.slice(0, rows),
        "partitioned_by": list(df.partitioned_by) if df.partitioned_by else None,
    }


def frame_part(env, name: str, limit: int | None) -> dict:
    """This rank's rows of the frame ``name`` of the cells' namespace (the first ``limit``);
    an error comes back as a value: a typo must not stop the gang."""
    ns = namespace(env)
    if name not in ns:
        return {"error": f"name {name!r} is not defined on rank {env.rank}"}
    if not _is_frame(ns[name]):
        return {"error": f"{name!r} is a {type(ns[name]).__name__} on rank {env.rank}, not a phalanx DataFrame"}
    table = ns[name].to_arrow()
    return {"rows": table.num_rows, "table": table if limit is None else table.slice(0, limit)}


def forget(env) -> int:
    """Drop the gang's namespace on this rank (``%px_gang --reset``): how many names it held."""
    ns = _SPACES.pop(env.gang_id or f"env-{id(env)}", {})
    return len([k for k in ns if not k.startswith("__")])
