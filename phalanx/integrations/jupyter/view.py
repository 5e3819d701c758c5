"""Live views in a Jupyter kernel: one ``gang.run`` per rank, and one workflow run per stage.

``RunView`` follows a ``gang.run``: each rank's state, time, progress (``progress()`` on the
rank), memory, and its output, kept per rank (``RankRouter`` is the gang's echo and hands each
rank line to the view of the run in progress).  A run that takes longer than
``settings.show_after`` gets a live display — ipywidgets (a progress bar and an output tab per
rank) when installed, else HTML updated in place — refreshed by a thread every
``settings.refresh_s``; at the end it is replaced by a static picture of the run (so a saved
notebook shows it), each rank's output in one block.  A run that fails shows its table, and the
failing rank's traceback is the notebook's traceback of the cell (``tracebacks``).

``HandleView`` follows a run handle (``px.submit``, ``px.run``): its stage table while it runs,
then the table and the run's timeline.

Only imported inside a kernel (``hooks``): it imports IPython.
"""

from __future__ import annotations

import json
import logging
import secrets
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from IPython.display import display

from ...errors import GangError, RankError, RankFailure
from . import html as H
from . import settings
from .ranks import END, MARK, PROGRESS, Watched
from .tracebacks import attach, attach_interrupt

log = logging.getLogger("phalanx.jupyter")


class Rendered:
    """One display: HTML for notebooks, text for every other frontend."""

    def __init__(self, html: str, text: str):
        self.html, self.text = html, text

    def _repr_html_(self) -> str:
        return self.html

    def __repr__(self) -> str:
        return self.text


def split_rank(text: str) -> tuple[int | None, str]:
    """``"[rank 3] hello"`` → (3, "hello"); lines of no rank (``[launcher] ...``) → (None, text)."""
    if text.startswith("[rank "):
        close = text.find("]", 6)
        if close > 6 and text[6:close].isdigit():
            return int(text[6:close]), text[close + 2 :] if text[close + 1 : close + 2] == " " else text[close + 1 :]
    return None, text


class RankRouter:
    """A gang's echo in a kernel: each rank line to the view of the run in progress, or — between
    runs — to stderr as in a terminal.  Control lines (``[phalanx] ...``) are never shown."""

    def __init__(self) -> None:
        self.view: RunView | None = None
        # whether the ranks' end lines reach us: None until a run tells (an executor of a
        # plug-in may not echo its ranks' output; then runs are not wrapped, nor waited for)
        self.echoes: bool | None = None

    def __call__(self, text: str) -> None:
        rank, body = split_rank(text)
        view = self.view
        if body.startswith(MARK):
            if view is not None and rank is not None:
                view.marker(rank, body)
            return
        if view is not None and rank is not None and view.line(rank, body):
            return
        print(text, file=sys.stderr, flush=True)


@dataclass
class RankState:
    lines: deque = field(default_factory=lambda: deque(maxlen=settings.max_lines))
    count: int = 0
    pending: list = field(default_factory=list)  # lines the live widget has not shown yet
    ended: bool = False
    status: str | None = None  # "ok" / "error" (from the end line)
    seconds: float | None = None
    detail: dict | None = None  # the error of a rank that raised
    done: float | None = None  # progress(done, total, label)
    total: float | None = None
    label: str = ""
    outcome: str | None = None  # failed / stopped / interrupted, from the driver's side


