"""``%load_ext phalanx``: ``%px_gang`` starts a persistent gang, ``%%px`` runs a cell on its ranks.

    %px_gang 4 --site ray-local            # a gang of 4 ranks, the current one (named "default")
    %%px                                   # on every rank, with env, rank, world_size, px in scope
    df = px.read_parquet("data/*.parquet", env)
    totals = df.groupby("user").agg({"amount": "sum"})
    totals.num_rows                        # the last expression: shown per rank (Out[r:n])

    %%px --ranks 0 --out n                 # every rank runs it; rank 0's output and value shown
    n = totals.local_num_rows              # n (here) = [n on rank 0]

Like ipyparallel's ``%%px``, with BSP semantics:

- every rank runs every cell, always: a cell may call collectives (a groupby, a barrier), and
  a collective that some ranks skip hangs the others.  ``--ranks`` only chooses whose output,
  values and ``--out`` come back; an error on any rank is always shown;
- names assigned in a cell stay on the ranks for the next cells (a namespace per gang on each
  rank); the last expression's value is shown per rank, a ``px.DataFrame`` once for the whole
  frame (its rows over the ranks and its first rows); ``--out NAME`` sets ``NAME`` here to the
  list of its values on the (chosen) ranks, in rank order, or — a ``px.DataFrame`` — to one
  ``RemoteFrame`` (``NAME.head()``, ``NAME.collect(limit=...)`` as pandas);
- a cell that raises on every rank leaves the gang and its names as they were; when a rank
  raised and the others do not finish within ``settings.fail_grace`` seconds (they wait for it
  in a collective), the gang is stopped, as is one interrupted: the next cell starts a fresh
  gang (its names are gone, and the cell says so);
- cells are plain Python run by the ranks (no IPython syntax there); output is grouped by rank.
"""

from __future__ import annotations

import sys
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display

from ...errors import GangError, RankError, RankFailure
from ...gang import Gang
from . import html as H
from . import kernel, settings
from .frames import RemoteFrame, preview
from .hooks import view_options
from .tracebacks import attach, register_source
from .view import Rendered

CELL_APP = "phalanx.integrations.jupyter.ranks:run_cell"
FORGET_APP = "phalanx.integrations.jupyter.ranks:forget"


def current_gang() -> Gang | None:
    return kernel.named()


def parse_ranks(text: str | None, world_size: int) -> list[int]:
    if not text:
        return list(range(world_size))
    try:
        ranks = sorted({int(r) for r in text.replace(" ", "").split(",") if r})
    except ValueError:
        raise UsageError(f"--ranks {text}: a comma-separated list of ranks, e.g. --ranks 0,2") from None
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad or not ranks:
        raise UsageError(f"--ranks {text}: the gang has ranks 0 to {world_size - 1}")
    return ranks


def cell_number(shell: Any) -> int:
    """The number of the cell running (``In[n]``): IPython's result of it knows (the shell's
    counter is already the next cell's in IPython 9, not yet in 8)."""
    result = getattr(shell.displayhook, "exec_result", None)
    return getattr(result, "execution_count", None) or shell.execution_count


