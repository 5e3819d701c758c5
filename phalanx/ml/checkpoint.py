"""``px.ml.Checkpoints``: model and optimizer state in the store, so that a retried or resumed
training stage continues from its last checkpoint instead of starting again.

A checkpoint is a sealed store dataset of one row — ``step``, ``world_size``, ``config`` (what
must match to resume from it), ``sha256`` and ``state``, the ``torch.save`` bytes of rank 0's
model and optimizer state, the user's extras and every rank's RNG states — named
``<name>.ckpt.<step>`` in the gang's session.  A workflow run's stages share the session
``<workflow>-<run id>`` and a ``--resume`` reuses it, so a retried attempt and a resumed run
find the checkpoints of the attempts before them; a new run has a new session and starts from
scratch unless ``resume_from=`` names an older run's session.

Saving is collective: every rank calls ``save`` with the same step; rank 0 writes and seals
while the others wait for it (so no rank races ahead into a step whose checkpoint may never
land), and only once the new checkpoint is sealed are the ones beyond ``keep`` removed — a
crash in the middle of a save leaves the previous checkpoint intact.  ``restore`` takes the
newest checkpoint that verifies (the store's partition checksum, then the sha256 of the state
bytes) and was made with the same ``config``; a damaged one is skipped with a warning and the
one before it is used.  See docs/ml.md, "Checkpoints".
"""

from __future__ import annotations

import builtins
import hashlib
import io
import json
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import torch

from ..errors import StoreError

if TYPE_CHECKING:
    from ..runtime.env import BSPEnv
    from ..store.store import Store

MARK = ".ckpt."  # <name>.ckpt.<step>: apart from any output name a stage would pick
SCHEMA = pa.schema(
    [
        ("step", pa.int64()),
        ("world_size", pa.int64()),
        ("config", pa.string()),
        ("sha256", pa.string()),
        ("state", pa.large_binary()),  # the torch.save bytes: may pass 2 GiB
    ]
)
_PLAIN = (type(None), bool, int, float, str, bytes, torch.Tensor, torch.dtype, torch.device, torch.Size)


