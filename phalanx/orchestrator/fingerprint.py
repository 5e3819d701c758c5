"""Fingerprints of what produced a stage's outputs, so a resume reuses only what still holds.

A stage's fingerprint covers its definition (kind, app or command, ranks, inputs and how they
are read, outputs, params), the identity of its app's code (the source file of a
``module:function`` app, the pickled function of a Python workflow), the fingerprints of the
stages it depends on and, for inputs no stage of the workflow produces, the stored version of
that dataset.  A resume compares the recorded fingerprint with the current one; a stage whose
fingerprint changed runs again, and so does everything downstream (their fingerprints contain
its own).  Not covered: modules the app imports besides its own, data read outside the store
(files, databases), the environment (library versions).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from typing import Any

from ..executors import executors
from ..store import Store
from .models import Workflow

# Settings that change how a stage runs, not what it produces (executor sections: where it runs)
_NOT_OUTPUT = {
    "retries",
    "retry",
    "timeout",
    "needs",
    "when",
    "cache",
    *executors.names(),
}  # when: whether it runs, not what


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=repr).encode()).hexdigest()[:16]


def _pickled_digest(value: Any) -> str:
    """A param JSON cannot hold (a numpy array in a Python workflow): the digest of its pickle."""
    import cloudpickle

    return "pickled " + hashlib.sha256(cloudpickle.dumps(value)).hexdigest()[:16]


def app_identity(app: Any) -> str:
    """A digest of the app's code: its module's source file, or the pickled function."""
    if not isinstance(app, str):
        return _pickled_digest(app)
    module = app.partition(":")[0]
    try:
        spec = importlib.util.find_spec(module)
        origin = spec.origin if spec else None
        if origin and origin not in ("built-in", "frozen"):
            with open(origin, "rb") as f:
                return "source " + hashlib.sha256(f.read()).hexdigest()[:16]
    except (ImportError, ValueError, OSError):
        pass
    return "name only"  # the module cannot be found here: the name is all there is


def fingerprints(wf: Workflow, deps: dict[str, set[str]], store: Store) -> dict[str, dict]:
    """Per stage: ``{"hash", "stage", "app", "upstream", "external"}`` (what ``changes`` compares)."""
    produced = {out for st in wf.stages.values() for out in st.outputs}
    out: dict[str, dict] = {}

    def visit(name: str) -> dict:
        if name in out:
            return out[name]
        st = wf.stages[name]
        definition = st.model_dump(mode="json", exclude=_NOT_OUTPUT, fallback=_pickled_digest)
        external = {}
        for spec in st.inputs.values():
            if spec.dataset not in produced:
                external[spec.dataset] = _stored_version(store, spec.dataset)
        parts = {
            "stage": definition,
            "app": app_identity(wf.app_of(name)) if st.app or name in wf.apps else "",
            "upstream": {d: visit(d)["hash"] for d in sorted(deps[name])},
            "external": external,
        }
        out[name] = {"hash": _digest(parts), **parts}
        return out[name]

    for name in wf.stages:
        visit(name)
    return out


def _stored_version(store: Store, dataset: str) -> str:
    session, _, short = dataset.rpartition("/")
    try:
        info = (store.for_session(session) if session else store).info(short)
    except Exception:
        return "missing"
    return info.version


def changes(old: dict, new: dict) -> list[str]:
    """What differs between two fingerprints of one stage, in words (empty: nothing)."""
    if not old:
        return ["no fingerprint was recorded when it ran"]
    said = []
    for key, (a, b) in _flat_diff(old.get("stage", {}), new["stage"]):
        said.append(f"{key}: {_short(a)} → {_short(b)}")
    if old.get("app") != new["app"]:
        said.append("its app's code changed")
    for dep in sorted(set(old.get("upstream", {})) | set(new["upstream"])):
        if old.get("upstream", {}).get(dep) != new["upstream"].get(dep):
            said.append(f"upstream stage {dep!r} changed")
    for ds in sorted(set(old.get("external", {})) | set(new["external"])):
        if old.get("external", {}).get(ds) != new["external"].get(ds):
            said.append(f"input dataset {ds!r} was replaced")
    if not said and old.get("hash") != new["hash"]:
        said.append("its definition changed")
    return said


def _flat_diff(a: Any, b: Any, prefix: str = "") -> list[tuple[str, tuple[Any, Any]]]:
    if isinstance(a, dict) and isinstance(b, dict):
        diffs = []
        for key in sorted(set(a) | set(b), key=str):
            diffs += _flat_diff(a.get(key), b.get(key), f"{prefix}{key}.")
        return diffs
    return [] if a == b else [(prefix.rstrip("."), (a, b))]


def _short(value: Any, limit: int = 40) -> str:
    text = json.dumps(value, default=repr) if value is not None else "(none)"
    return text if len(text) <= limit else text[: limit - 1] + "…"
