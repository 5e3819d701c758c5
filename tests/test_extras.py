"""Every optional backend, asked for without its package, names the extra that brings it."""

from __future__ import annotations

import sys

import pytest

from phalanx.errors import MissingDependencyError
from phalanx.extras import require


def _ucx():
    from phalanx.runtime.comm.ucx import _import_ucxx

    return _import_ucxx()


def _redis():
    from phalanx.runtime.redis_keys import client_and_prefix

    return client_and_prefix("redis://127.0.0.1:1/0")


def _kubernetes():
    from phalanx.executors.kubernetes.client import _module

    return _module()


def _radical():
    from phalanx.executors.radical.session import import_rp

    return import_rp()


def _ray():
    from phalanx.executors.ray.connection import import_ray

    return import_ray()


@pytest.mark.parametrize(
    "load, module, extra",
    [
        (_ucx, "ucxx", "ucx"),
        (_redis, "redis", "redis"),
        (_kubernetes, "kubernetes", "kubernetes"),
        (_radical, "radical.pilot", "radical"),
        (_ray, "ray", "ray"),
    ],
    ids=["ucx", "redis", "kubernetes", "radical", "ray"],
)
def test_a_missing_backend_names_its_extra(monkeypatch, load, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # what Python does for a package not installed
    with pytest.raises(MissingDependencyError) as info:
        load()
    msg = str(info.value)
    assert f"pip install 'phalanx[{extra}]'" in msg
    assert module in msg


def test_a_backend_whose_own_import_fails_shows_that_error(monkeypatch):
    """The package is there but one of its dependencies is broken: the user sees the real cause,
    not a hint to install what is already installed."""
    monkeypatch.setitem(sys.modules, "phalanx_fake_backend", None)
    monkeypatch.setattr(
        "importlib.import_module",
        lambda name: (_ for _ in ()).throw(ImportError("No module named 'libbroken'", name="libbroken")),
    )
    with pytest.raises(ImportError) as info:
        require("phalanx_fake_backend", "fake", "executor 'fake'")
    assert not isinstance(info.value, MissingDependencyError)
    assert info.value.name == "libbroken"