class RunView:
    """The live view of one ``gang.run`` in a notebook (see the module doc)."""

    def __init__(self, gang: Any, app: Any, opts: Any, router: RankRouter | None):
        if router is not None and router.echoes is False:  # its executor does not echo rank output
            router = None
        self.gang, self.opts, self.router = gang, opts, router
        self.token = secrets.token_hex(6)
        self.app = Watched(app, self.token) if router is not None else app
        self.title = opts.title or f"gang.run({_app_name(app)})"
        self.world = gang.world_size
        self.ranks = [RankState() for _ in range(self.world)]
        self.lock = threading.Lock()
        self.all_ended = threading.Event()
        self.state, self.note = "running", ""
        self.killed = False  # %%px: the view stopped the gang (a rank raised, others hung)
        self.first_error: float | None = None
        self.live: Any = None
        self.streaming = False  # a live widget takes lines as they come (``pending``)
        self.memory: list[str] = ["—"] * self.world
        self.t0 = self.t1 = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        opts.view = self

    # ---- fed by the router (pump threads) ----------------------------------------------------
    def line(self, rank: int, body: str) -> bool:
        if not 0 <= rank < self.world:
            return False
        with self.lock:
            st = self.ranks[rank]
            st.lines.append(body)
            st.count += 1
            if self.streaming:
                st.pending.append(body)
        return True

    def marker(self, rank: int, body: str) -> None:
        if not 0 <= rank < self.world:
            return
        if body.startswith(END):
            parts = body[len(END) :].split(" ", 3)
            if len(parts) < 3 or parts[0] != self.token:
                return  # a late line of an earlier run
            if self.router is not None:
                self.router.echoes = True
            with self.lock:
                st = self.ranks[rank]
                st.ended, st.status, st.seconds = True, parts[1], float(parts[2])
                if len(parts) > 3:
                    try:
                        st.detail = json.loads(parts[3])
                    except ValueError:
                        st.detail = None
                if st.status == "error" and self.first_error is None:
                    self.first_error = time.monotonic()
                if all(s.ended for s in self.ranks):
                    self.all_ended.set()
        elif body.startswith(PROGRESS):
            fields = body[len(PROGRESS) :].split(" ", 1)
            done, _, total = fields[0].partition("/")
            with self.lock:
                st = self.ranks[rank]
                try:
                    st.done, st.total = float(done), (float(total) if total else None)
                except ValueError:
                    return
                st.label = fields[1] if len(fields) > 1 else ""

    # ---- the run ---------------------------------------------------------------------------
    def __enter__(self) -> RunView:
        self.t0 = time.monotonic()
        if self.router is not None:
            self.router.view = self
        self._thread = threading.Thread(target=self._refresh, name="phalanx-notebook-view", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, et: Any, ev: Any, tb: Any) -> None:  # never swallows the exception
        try:
            if et is None and self.router is not None and not self.all_ended.wait(settings.drain_s):
                if self.router.echoes is None:  # not one end line ever came: this executor does not echo
                    self.router.echoes = False
                self.note = (
                    f"the last output of some ranks did not arrive within {settings.drain_s:g} s: "
                    f"see the logs in {self.gang.log_dir}"
                )
        finally:
            self._stop.set()
            if self._thread is not None:
                self._thread.join()
            if self.router is not None and self.router.view is self:
                self.router.view = None
            self.t1 = time.monotonic()
        self._outcome(ev)
        if isinstance(ev, RankError):
            attach(ev)
        elif isinstance(ev, KeyboardInterrupt):  # what happened, not where the driver waited
            attach_interrupt(ev, f"every rank of gang {self.gang.gang_id} was stopped; its next run starts a fresh one")
        if self.opts.mode == "run":
            self.finish(self.rendered(final=True) if self._worth_showing(ev) else None)

    def _outcome(self, ev: BaseException | None) -> None:
        with self.lock:
            if ev is None:
                self.state = "done"
                for st in self.ranks:
                    st.outcome = st.outcome or ("done" if st.status != "error" else "failed")
            elif isinstance(ev, RankError):
                self.state = "failed"
                for f in ev.failures:
                    if 0 <= f.rank < self.world:
                        self.ranks[f.rank].outcome = "failed"
                for r in ev.stopped:
                    if 0 <= r < self.world:
                        self.ranks[r].outcome = "stopped"
                self.note = self.note or "the gang was stopped: its next run starts a fresh one"
            elif isinstance(ev, KeyboardInterrupt):
                self.state = "interrupted"
                self.note = "interrupted: every rank was stopped; the gang's next run starts a fresh one"
            else:
                self.state = "failed"
                self.note = self.note or f"{type(ev).__name__}: {ev}"
            for st in self.ranks:
                if st.outcome is None:
                    st.outcome = (
                        ("done" if st.status == "ok" else "failed")
                        if st.ended
                        else ("interrupted" if isinstance(ev, KeyboardInterrupt) else "stopped")
                    )
        self._sample_memory()

    def _worth_showing(self, ev: BaseException | None) -> bool:
        return self.live is not None or ev is not None or any(st.count for st in self.ranks)

    def finish(self, obj: Any) -> None:
        """End the view with ``obj`` (None: nothing to show): in place of the live display, if any."""
        try:
            if self.live is not None:
                self.live.finish(obj if obj is not None else self.rendered(final=True))
            elif obj is not None:
                display(obj)
        except Exception as exc:  # a display problem must not hide the run's outcome
            log.warning("phalanx: could not show the run: %s", exc)

    def output(self, rank: int) -> str:
        with self.lock:
            lines = list(self.ranks[rank].lines)
        return "\n".join(lines) + ("\n" if lines else "")

    def failures_seen(self) -> list[RankFailure]:
        """Ranks whose end line reported an error (what is known when the view stopped the gang)."""
        with self.lock:
            return [
                RankFailure(
                    r, st.detail.get("exc_type", ""), st.detail.get("message", ""), st.detail.get("traceback", "")
                )
                for r, st in enumerate(self.ranks)
                if st.status == "error" and st.detail
            ]

    def unfinished(self) -> list[int]:
        with self.lock:
            return [r for r, st in enumerate(self.ranks) if not st.ended]

    # ---- the live display ------------------------------------------------------------------------
    def _refresh(self) -> None:
        while not self._stop.wait(settings.refresh_s):
            try:
                self._check_hung()
                if self.live is None and time.monotonic() - self.t0 >= settings.show_after:
                    self.live = (WidgetLive if use_widgets() else HtmlLive)(self)
                if self.live is not None:
                    self._sample_memory()
                    self.live.update()
            except Exception as exc:  # keep the run going without its view
                log.warning("phalanx: live view stopped: %s", exc)
                return

    def _check_hung(self) -> None:
        """%%px: a rank raised and the others are still busy after ``settings.fail_grace`` — most
        likely waiting for it in a collective: stop the gang (as gang.run's fail-fast would)."""
        if self.opts.mode != "px" or self.first_error is None or self.killed or self.all_ended.is_set():
            return
        if time.monotonic() - self.first_error < settings.fail_grace:
            return
        self.killed = True
        late = self.unfinished()
        self.note = (
            f"rank{'s' if len(late) > 1 else ''} {', '.join(map(str, late))} still running "
            f"{settings.fail_grace:g} s after a rank raised (waiting for it in a collective?): the gang "
            "was stopped; the next cell starts a fresh one"
        )
        self.gang._teardown(graceful=False)  # the run's thread then raises GangError

    def _sample_memory(self) -> None:
        gang = self.gang
        if not gang.running:
            return
        self.memory = [
            H.rank_memory(gang.pids[r] if r < len(gang.pids) else None, gang.hosts[r] if r < len(gang.hosts) else None)
            for r in range(self.world)
        ]

    def snapshot(self, tail: int | None = None) -> dict:
        """Everything a picture of the run needs, consistent (taken under the lock)."""
        now = (self.t1 or time.monotonic()) - self.t0
        gang = self.gang
        with self.lock:
            ranks = []
            for r, st in enumerate(self.ranks):
                state = st.outcome or (
                    "done"
                    if st.status == "ok"
                    else "failed"
                    if st.ended
                    else ("running" if gang.running else "starting")
                )
                fraction = (st.done / st.total if st.total else None) if st.done is not None else None
                if fraction is None and st.ended:
                    fraction = 1.0
                progress = ""
                if st.done is not None:
                    progress = f"{st.done:g}/{st.total:g}" if st.total else f"{st.done:g}"
                    progress += f" {st.label}" if st.label else ""
                lines = list(st.lines)[-tail:] if tail else list(st.lines)
                where = ""
                if r < len(gang.hosts) and gang.hosts[r]:
                    where = f"{gang.hosts[r]} pid {gang.pids[r]}"
                ranks.append(
                    {
                        "rank": r,
                        "state": state,
                        "seconds": st.seconds if st.ended else now,
                        "fraction": fraction,
                        "progress": progress,
                        "memory": self.memory[r],
                        "lines": st.count,
                        "text": "\n".join(lines),
                        "dropped": st.count - len(lines),
                        "where": where,
                    }
                )
        return {
            "title": self.title,
            "gang_id": gang.gang_id or "—",
            "state": self.state,
            "elapsed": now,
            "note": self.note,
            "ranks": ranks,
        }

    def rendered(self, final: bool) -> Rendered:
        return Rendered(H.run_html(self, final), H.run_text(self, final))

    def kill_error(self) -> RankError:
        """What the cell raises when the view stopped the gang."""
        failures = self.failures_seen() or [RankFailure(-1, "GangError", self.note)]
        err = RankError(failures, self.unfinished())
        return attach(err, note=self.note)


