"""The rank side of a ``bsp_app`` (no Parsl here: ranks never import it).

``RankApp`` is what the gang runs on every rank: it reads the dataset references among the
arguments as DataFrames, calls the user's function, and seals what it returns as the app's
outputs, in the call's own store session.

``python -m phalanx.integrations.parsl._rank`` is the rank entry point an MPI launcher starts
(``$PARSL_MPI_PREFIX``, ``srun``...): it takes the rank from the variables that launcher sets
(``PHALANX_RANK_VARS``, first present wins: a variable inherited from the Parsl worker's own
batch job must not shadow the launcher's), writes the rank's output to its log file, and runs
phalanx's rank worker.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from ...runtime.envvars import ENV_RANK, ENV_RANK_LOG_DIR, ENV_RANK_VARS
from ._refs import DatasetRef

DEFAULT_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID", "ALPS_APP_PE")


class _Scope:
    """The call's outputs (``env.output``) and dataset arguments, lent to the env while the
    function runs (``BSPEnv.in_stage``): outputs go to the call's session."""

    def __init__(self, env: Any, name: str, outputs: list[str], session: str):
        self.env, self.name, self.outputs, self.session = env, name, list(outputs), session
        self.inputs: dict[str, dict[str, Any]] = {}
        self._refs: dict[str, DatasetRef] = {}
        self.out_store = env.store.for_session(session)

    def add_input(self, name: str, ref: DatasetRef) -> None:
        self._refs[name] = ref
        self.inputs[name] = {"dataset": str(ref), **ref.get_options()}

    def read(self, ref: DatasetRef):
        return _rank_store(self.env, ref).get(ref.name, **ref.get_options())

    def input(self, name: str):
        if name not in self._refs:
            raise KeyError(f"app {self.name!r} has no dataset argument {name!r}; it has {sorted(self._refs)}")
        return self.read(self._refs[name])

    def output(self, name: str, data: Any):
        if name not in self.outputs:
            raise KeyError(f"app {self.name!r} declares no output {name!r}; outputs: {self.outputs}")
        return self.out_store.put(name, data, replace=True, producer=self.name)


def _rank_store(env: Any, ref: DatasetRef):
    """The store a reference names, as the gang sees it (collective ``get``)."""
    mine = env.store
    if str(mine.store.root) == ref.root and (ref.metadata is None or ref.metadata == mine.store.meta.url):
        return mine.for_session(ref.session)
    from ...store import Store
    from ...store.rank import RankStore

    return RankStore(env, Store(ref.root, ref.session, metadata=ref.metadata))


class RankApp:
    """``fn(env, *args, **kwargs)`` on every rank, with dataset references read as DataFrames
    and outputs sealed in ``session``.  ``fn`` travels cloudpickled (by reference when its
    module imports on the ranks; by value from a notebook or ``__main__``)."""

    def __init__(self, fn_pickle: bytes, name: str, outputs: list[str], session: str):
        self.fn_pickle, self.name, self.outputs, self.session = fn_pickle, name, list(outputs), session
        self.__name__ = self.__qualname__ = name

    def __call__(self, env: Any, *args: Any, **kwargs: Any) -> Any:
        import cloudpickle

        fn = cloudpickle.loads(self.fn_pickle)
        scope = _Scope(env, self.name, self.outputs, self.session)
        for key, value in kwargs.items():
            if isinstance(value, DatasetRef):
                scope.add_input(key, value)
        # read in argument order: every rank calls the collective gets in the same order
        args = tuple(scope.read(a) if isinstance(a, DatasetRef) else a for a in args)
        kwargs = {k: scope.read(v) if isinstance(v, DatasetRef) else v for k, v in kwargs.items()}
        with env.in_stage(scope):
            result = fn(env, *args, **kwargs)
            result = self._seal(scope, result)
        missing = [name for name in self.outputs if not scope.out_store.exists(name)]
        if missing:
            raise RuntimeError(
                f"app {self.name!r} finished without sealing its outputs {missing} "
                "(return {name: frame}, return the frame of its only output, or call "
                "env.output(name, frame))"
            )
        return result

    def _seal(self, scope: _Scope, result: Any) -> Any:
        """Seal returned frames; what is left is this rank's result."""
        if isinstance(result, dict) and self.outputs and set(result) & set(self.outputs):
            for name in self.outputs:  # the declared order: every rank puts in the same order
                if name in result:
                    scope.output(name, result[name])
            rest = {k: v for k, v in result.items() if k not in self.outputs}
            return rest or None
        if len(self.outputs) == 1 and _is_frame(result):
            scope.output(self.outputs[0], result)
            return None
        return result


def _is_frame(value: Any) -> bool:
    if type(value).__name__ in ("DataFrame", "Table", "RecordBatch"):
        mod = type(value).__module__
        return mod.startswith(("phalanx", "pyarrow", "pandas"))
    return False


def main() -> int:
    names = [n for n in os.environ.get(ENV_RANK_VARS, ",".join(DEFAULT_RANK_VARS)).split(",") if n]
    found = next((n for n in names if os.environ.get(n, "").strip().lstrip("-").isdigit()), None)
    if found is None:
        print(
            f"phalanx rank: none of {', '.join(names)} is set: not started by the MPI launcher "
            f"of the prefix ($PARSL_MPI_PREFIX)",
            file=sys.stderr,
            flush=True,
        )
        return 2
    rank = int(os.environ[found])
    os.environ[ENV_RANK] = str(rank)
    log_dir = os.environ.get(ENV_RANK_LOG_DIR)
    if log_dir:
        fd = os.open(os.path.join(log_dir, f"rank-{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    from ...runtime.worker import main as worker_main

    return worker_main()


if __name__ == "__main__":
    sys.exit(main())
