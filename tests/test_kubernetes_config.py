"""The kubernetes executor's site section and the manifests of a gang, without a cluster: what a
user writes is checked with errors naming the key, and what phalanx would create says what the
docs promise (all-or-nothing Indexed Job, the key only in a Secret, enforced memory)."""

from __future__ import annotations

import json
import os
import re

import pytest

from phalanx.executors.kubernetes import manifests as M
from phalanx.executors.kubernetes.config import KubernetesConfig, cpu_cores
from phalanx.executors.kubernetes.executor import _host_paths, host_mounts
from phalanx.orchestrator.models import Site
from phalanx.orchestrator.yamlio import ConfigError, parse


def site(**section) -> Site:
    return parse(
        Site, {"name": "k", "executor": "kubernetes", "kubernetes": {"image": "img:1", **section}}, source="test"
    )


def spec(**over) -> M.GangSpec:
    base = dict(
        name="phalanx-g-ab12",
        ranks=3,
        argv=["python3", "-m", "phalanx.runtime.worker"],
        env={"PHALANX_WORLD_SIZE": "3"},
        authkey="0123456789abcdef" * 2,
    )
    return M.GangSpec(**{**base, **over})


def test_an_unknown_key_is_named_with_the_nearest_known_one():
    with pytest.raises(ConfigError, match=r"kubernetes\.namespce.*did you mean 'namespace'"):
        site(namespce="x")


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("gang", "slurm", r"kubernetes\.gang"),
        ("network", "overlay", r"kubernetes\.network"),
        ("cpu", 0, r"kubernetes\.cpu.*positive"),
        ("namespace", "Not_A_Name", r"kubernetes\.namespace"),
        ("gpus", -1, r"kubernetes\.gpus"),
    ],
)
def test_bad_values_are_refused_at_their_key(key, value, message):
    with pytest.raises(ConfigError, match=message):
        site(**{key: value})


def test_check_refuses_what_would_fail_at_launch():
    ex = parse(Site, {"name": "k", "executor": "kubernetes"}, source="t").create_executor()
    with pytest.raises(ValueError, match=r"kubernetes\.image: required"):
        ex.check(2, ex.config)
    with pytest.raises(ValueError, match=r"kubernetes\.queue"):
        ex.check(2, ex.stage_config({"image": "x", "gang": "kueue"}))
    with pytest.raises(ValueError, match=r"host_paths: 'usr:ro' is not an absolute path"):
        ex.check(2, ex.stage_config({"image": "x", "host_paths": ["usr:ro"]}))
    with pytest.raises(ValueError, match=r"the mode after ':' is ro or rw"):
        ex.check(2, ex.stage_config({"image": "x", "host_paths": ["/usr:readonly"]}))