def use_widgets() -> bool:
    if settings.widgets is False:
        return False
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        if settings.widgets:
            raise
        return False
    return True


class HtmlLive:
    """The live view as HTML updated in place (no ipywidgets)."""

    TAIL = 20  # lines per rank while live; all of them at the end

    def __init__(self, view: RunView):
        self.view = view
        self.last = ""
        self.handle = display(self._render(), display_id=True)

    def _render(self) -> Rendered:
        snap_html = H.run_html(self.view, False, tail=self.TAIL)
        self.last = snap_html
        return Rendered(snap_html, H.run_text(self.view, False, tail=self.TAIL))

    def update(self) -> None:
        html = H.run_html(self.view, False, tail=self.TAIL)
        if html != self.last:
            self.last = html
            self.handle.update(Rendered(html, H.run_text(self.view, False, tail=self.TAIL)))

    def finish(self, obj: Any) -> None:
        self.handle.update(obj)


class WidgetLive:
    """The live view as ipywidgets: a header, a progress bar and figures per rank, an output tab
    per rank (lines appended as they come)."""

    def __init__(self, view: RunView):
        import ipywidgets as W

        self.view = view
        n = view.world
        self.header = W.HTML()
        self.bars = [W.FloatProgress(value=0.0, min=0.0, max=1.0, layout=W.Layout(width="180px")) for _ in range(n)]
        self.stats = [W.HTML() for _ in range(n)]
        self.outs = [W.Output(layout=W.Layout(max_height="18em", overflow="auto")) for _ in range(n)]
        rows = [
            W.HBox([W.HTML(f"<b>rank {r}</b>", layout=W.Layout(width="64px")), self.bars[r], self.stats[r]])
            for r in range(n)
        ]
        self.tab = W.Tab(children=self.outs)
        self.tab.titles = tuple(f"rank {r}" for r in range(n))
        self.box = W.VBox([self.header, *rows, self.tab])
        with view.lock:  # lines before the display appeared, then each as it comes
            for st in view.ranks:
                st.pending = list(st.lines)
            view.streaming = True
        self.handle = display(self.box, display_id=True)
        self.update()

    def update(self) -> None:
        view = self.view
        with view.lock:
            pending = [st.pending for st in view.ranks]
            for st in view.ranks:
                st.pending = []
        snap = view.snapshot(tail=1)
        self.header.value = (
            f"<b>{H.esc(snap['title'])}</b> on gang <code>{H.esc(snap['gang_id'])}</code> "
            f"{H.badge(snap['state'])} · {H.esc(H.seconds(snap['elapsed']))}"
        )
        for r, rank in enumerate(snap["ranks"]):
            if pending[r]:
                self.outs[r].append_stdout("\n".join(pending[r]) + "\n")
            bar = self.bars[r]
            bar.value = rank["fraction"] or 0.0
            bar.bar_style = {"done": "success", "failed": "danger", "stopped": "warning", "interrupted": "warning"}.get(
                rank["state"], "info"
            )
            self.stats[r].value = (
                f"{H.badge(rank['state'])} {H.esc(H.seconds(rank['seconds']))} · "
                f"{H.esc(rank['progress'] or '')} · memory {H.esc(rank['memory'])} · "
                f"{rank['lines']} lines"
            )
        titles = tuple(f"rank {r['rank']} ({r['lines']})" for r in snap["ranks"])
        if titles != tuple(self.tab.titles):
            self.tab.titles = titles

    def finish(self, obj: Any) -> None:
        self.handle.update(obj)
        self.box.close()
        for w in (self.header, self.tab, *self.bars, *self.stats, *self.outs):
            w.close()