@magics_class
class PhalanxMagics(Magics):
    @property
    def _user_ns(self) -> dict[str, Any]:
        """The notebook's namespace (a magic runs in a shell: IPython types ``shell`` Optional)."""
        assert self.shell is not None, "phalanx's magics are registered on a shell"
        return self.shell.user_ns

    # ---- %px_gang --------------------------------------------------------------------------------
    @magic_arguments()
    @argument("ranks", nargs="?", type=int, help="ranks of the gang to start")
    @argument("--site", help="a site name or file (executor, communicator, store come from it)")
    @argument("--executor", help="local, mpirun, slurm, ray, kubernetes...")
    @argument("--communicator", help="tcp (default), shm, gloo, mpi, ucx")
    @argument("--rendezvous", help="tcp (default), file, redis://...")
    @argument("--session", default="default", help="the store session of env.store")
    @argument("--store", help="the store root (default: the site's, else the default)")
    @argument("--name", default=None, help="name of the gang (default: 'default'); %%%%px -g NAME uses it")
    @argument("--close", action="store_true", help="close the gang NAME (default: the current one)")
    @argument("--reset", action="store_true", help="forget the names %%%%px cells assigned on its ranks")
    @line_magic
    def px_gang(self, line: str) -> Any:
        """Start a persistent gang for %%px cells (the current one from now on), or close one.

        %px_gang 4 [--site ray-local] [--name NAME]    start (replacing NAME's gang)
        %px_gang --close [--name NAME]                 close
        %px_gang                                       the gangs of this kernel
        """
        args = parse_argstring(self.px_gang, line)
        if args.close or args.reset:
            name = args.name or kernel.current_name()
            gang = kernel.named(name)
            if gang is None or name is None:
                raise UsageError(f"no gang named {name!r}" if name else "no gang to close")
            if args.reset:
                if gang.running:
                    with view_options(quiet=True):
                        gang.run(FORGET_APP)
                print(f"gang {name!r} ({gang.gang_id}): the names of earlier cells are forgotten")
                return None
            kernel.forget(name)
            gang.close()
            print(f"closed gang {name!r} ({gang.gang_id})")
            return None
        if args.ranks is None:
            gangs = kernel.names()
            if not gangs:
                print("no gang: start one with %px_gang N [--site SITE]")
                return None
            current = kernel.current_name()
            for name, g in gangs.items():
                print(f"{'*' if name == current else ' '} {name}: {g!r}")
            return None
        name = args.name or "default"
        options = {
            k: v
            for k, v in {
                "site": args.site,
                "executor": args.executor,
                "communicator": args.communicator,
                "rendezvous": args.rendezvous,
                "store": args.store,
            }.items()
            if v
        }
        gang = Gang(args.ranks, session=args.session, **options)
        gang.start()
        old = kernel.name_gang(name, gang)
        if old is not None and old is not gang:
            print(f"gang {name!r}: {old.gang_id} replaced by {gang.gang_id} (closed)", file=sys.stderr)
            old.close()
        return gang

    # ---- %%px ------------------------------------------------------------------------------------
    @magic_arguments()
    @argument(
        "-g",
        "--gang",
        default=None,
        help="a gang's %%px_gang name, or a variable holding a px.Gang (default: the current gang)",
    )
    @argument(
        "--ranks",
        default=None,
        help="ranks whose output, value and --out come back, e.g. 0,2 (every rank runs the cell)",
    )
    @argument("--out", default=None, help="set NAME here to its value on each rank (a list in rank order)")
    @line_cell_magic
    def px(self, line: str, cell: str | None = None) -> None:
        """Run the cell on every rank of a gang (``%px CODE`` runs one line); see the module doc."""
        if cell is None:
            return self.run_cell(line, None, None, None)
        args = parse_argstring(self.px, line)
        return self.run_cell(cell, args.gang, args.ranks, args.out)

    def _gang(self, name: str | None) -> Gang:
        if name is None:
            gang = kernel.named()
            if gang is None:
                raise UsageError("no gang: start one with %px_gang N (or pass -g NAME)")
            return gang
        gang = kernel.named(name)
        if gang is None:
            value = self._user_ns.get(name)
            if isinstance(value, Gang):
                return value
            raise UsageError(f"-g {name}: neither a %px_gang name nor a variable holding a px.Gang")
        return gang

    def run_cell(self, code: str, gang_name: str | None, ranks: str | None, out: str | None) -> None:
        gang = self._gang(gang_name)
        shown = parse_ranks(ranks, gang.world_size)
        if out is not None and not out.isidentifier():
            raise UsageError(f"--out {out}: not a Python name")
        if not gang.running and gang.gang_id:
            print(
                f"gang {gang.gang_id} was stopped (an interrupt or a failed rank): a fresh gang starts; the "
                "names of earlier cells are gone",
                file=sys.stderr,
            )
        n = cell_number(self.shell)
        filename = f"<%px cell {n}>"
        register_source(filename, code)
        with view_options(mode="px", title=f"%%px [{n}]") as opts:
            try:
                replies = gang.run(CELL_APP, code, filename, shown, out, settings.preview_rows)
            except (GangError, RankError):  # the gang was stopped: by the view (see RunView._check_hung)?
                view = opts.view
                if view is not None and view.killed:
                    view.finish(self._render(view, None, shown, n))
                    raise view.kill_error() from None
                raise
            except BaseException:
                if opts.view is not None:
                    opts.view.finish(self._render(opts.view, None, shown, n))
                raise
        view = opts.view
        obj = self._render(view, replies, shown, n)
        if view is not None:
            view.finish(obj)
        elif obj is not None:
            display(obj)
        failures = [
            RankFailure(r, rep.failure["exc_type"], rep.failure["message"], rep.failure["traceback"])
            for r, rep in enumerate(replies)
            if rep.failure
        ]
        if failures:
            raise attach(RankError(failures))
        if out is not None:
            if any(rep.out_frame for rep in replies):
                self._user_ns[out] = RemoteFrame(gang, out)
            else:
                import cloudpickle

                self._user_ns[out] = [cloudpickle.loads(replies[r].out) for r in shown]
        return None

    def _render(self, view: Any, replies: list | None, shown: list[int], n: int) -> Rendered | None:
        """Each shown rank's output and value, and a frame's preview (once for all ranks)."""
        blocks: list[dict] = []
        for r in shown:
            stdout = view.output(r) if view is not None else ""
            value = replies[r].value if replies else None
            if stdout or value:
                blocks.append({"rank": r, "stdout": stdout, "value": value, "n": n})
        frames = [rep.frame for rep in replies or [] if rep.frame]
        if frames:
            html, text = preview(f"Out[{n}]", frames, settings.preview_rows)
            blocks.append({"frame": html, "frame_text": text})
        if view is not None and view.note:
            note = view.note
            blocks.append({"frame": f'<div style="color:#a05a00">{H.esc(note)}</div>', "frame_text": note})
        if not blocks:
            return None
        return Rendered(H.px_html(blocks), H.px_text(blocks))


def load(ipython: Any) -> None:
    ipython.register_magics(PhalanxMagics)
    kernel.install(ipython if getattr(ipython, "kernel", None) is not None else None)


def unload(ipython: Any) -> None:
    for name in list(kernel.names()):
        gang = kernel.forget(name)
        if gang is not None:
            gang.close()
