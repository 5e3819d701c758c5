"""The Ray executor's parts that need no Ray: its typed ``ray:`` section, the executor's checks
and capacity, why a placement group cannot be placed, and the rendezvous address ranks on
other hosts get.  (Against a real cluster: tests/test_ray.py, marker ray.)"""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

import phalanx as px
from phalanx.executors import config_model, create
from phalanx.executors.ray import RayConfig, RayExecutor, diagnose, ray_config
from phalanx.executors.ray.network import reachable_env
from phalanx.runtime import protocol as P


def errors(section: dict) -> list[str]:
    """The section's problems as ``ray_config`` words them (a launcher built from Python)."""
    with pytest.raises(px.PhalanxError) as info:
        ray_config(section, site="s")
    text = str(info.value)
    assert text.startswith("site 's' (ray): ")
    return text.removeprefix("site 's' (ray): ").split("; ray.")


@pytest.mark.parametrize(
    "section, expected",
    [
        (
            {"cpus": 2},
            "ray.cpus: unknown key; known: address, namespace, strategy, cpus_per_rank, resources, "
            "ready_timeout_s, runtime_env, init",
        ),
        ({"stratgy": "PACK"}, "ray.stratgy: unknown key (did you mean 'strategy'?)"),
        (
            {"strategy": "SIDEWAYS"},
            "ray.strategy: unknown strategy 'SIDEWAYS'; known: STRICT_PACK, PACK, SPREAD, STRICT_SPREAD",
        ),
        ({"strategy": "spred"}, "ray.strategy: unknown strategy 'spred' (did you mean 'SPREAD'?)"),
        ({"namespace": []}, "ray.namespace: must be a string or null"),
        ({"cpus_per_rank": 0}, "ray.cpus_per_rank: Input should be greater than 0"),
        (
            {"resources": 3},
            "ray.resources: must be a mapping (added to every bundle) or a list of mappings (one per rank)",
        ),
        ({"resources": [{"node_a": 1}, {"node_b": "x"}]}, "ray.resources.1.node_b: must be a number"),
        ({"resources": {"GPU": -1}}, "ray.resources.GPU: must be a finite number ≥ 0"),
    ],
)
def test_a_bad_section_names_its_key(section, expected):
    assert errors(section)[0] == expected


def test_every_bad_key_is_named_at_once():
    assert errors({"strategy": "x", "ready_timeout_s": -1}) == [
        "ray.strategy: unknown strategy 'x'; known: STRICT_PACK, PACK, SPREAD, STRICT_SPREAD",
        "ready_timeout_s: Input should be greater than 0",
    ]


def test_the_section_model_is_the_registrys_and_needs_no_ray():
    """``phalanx validate`` and the JSON Schema read the section where Ray is not installed."""
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "from phalanx.executors import config_model, create\n"
        "m = config_model('ray'); ex = create('ray', {'strategy': 'spread'}, site='s')\n"
        "print(m.__name__, ex.config.strategy, ex.capacity(), 'ray' in sys.modules and sys.modules['ray'])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["RayConfig", "SPREAD", "None", "None"], out.stderr
    assert config_model("ray") is RayConfig
    schema = RayConfig.model_json_schema()["properties"]
    assert list(schema) == RayConfig.known_keys()
    assert all(field.get("description") for field in schema.values())
    assert "spread" in schema["strategy"]["enum"] and "SPREAD" in schema["strategy"]["enum"]


def test_defaults_case_and_bundles():
    c = RayConfig.model_validate({"strategy": "strict_pack", "cpus_per_rank": 2.5, "resources": None})
    assert (c.address, c.namespace, c.strategy, c.ready_timeout_s) == ("auto", "phalanx", "STRICT_PACK", 60)
    assert c.bundles(2) == [{"CPU": 2.5}] * 2 and c.threads() == 2
    c = RayConfig.model_validate({"resources": [{"node_a": 1}, {}]})
    assert c.bundles(2) == [{"CPU": 1, "node_a": 1}, {"CPU": 1}]
    with pytest.raises(ValueError, match="resources lists 2 bundles for a gang of 3 ranks"):
        c.bundles(3)
    with pytest.raises(ValidationError):
        RayConfig.model_validate({"cpus_per_rank": True})  # not a number of CPUs