class CheckpointDamaged(StoreError):
    """A checkpoint whose bytes do not verify (store checksum or sha256), or that cannot be read."""


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint read back: its dataset (``session/name``), the step it was saved at and
    its contents: ``model`` and ``optimizer`` state dicts, ``stateful`` (state dicts of the
    other objects given to ``save``, by keyword), ``extra`` (the plain keyword values) and
    ``rng`` (each rank's RNG states)."""

    dataset: str
    step: int
    world_size: int
    model: dict[str, Any]
    optimizer: dict[str, Any] | None = None
    stateful: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    rng: list[dict[str, Any]] | None = None


def dataset_prefix(name: str) -> str:
    """``<name>.ckpt.``: the prefix of the checkpoint datasets of ``name`` (a stage's name)."""
    if not isinstance(name, str) or not name or name.startswith("."):
        raise ValueError(f"px.ml.Checkpoints: bad name {name!r} (a non-empty string that does not start with '.')")
    return name.replace("/", "_").replace("\0", "_") + MARK


def checkpoints(store: Store, name: str) -> list[tuple[int, str]]:
    """``(step, dataset)`` of every checkpoint of ``name`` in the store's session, newest first."""
    prefix = dataset_prefix(name)
    found = []
    for dataset in store.list():
        rest = dataset[len(prefix) :] if dataset.startswith(prefix) else ""
        if rest.isdigit():
            found.append((int(rest), dataset))
    return sorted(found, reverse=True)


def load_checkpoint(
    store: Store, name: str, step: int | None = None, *, map_location: Any = "cpu", config: Any = None
) -> Checkpoint:
    """The newest checkpoint of ``name`` in ``store``'s session that verifies (or the one of
    ``step``), from anywhere — the driver, a notebook, a later stage.  ``config``: when given,
    only a checkpoint saved with this config is taken.  Raises ``DatasetNotFoundError`` when
    there is none; a damaged one is skipped (logged) for the one before it."""
    from ..errors import DatasetNotFoundError

    candidates = [(s, d) for s, d in checkpoints(store, name) if step is None or s == step]
    wanted = None if config is None else _config_text(config)
    chosen, skipped = _newest(store, candidates, wanted, map_location)
    if chosen is None:
        why = "; ".join(f"{d}: {r}" for d, r in skipped) or "none saved"
        raise DatasetNotFoundError(
            f"store {store.root} session {store.session!r}: no usable checkpoint of {name!r}"
            + (f" at step {step}" if step is not None else "")
            + f" ({why})"
        )
    return chosen


# ---- encoding ---------------------------------------------------------------------------------
def encode(step: int, world_size: int, config: str, state: Mapping[str, Any]) -> pa.Table:
    """One checkpoint row: the ``torch.save`` bytes of ``state`` and their sha256."""
    buf = io.BytesIO()
    torch.save(dict(state), buf)
    data = buf.getbuffer()
    digest = hashlib.sha256(data).hexdigest()
    return pa.table(
        {
            "step": [step],
            "world_size": [world_size],
            "config": [config],
            "sha256": [digest],
            "state": pa.array([data], pa.large_binary()),
        },
        schema=SCHEMA,
    )


def decode(table: pa.Table, where: str, map_location: Any = "cpu") -> Checkpoint:
    """The checkpoint in ``table`` (a dataset read back), its sha256 checked first: a mismatch
    is ``CheckpointDamaged``; bytes that verify but do not load are a ``RuntimeError``."""
    if table.schema.names != SCHEMA.names or table.num_rows != 1:
        raise CheckpointDamaged(f"{where}: not a checkpoint (columns {table.schema.names}, {table.num_rows} rows)")
    row = {c: table.column(c)[0] for c in SCHEMA.names}
    buf = row["state"].as_buffer()
    if hashlib.sha256(memoryview(buf)).hexdigest() != row["sha256"].as_py():
        raise CheckpointDamaged(f"{where}: the state's sha256 does not match the one saved with it")
    try:
        state = torch.load(io.BytesIO(memoryview(buf)), map_location=map_location, weights_only=True)
    except Exception as exc:  # verified bytes: not damage, a checkpoint this torch cannot load
        raise RuntimeError(f"{where}: the checkpoint verifies but torch.load cannot load it: {exc}") from exc
    return Checkpoint(
        dataset=where,
        step=row["step"].as_py(),
        world_size=row["world_size"].as_py(),
        model=state["model"],
        optimizer=state.get("optimizer"),
        stateful=state.get("stateful", {}),
        extra=state.get("extra", {}),
        rng=state.get("rng"),
    )


def _config_text(config: Any) -> str:
    return json.dumps(config, sort_keys=True, default=str)


def _newest(
    store: Store, candidates: list[tuple[int, str]], config: str | None, map_location: Any
) -> tuple[Checkpoint | None, list[tuple[str, str]]]:
    """The first of ``candidates`` (newest first) that verifies and has ``config`` (any when
    None); and the ``(dataset, why)`` of those skipped on the way."""
    skipped: list[tuple[str, str]] = []
    for _, dataset in candidates:
        where = f"{store.session}/{dataset}"
        try:
            table = store.read(dataset, verify=True)
            if config is not None and table.column("config")[0].as_py() != config:
                skipped.append((where, "saved with another config (params or inputs changed)"))
                continue
            return decode(table, where, map_location), skipped
        except (StoreError, OSError, pa.ArrowException, KeyError) as exc:  # damaged, gone, unreadable
            skipped.append((where, f"{type(exc).__name__}: {exc}"))
    return None, skipped


# ---- RNG states -------------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    """This process's RNG states (torch CPU and CUDA, numpy's global, Python's) in types that
    ``torch.load(weights_only=True)`` accepts."""
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {
            "key": np_state["state"]["key"].tolist(),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"].cpu())
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": "MT19937",
            "state": {"key": np.array(n["key"], dtype=np.uint32), "pos": n["pos"]},
            "has_gauss": n["has_gauss"],
            "gauss": n["gauss"],
        }
    )
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def _check_plain(value: Any, path: str) -> None:
    """Extras are loaded with ``weights_only=True``: tensors, numbers, strings and containers of
    them.  Anything else is refused when saved, not found unloadable when resuming."""
    if isinstance(value, _PLAIN):
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_plain(v, f"{path}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, (str, int, float, bool)):
                raise TypeError(f"px.ml.Checkpoints.save: {path} has a key of type {type(k).__name__}")
            _check_plain(v, f"{path}[{k!r}]")
        return
    hint = " (use .tolist() or torch.from_numpy)" if isinstance(value, (np.ndarray, np.generic)) else ""
    raise TypeError(
        f"px.ml.Checkpoints.save: {path} is a {type(value).__name__}{hint}; extras must be tensors, numbers, "
        "strings, None, or lists/tuples/dicts of them, or objects with state_dict()/load_state_dict()"
    )


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside a DistributedDataParallel (or DataParallel) wrapper."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, torch.nn.Module) else model


# ---- the collective API -----------------------------------------------------------------------
class Checkpoints:
    """Checkpoints of one training loop, on every rank of a gang (collective calls).

    ``name``: the checkpoints' name, default the workflow stage's (``env.stage``; ``"train"``
    outside a stage); datasets are ``<name>.ckpt.<step>`` in the gang's store session.
    ``every``: ``save`` writes when ``step % every == 0`` (0: only with ``force=True``).
    ``keep``: the newest checkpoints kept (at least 1).  ``config``: what must be equal for a
    checkpoint to be resumed, JSON-serialisable; default the stage's params and the checksums of
    its inputs' partitions, so a stage rerun with other params or other data starts afresh.
    ``resume_from``: another session (an earlier run's, ``<workflow>-<run id>``) whose
    checkpoints ``restore`` takes when this session has none.  ``map_location``: where
    ``torch.load`` puts the tensors (the CPU by default; ``load_state_dict`` then copies them to
    the model's device).  ``rng``: save every rank's RNG states and restore them (same world
    size only).

    >>> ckpt = px.ml.Checkpoints(env, every=1)           # doctest: +SKIP
    >>> start = ckpt.restore(model, opt)                   # 0, or the step saved last
    >>> history = ckpt.extra.get("history", [])
    >>> for epoch in range(start, epochs):
    ...     train_one_epoch(epoch)
    ...     ckpt.save(epoch + 1, model, opt, history=history)
    """

    def __init__(
        self,
        env: BSPEnv,
        name: str | None = None,
        *,
        every: int = 1,
        keep: int = 2,
        config: Any = None,
        resume_from: str | None = None,
        map_location: Any = "cpu",
        rng: bool = True,
    ):
        if not all(hasattr(env, a) for a in ("rank", "world_size", "comm")):
            raise RuntimeError(
                f"px.ml.Checkpoints needs the env of a gang rank, got {type(env).__name__}; "
                "outside a gang read checkpoints with px.ml.load_checkpoint(store, name)"
            )
        if int(every) < 0 or int(keep) < 1:
            raise ValueError(f"px.ml.Checkpoints: every must be ≥ 0 and keep ≥ 1, got every={every}, keep={keep}")
        self.env = env
        self.name = name or getattr(env, "stage", "") or "train"
        self.prefix = dataset_prefix(self.name)
        self.every, self.keep = int(every), int(keep)
        self.resume_from = resume_from
        self.map_location = map_location
        self.rng = rng
        self._config = config
        self._config_json: str | None = None  # computed once, on rank 0
        self.step = 0  # the step restore returned
        self.extra: dict[str, Any] = {}  # the plain extras of the restored checkpoint
        self.restored: str | None = None  # "session/name" of the restored checkpoint
        self.skipped: builtins.list[tuple[str, str]] = []  # (dataset, why) passed over by restore
        self._picked: Checkpoint | None = None  # rank 0: the checkpoint restore chose, decoded

    def __repr__(self) -> str:
        return f"<px.ml.Checkpoints {self.prefix}* every={self.every} keep={self.keep} step={self.step}>"

    @property
    def store(self) -> Store:
        store: Store = self.env.store.store  # env.store is the gang's RankStore; its Store
        return store

    def list(self) -> builtins.list[tuple[int, str]]:
        """``(step, dataset)`` of this loop's checkpoints in the session, newest first."""
        return checkpoints(self.store, self.name)

    # ---- config ---------------------------------------------------------------------------
    def config(self) -> str:
        """The JSON text a checkpoint must carry to be resumed (rank 0 computes it)."""
        if self._config_json is None:
            config = self._config
            if config is None:
                config = {"params": dict(getattr(self.env, "params", {}) or {}), "inputs": self._input_checksums()}
            self._config_json = _config_text(config)
        return self._config_json

    def _input_checksums(self) -> dict[str, builtins.list[str]]:
        out: dict[str, builtins.list[str]] = {}
        for local, spec in sorted((getattr(self.env, "inputs", {}) or {}).items()):
            if "dataset" not in spec:  # a fan-in's gather: its parts are inputs of their own
                continue
            session, _, short = str(spec["dataset"]).rpartition("/")
            store = self.store.for_session(session) if session else self.store
            try:
                out[local] = [p.checksum for p in store.info(short).partitions]
            except (StoreError, ValueError):
                out[local] = []
        return out

    # ---- restore ----------------------------------------------------------------------------
    def restore(self, model: torch.nn.Module, optimizer: Any = None, **stateful: Any) -> int:
        """Load the newest usable checkpoint into ``model`` (a DDP wrapper or the bare module),
        ``optimizer`` and each of ``stateful`` (objects with ``load_state_dict``: an LR
        scheduler, a GradScaler); return its step — where to start — or 0 when there is none.

        Collective.  Rank 0 picks the checkpoint (the newest in this session that verifies and
        has this config; else the newest of ``resume_from``'s) and every rank loads it, so all
        replicas are equal after it.  The extras saved with it are in ``self.extra``; what was
        passed over, and why, in ``self.skipped`` (and the rank-0 log)."""
        comm = self.env.comm
        picked = comm.on_root(self._pick)
        self.skipped = picked["skipped"]
        if picked["dataset"] is None:
            self.step, self.extra, self.restored = 0, {}, None
            return 0

        def load() -> Checkpoint:
            cached, self._picked = self._picked, None  # rank 0 decoded it already
            if cached is not None:
                return cached
            session, _, dataset = picked["dataset"].rpartition("/")
            table = self.store.for_session(session).read(dataset, verify=False)  # sha256 checked in decode
            return decode(table, picked["dataset"], self.map_location)

        ckpt: Checkpoint = comm.on_every_rank(f"restoring checkpoint {picked['dataset']}", load)
        _unwrap(model).load_state_dict(ckpt.model)
        if optimizer is not None:
            if ckpt.optimizer is None:
                raise ValueError(f"{ckpt.dataset} holds no optimizer state (saved without an optimizer)")
            optimizer.load_state_dict(ckpt.optimizer)
        for key, obj in stateful.items():
            if key not in ckpt.stateful:
                raise KeyError(f"{ckpt.dataset} holds no state for {key!r}; it has {sorted(ckpt.stateful)}")
            obj.load_state_dict(ckpt.stateful[key])
        if self.rng and ckpt.rng is not None:
            if len(ckpt.rng) == self.env.world_size:
                set_rng_state(ckpt.rng[self.env.rank])
            elif self.env.rank == 0:
                self.env.log.warning(
                    "%s was saved by %d ranks, this gang has %d: RNG states not restored",
                    ckpt.dataset,
                    len(ckpt.rng),
                    self.env.world_size,
                )
        self.step, self.extra, self.restored = ckpt.step, dict(ckpt.extra), ckpt.dataset
        return ckpt.step

    def _pick(self) -> dict[str, Any]:
        """On rank 0: the checkpoint to resume from and what was skipped (logged)."""
        config = self.config()
        chosen, skipped = _newest(self.store, self.list(), config, self.map_location)
        if chosen is None and self.resume_from:
            other = self.store.for_session(self.resume_from)
            chosen, more = _newest(other, checkpoints(other, self.name), config, self.map_location)
            skipped += more
        for dataset, why in skipped:
            self.env.log.warning("checkpoint %s skipped: %s", dataset, why)
        self._picked = chosen  # the others read it from the store: only its name travels
        return {"dataset": chosen.dataset if chosen else None, "skipped": skipped}

    # ---- save -------------------------------------------------------------------------------
    def save(
        self, step: int, model: torch.nn.Module, optimizer: Any = None, *, force: bool = False, **extra: Any
    ) -> bool:
        """Checkpoint the state after ``step`` steps (epochs) — what ``restore`` will return —
        when ``step % every == 0`` or ``force``; True when it wrote one.

        Collective: every rank calls it with the same ``step`` (ranks that disagree all get a
        ``ValueError``).  Rank 0 writes its replica (DDP replicas are equal) while the others
        wait, so when ``save`` returns on any rank the checkpoint is sealed.  ``extra``: objects
        with ``state_dict()`` are saved as such and given back by ``restore(..., key=obj)``;
        the others (tensors, numbers, strings, lists and dicts of them: the epoch's metrics so
        far) come back in ``self.extra``.  Then the checkpoints beyond ``keep`` are removed,
        and any of a step after this one (left by an attempt that got further and was not
        resumed from)."""
        comm = self.env.comm
        steps = comm.allgather_obj(int(step))
        if len(set(steps)) != 1:
            raise ValueError(f"px.ml.Checkpoints.save: the ranks disagree on the step: {steps}")
        step = steps[0]
        if step < 0:
            raise ValueError(f"px.ml.Checkpoints.save: step must be ≥ 0, got {step}")
        if not force and (self.every == 0 or step % self.every):
            return False
        stateful = {k: v.state_dict() for k, v in extra.items() if callable(getattr(v, "state_dict", None))}
        plain = {k: v for k, v in extra.items() if k not in stateful}
        comm.on_every_rank("checking the checkpoint's extras", _check_plain, plain, "extra")
        rngs = comm.allgather_obj(rng_state()) if self.rng else None

        def write() -> str:
            state = {
                "model": _unwrap(model).state_dict(),
                "optimizer": optimizer.state_dict() if optimizer is not None else None,
                "stateful": stateful,
                "extra": plain,
                "rng": rngs,
            }
            table = encode(step, self.env.world_size, self.config(), state)
            dataset = f"{self.prefix}{step}"
            self.store.put(dataset, table, replace=True, producer=f"px.ml.Checkpoints({self.name})")
            self._prune(step)
            return dataset

        dataset = comm.on_root(write)
        self.step = step
        if self.env.rank == 0:
            self.env.log.info("checkpoint %s sealed", dataset)
        return True

    def _prune(self, step: int) -> None:
        """On rank 0, after the checkpoint of ``step`` is sealed: keep it and the ``keep - 1``
        newest before it; remove the rest (a failure to remove is only logged)."""
        older = 0
        for s, dataset in self.list():
            if s == step:
                continue
            if s < step:
                older += 1
                if older < self.keep:
                    continue
            try:
                self.store.delete(dataset)
            except (StoreError, OSError) as exc:
                self.env.log.warning("checkpoint %s not removed: %s", dataset, exc)

    def clear(self) -> int:
        """Remove every checkpoint of this loop from the session (collective); how many.  For a
        stage that has sealed its outputs: a resume reuses those, not the checkpoints."""

        def remove() -> int:
            found = self.list()
            for _, dataset in found:
                self.store.delete(dataset)
            return len(found)

        return int(self.env.comm.on_root(remove))