def test_the_job_is_indexed_all_or_nothing_and_fails_on_any_failed_pod():
    job = M.job(site().kubernetes, spec())
    s = job["spec"]
    assert (s["completions"], s["parallelism"], s["completionMode"], s["backoffLimit"]) == (3, 3, "Indexed", 0)
    assert s["template"]["spec"]["restartPolicy"] == "Never"
    rules = s["podFailurePolicy"]["rules"]
    assert {r["action"] for r in rules} == {"FailJob"}
    assert any(r.get("onExitCodes", {}).get("operator") == "NotIn" and r["onExitCodes"]["values"] == [0] for r in rules)
    env = {e["name"]: e for e in s["template"]["spec"]["containers"][0]["env"]}
    assert "job-completion-index" in env["PHALANX_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]


def test_the_control_key_is_in_the_secret_only():
    cfg, sp = site().kubernetes, spec()
    job, secret = M.job(cfg, sp), M.secret(cfg, sp)
    assert sp.authkey not in json.dumps(job)
    assert secret["stringData"][M.SECRET_KEY] == sp.authkey
    env = {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["PHALANX_AUTHKEY"]["valueFrom"]["secretKeyRef"] == {"name": sp.name, "key": M.SECRET_KEY}


def test_memory_limit_defaults_to_the_request_and_the_sites_memory_is_shared_over_its_cores():
    assert M.resources(site(memory="2Gi").kubernetes, spec()) == {
        "requests": {"cpu": "1", "memory": "2Gi"},
        "limits": {"memory": "2Gi"},
    }
    assert M.resources(site(memory="2Gi", memory_limit="3Gi", gpus=1).kubernetes, spec())["limits"] == {
        "memory": "3Gi",
        "nvidia.com/gpu": "1",
    }
    s = parse(
        Site,
        {"name": "k", "executor": "kubernetes", "cores": 4, "memory_gb": 8, "kubernetes": {"image": "x"}},
        source="t",
    )
    launcher = s.create_executor().launcher(2)
    assert launcher.memory == "2048Mi"
    assert M.resources(s.kubernetes, spec(memory=launcher.memory))["limits"] == {"memory": "2048Mi"}


def test_gang_scheduling_objects_by_mode():
    native = M.job(site().kubernetes, spec(gang_api="scheduling.k8s.io/v1alpha2"))
    assert native["spec"]["template"]["spec"]["schedulingGroup"] == {"podGroupName": "phalanx-g-ab12"}
    group = M.pod_group(site().kubernetes, spec(gang_api="scheduling.k8s.io/v1alpha2"))
    assert group["spec"]["schedulingPolicy"]["gang"]["minCount"] == 3
    volcano_cfg = site(gang="volcano", queue="q").kubernetes
    vjob = M.job(volcano_cfg, spec(gang_api="scheduling.volcano.sh/v1beta1"))
    assert vjob["spec"]["template"]["spec"]["schedulerName"] == "volcano"
    assert M.pod_group(volcano_cfg, spec(gang_api="scheduling.volcano.sh/v1beta1"))["spec"] == {
        "minMember": 3,
        "queue": "q",
    }
    kueue = M.job(site(gang="kueue", queue="team").kubernetes, spec())
    assert kueue["spec"]["suspend"] is True
    assert kueue["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team"
    assert M.pod_group(site(gang="none").kubernetes, spec()) is None


def test_service_network_names_rank_pods_through_a_headless_service():
    cfg = site(network="service").kubernetes
    job, svc = M.job(cfg, spec()), M.service(cfg, spec())
    assert job["spec"]["template"]["spec"]["subdomain"] == "phalanx-g-ab12"
    assert "hostNetwork" not in job["spec"]["template"]["spec"]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {M.JOB_LABEL: "phalanx-g-ab12"}


def test_job_names_fit_kubernetes_rules_for_any_gang_id():
    for gang_id in ("20261123-120000-12345-abcdef", "X" * 80, "a_b.c"):
        name = M.job_name("phalanx", gang_id)
        assert len(name) <= 52 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), name
    assert M.job_name("phalanx", "g") != M.job_name("phalanx", "g")  # a retry never meets its predecessor


def test_host_mounts_share_the_drivers_python_read_only_and_the_store_read_write(tmp_path, monkeypatch):
    store = tmp_path / "store"
    store.mkdir()
    monkeypatch.chdir(tmp_path)
    mounts = dict(host_mounts(_host_paths(["auto", "/usr:ro"]), {"PHALANX_STORE": str(store)}))
    assert mounts[os.path.realpath(store)] is False  # written by ranks, under a read-only cwd
    assert mounts[os.path.realpath(tmp_path)] is True  # the working directory
    assert mounts["/usr"] is True
    import sys

    prefix = os.path.realpath(sys.base_prefix)
    assert any(prefix == p or prefix.startswith(p.rstrip("/") + "/") for p in mounts)
    # nested paths of one mode are mounted once
    assert not [p for p in mounts if p != "/usr" and p.startswith("/usr/") and mounts[p]]


def test_cpu_quantities():
    assert cpu_cores("500m") == 0.5 and cpu_cores(2) == 2.0
    assert KubernetesConfig(cpu="500m").threads() == 1 and KubernetesConfig(cpu=4).threads() == 4


def test_a_config_error_fails_the_rank_but_a_kubelet_cache_sync_timeout_is_waited_out():
    from types import SimpleNamespace as W

    from phalanx.executors.kubernetes.launcher import hopeless

    assert hopeless(W(reason="CreateContainerConfigError", message='secret "phalanx-x" not found'))
    assert hopeless(W(reason="ImagePullBackOff", message=None))
    # a loaded kubelet's secret manager: it retries by itself (seen in CI), the start timeout bounds it
    assert not hopeless(
        W(
            reason="CreateContainerConfigError",
            message="failed to sync secret cache: timed out waiting for the condition",
        )
    )
    assert not hopeless(W(reason="ContainerCreating", message=None))


def test_workload_jobset_holds_the_same_indexed_job_and_never_restarts_it():
    cfg = site(workload="jobset", exclusive_topology="topology.kubernetes.io/zone").kubernetes
    js, job = M.jobset(cfg, spec()), M.job(site().kubernetes, spec())
    assert js["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and js["kind"] == "JobSet"
    assert js["metadata"]["name"] == "phalanx-g-ab12"
    assert js["metadata"]["labels"][M.GANG_LABEL] == "phalanx-g-ab12"  # what release() deletes by
    assert js["metadata"]["annotations"] == {M.EXCLUSIVE_TOPOLOGY: "topology.kubernetes.io/zone"}
    assert js["spec"]["failurePolicy"] == {"maxRestarts": 0}  # a stage retries on a fresh gang
    (rj,) = js["spec"]["replicatedJobs"]
    assert rj["replicas"] == 1
    inner = rj["template"]["spec"]
    # the Job a JobSet makes is the Job phalanx makes without one (less what is the JobSet's)
    assert inner == {k: v for k, v in job["spec"].items() if k != "ttlSecondsAfterFinished"}
    assert js["spec"]["ttlSecondsAfterFinished"] == job["spec"]["ttlSecondsAfterFinished"]
    assert M.pod_spec(js) == M.pod_spec(job) == job["spec"]["template"]["spec"]
    assert M.workload(cfg, spec())["kind"] == "JobSet" and M.workload(site().kubernetes, spec())["kind"] == "Job"
    # kueue admits the JobSet: it is what is suspended and labelled
    kq = M.jobset(site(workload="jobset", gang="kueue", queue="team").kubernetes, spec())
    assert kq["spec"]["suspend"] is True and "suspend" not in kq["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert kq["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team"
    # objects made before it are owned by it: deleted with it
    ref = M.owner_reference({**js, "metadata": {**js["metadata"], "uid": "u-1"}})
    assert (ref["apiVersion"], ref["kind"], ref["uid"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet", "u-1")


def test_workload_jobset_service_network_names_rank_pods_as_the_jobset_does():
    cfg = site(workload="jobset", network="service").kubernetes
    js = M.jobset(cfg, spec())
    assert js["spec"]["network"] == {"enableDNSHostnames": True, "subdomain": "phalanx-g-ab12"}
    assert M.rank_host(cfg, "phalanx-g-ab12", 0) == "phalanx-g-ab12-r-0-0.phalanx-g-ab12.default.svc"
    assert (
        M.rank_host(site(network="service").kubernetes, "phalanx-g-ab12", 0)
        == "phalanx-g-ab12-0.phalanx-g-ab12.default.svc"
    )
    # the longest gang name still gives rank 9999 a hostname within 63 characters
    name = M.job_name("phalanx", "X" * 80)
    assert len(f"{name}-{M.REPLICATED_JOB}-0-9999") <= 63
    assert M.jobset(site(workload="jobset").kubernetes, spec())["spec"]["network"] == {"enableDNSHostnames": False}


def test_exclusive_topology_needs_workload_jobset():
    from phalanx.executors.kubernetes.executor import KubernetesExecutor

    ex = KubernetesExecutor(site(exclusive_topology="rack").kubernetes, site="k")
    with pytest.raises(ValueError, match="exclusive_topology.*workload: jobset"):
        ex.check(2)
    with pytest.raises(ConfigError, match="workload"):
        site(workload="jobsets")


@pytest.mark.parametrize(
    "status, cause",
    [
        ({"phase": "Failed", "terminated": "OOMKilled"}, "oom"),
        ({"phase": "Failed", "reason": "Evicted"}, "preempted"),
        ({"phase": "Failed", "reason": "DeadlineExceeded"}, "timeout"),
        ({"phase": "Running", "disruption": "PreemptionByScheduler"}, "preempted"),
        ({"phase": "Running", "disruption": "DeletionByTaintManager"}, "node_lost"),
        ({"phase": "Failed", "reason": "NodeLost"}, "node_lost"),
        ({"phase": "Failed", "terminated": "Error"}, None),  # the rank exited: its exit code says
        ({"phase": "Succeeded"}, None),
    ],
)
def test_why_kubernetes_ended_a_pod_is_the_cause_a_retry_policy_names(status, cause):
    """``pod_end_cause`` reads the pod as the API server returns it (the client's own models):
    OOMKilled, eviction, preemption, a lost node, a deadline."""
    pytest.importorskip("kubernetes")
    from kubernetes.client import (
        V1ContainerState,
        V1ContainerStateTerminated,
        V1ContainerStatus,
        V1ObjectMeta,
        V1Pod,
        V1PodCondition,
        V1PodStatus,
    )

    from phalanx.executors.kubernetes.launcher import pod_end_cause

    containers = []
    if "terminated" in status:
        ended = V1ContainerStateTerminated(exit_code=137, reason=status["terminated"])
        containers.append(
            V1ContainerStatus(
                name=M.CONTAINER,
                state=V1ContainerState(terminated=ended),
                image="x",
                image_id="",
                ready=False,
                restart_count=0,
            )
        )
    conditions = (
        [V1PodCondition(type="DisruptionTarget", status="True", reason=status["disruption"])]
        if ("disruption" in status)
        else []
    )
    pod = V1Pod(
        metadata=V1ObjectMeta(name="r0"),
        status=V1PodStatus(
            phase=status["phase"], reason=status.get("reason"), container_statuses=containers, conditions=conditions
        ),
    )
    assert pod_end_cause(pod) == cause