def test_the_executor_checks_without_connecting_and_merges_a_stages_section():
    ex = create("ray", {"strategy": "SPREAD", "resources": [{"a": 1}, {"b": 1}]}, site="r")
    assert isinstance(ex, RayExecutor) and ex.capabilities.reuse_gangs and ex.capabilities.runs_commands
    assert ex.capabilities.remote_ranks and not ex.capabilities.pins_cpus and not ex.capabilities.mpi_world
    ex.check(2, ex.config)
    with pytest.raises(px.PhalanxError, match=r"^site 'r' \(ray\): resources lists 2 bundles for a gang of 1 ranks$"):
        ex.check(1, ex.config)
    stage = ex.stage_config({"resources": {"GPU": 1}})  # a stage's own section over the site's
    assert stage.strategy == "SPREAD" and stage.bundles(1) == [{"CPU": 1, "GPU": 1}]
    ex.check(5, stage)
    with pytest.raises(px.PhalanxError, match="resources lists 2 bundles for a gang of 3"):
        ex.launcher(3)  # what launch would refuse is refused when the launcher is made
    assert ex.launcher(2).config.strategy == "SPREAD"


def test_capacity_is_the_sites_cores_else_unknown_before_connecting(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # not connected (and nothing tries to)
    assert RayExecutor({}, cores=6).capacity() == 6
    assert RayExecutor({}).capacity() is None


def test_why_a_group_cannot_be_placed():
    nodes = [
        {"Resources": {"CPU": 1.0, "node_head": 1.0}},
        {"Resources": {"CPU": 1.0, "node_a": 1.0}},
        {"Resources": {"CPU": 1.0, "node_b": 1.0}},
    ]
    assert diagnose("INFEASIBLE", nodes, [{"CPU": 1.0}] * 4, "STRICT_SPREAD") == (
        "Ray says INFEASIBLE; cluster has 3 nodes; total {CPU: 3}; STRICT_SPREAD needs 4 distinct nodes"
    )
    assert diagnose("INFEASIBLE", nodes, [{"CPU": 1.0}] * 2, "STRICT_PACK") == (
        "Ray says INFEASIBLE; cluster has 3 nodes; total {CPU: 3}; STRICT_PACK needs one node with {CPU: 2}"
    )
    assert diagnose("PENDING", nodes, [{"CPU": 1.0, "node_a": 1.0}] * 2, "PACK") == (
        "Ray says PENDING; cluster has 3 nodes; 1 of them can hold a bundle; total {CPU: 3, node_a: 1}; "
        "the gang needs {CPU: 2, node_a: 2}"
    )
    assert diagnose("PENDING", nodes, [{"CPU": 1.0}] * 2, "PACK").endswith(
        "the resources are busy (other placement groups, actors or tasks)"
    )


def rank_env(control: str, rdzv: str, n: int = 2) -> list[dict[str, str]]:
    return [{P.ENV_CONTROL: control, P.ENV_RDZV: rdzv, P.ENV_RANK: str(r)} for r in range(n)]


def test_a_loopback_rendezvous_moves_to_rank_0s_node():
    nodes = [{"host": "node1", "node_ip": "10.0.0.5"}, {"host": "here", "node_ip": "10.0.0.1"}]
    ports: list[str] = []
    env = reachable_env(
        rank_env("10.0.0.1:4000", "tcp://127.0.0.1:5000"),
        nodes,
        here="here",
        free_port=lambda ip: ports.append(ip) or 6000,
        driver_ip=lambda: "10.0.0.1",
    )
    assert ports == ["10.0.0.5"] and [e[P.ENV_RDZV] for e in env] == ["tcp://10.0.0.5:6000"] * 2
    assert [e[P.ENV_RANK] for e in env] == ["0", "1"]
    # every rank on this host, or a rendezvous that is not loopback TCP: left as it is
    same = rank_env("127.0.0.1:4000", "tcp://127.0.0.1:5000")
    local = [{"host": "here", "node_ip": "127.0.0.1"}] * 2
    assert reachable_env(same, local, here="here", free_port=None, driver_ip=None) == same
    redis = rank_env("10.0.0.1:4000", "redis://10.0.0.9:6379/0")
    assert reachable_env(redis, nodes, here="here", free_port=None, driver_ip=None) == redis


def test_ranks_elsewhere_cannot_reach_a_driver_on_loopback():
    nodes = [{"host": "here", "node_ip": "10.0.0.1"}, {"host": "node2", "node_ip": "10.0.0.7"}]
    with pytest.raises(
        px.GangError,
        match=r"site 'r' \(ray\): ranks were placed on other hosts \(10\.0\.0\.7\) "
        r"but the driver listens on 127\.0\.0\.1 only; set the site's "
        r"driver_host .* 10\.0\.0\.1\)",
    ):
        reachable_env(
            rank_env("127.0.0.1:4000", "tcp://127.0.0.1:5000"),
            nodes,
            here="here",
            site="r",
            free_port=None,
            driver_ip=lambda: "10.0.0.1",
        )


def test_rank_runtime_env_carries_the_thread_share():
    from phalanx.executors.ray.launcher import rank_runtime_env

    user = {"pip": ["x"], "env_vars": {"FOO": "1", "POLARS_MAX_THREADS": "8"}}
    env = rank_runtime_env(user, {"PHALANX_THREADS": "2"})
    assert env["pip"] == ["x"]
    # the rank's share wins over a pool size the site set: it sizes every pool at import
    assert env["env_vars"] == {
        "FOO": "1",
        "PHALANX_THREADS": "2",
        "POLARS_MAX_THREADS": "2",
        "OMP_NUM_THREADS": "2",
        "MKL_NUM_THREADS": "2",
        "OPENBLAS_NUM_THREADS": "2",
    }
    assert user["env_vars"]["POLARS_MAX_THREADS"] == "8"  # the site's config is not changed
    assert rank_runtime_env(None, {}) == {}


@pytest.mark.ray  # imports ray (seconds): the ray lane
def test_why_ray_ended_a_rank_s_actor_is_the_cause_a_retry_policy_names():
    """``actor_death_cause`` reads Ray's own errors: the GCS's words for an actor whose node
    died (its gcs_server says "The actor died because its node has died. Node Id: ..."), the
    preempted flag Ray sets from a node drained for preemption, Ray's memory monitor."""
    pytest.importorskip("ray")
    from ray.core.generated.common_pb2 import ActorDiedErrorContext, NodeDeathInfo
    from ray.exceptions import ActorDiedError

    from phalanx.executors.ray.launcher import actor_death_cause

    def died(message: str, **context) -> ActorDiedError:
        return ActorDiedError(ActorDiedErrorContext(error_message=message, actor_id=b"\0" * 16, **context))

    assert actor_death_cause(died("The actor died because its node has died. Node Id: 3f2a")) == "node_lost"
    drained = NodeDeathInfo(reason=NodeDeathInfo.AUTOSCALER_DRAIN_PREEMPTED)
    assert actor_death_cause(died("The actor died because its node has died.", node_death_info=drained)) == "preempted"
    oom = "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: "
    assert actor_death_cause(died(oom + "Task was killed due to the node running low on memory.")) == "oom"
    assert actor_death_cause(died("The actor is dead because it was killed by `ray.kill`.")) is None
    assert actor_death_cause(ActorDiedError()) is None


def test_only_a_client_server_that_failed_to_start_is_worth_another_connection_attempt():
    """Ray's proxier refuses a ray:// client when the server it starts for that client dies
    at start (seen once under load in the multihost lane; the next attempt succeeds): that
    failure is tried again, a refused address or a version mismatch is not."""
    from phalanx.executors.ray.connection import client_server_failed

    spawn = ConnectionAbortedError(
        "Initialization failure from server:\\nTraceback (most recent call last):\\n  ...\\nRuntimeError: "
        "Starting Ray client server failed. See ray_client_server_23001.err for detailed logs."
    )
    assert client_server_failed(spawn)
    assert not client_server_failed(ConnectionError("ray client connection timeout"))
    assert not client_server_failed(ConnectionAbortedError("Initialization failure from server: version mismatch"))
    assert not client_server_failed(RuntimeError("Starting Ray client server failed."))  # not from the proxier