class HandleView:
    """A run handle's stage table, updated while the run goes on, then with its timeline.

    While it runs, the handle shown again (``h`` at the end of a cell, ``display(h)``) shows this
    same table, updated with it (one display id): never a picture of the run that stays
    "running" in the saved notebook.  Once the run finished, the handle shows as usual."""

    def __init__(self, handle: Any):
        self.handle = handle
        self.done = threading.Event()
        self.widget = None
        first = Rendered(H.handle_html(handle, timeline=False), H.handle_text(handle))
        if use_widgets():
            import ipywidgets as W

            self.widget = W.HTML(first.html)
            self.display = display(self.widget, display_id=True)
        else:
            self.display = display(first, display_id=True)
        self._printers = _display_printers()
        if self._printers is not None:  # IPython asks it first for this handle (``show_again``)
            self._printers[id(handle)] = self.show_again
        self.thread = threading.Thread(target=self._follow, name=f"phalanx-notebook-run-{handle.run_id}", daemon=True)
        self.thread.start()

    def show_again(self, handle: Any) -> None:
        """The handle displayed while its run goes on: this live table once more (the same display
        id, so that every update and the final table reach both)."""
        if handle.done():  # (finished meanwhile) final: as IPython would show it
            display(Rendered(H.handle_html(handle), H.handle_text(handle)))
        elif self.widget is not None:
            display(self.widget, display_id=self.display.display_id)
        else:
            page = H.handle_html(handle, timeline=False)
            display(Rendered(page, H.handle_text(handle)), display_id=self.display.display_id)

    def _follow(self) -> None:
        try:
            last = ""
            while not self.handle._finished.wait(0.5):
                page = H.handle_html(self.handle, timeline=False)
                if page != last:
                    last = page
                    if self.widget is not None:
                        self.widget.value = page
                    else:
                        self.display.update(Rendered(page, H.handle_text(self.handle)))
            self.display.update(Rendered(H.handle_html(self.handle, timeline=True), H.handle_text(self.handle)))
            if self.widget is not None:
                self.widget.close()
        except Exception as exc:
            log.warning("phalanx: the live view of run %s stopped: %s", self.handle.run_id, exc)
        finally:
            if self._printers is not None:  # from now on the handle shows as usual (final)
                self._printers.pop(id(self.handle), None)
            self.done.set()

    def join(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)


def _display_printers() -> dict | None:
    """IPython's printers of single objects that display themselves (``display()`` and a cell's
    result ask them before any ``_repr_*_``), or None outside a kernel."""
    from IPython import get_ipython

    shell = get_ipython()
    formatter = getattr(getattr(shell, "display_formatter", None), "ipython_display_formatter", None)
    printers = getattr(formatter, "singleton_printers", None)
    return printers if isinstance(printers, dict) else None


def _app_name(app: Any) -> str:
    if isinstance(app, str):
        return app
    return getattr(app, "__qualname__", None) or getattr(app, "__name__", None) or type(app).__name__


__all__ = ["GangError", "HandleView", "RankRouter", "Rendered", "RunView"]
