"""The SLURM executor's typed section and what it builds, without a cluster: key spellings and
errors, the pilot's options and slots, capacity, ``check``, and the launchers ``launcher()``
makes (options, memory per rank, the run's pilot and hook)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

import phalanx as px
from phalanx.executors import capabilities, config_model, create
from phalanx.executors.slurm import SlurmConfig, SlurmExecutor, SlurmJobLauncher, SlurmPilot, SlurmStepLauncher

PILOT = {
    "allocation": "pilot",
    "partition": "debug",
    "time": "1:00:00",
    "nodes": 9,
    "cpus_per_task": 2,
    "pilot": {"nodes": 3, "ntasks": 6},
}


def errors(section: dict) -> list[tuple[tuple, str]]:
    """(path in the section, message) of each error, as a site file reports them."""
    with pytest.raises(ValidationError) as info:
        SlurmConfig.model_validate(section)
    return [(err["loc"] + tuple(err.get("ctx", {}).get("keys", ())), err["msg"]) for err in info.value.errors()]


@pytest.mark.parametrize(
    "section,expected",
    [
        ({"partiton": "debug"}, [(("partiton",), "unknown key (did you mean 'partition'?)")]),
        ({"pilot": {"nodes": 2, "nodez": 2}}, [(("pilot", "nodez"), "unknown key (did you mean 'nodes'?)")]),
        (
            {"partition": ["a", "b"]},
            [(("partition",), "must be a string, number or true/false (sbatch --partition=VALUE)")],
        ),
        (
            {"pilot": {"time": {"h": 1}}},
            [(("pilot", "time"), "must be a string, number or true/false (sbatch --time=VALUE)")],
        ),
        (
            {"mem-per-cpu": None},
            [(("mem-per-cpu",), "must be a string, number or true/false (sbatch --mem-per-cpu=VALUE)")],
        ),
        (
            {"mem-per-cpu": "1G", "mem_per_cpu": "2G"},
            [(("mem_per_cpu",), "given twice (as 'mem-per-cpu' and 'mem_per_cpu')")],
        ),
        ({"ranks-per-nod": 2}, [(("ranks-per-nod",), "unknown key (did you mean 'ranks_per_node'?)")]),
        (
            {"ntasks": 4},
            [
                (
                    ("ntasks",),
                    "unknown key: a gang's tasks are its ranks (the stage's ranks:); a pilot's are pilot.ntasks",
                )
            ],
        ),
    ],
)
def test_a_bad_key_or_option_is_named_at_its_key(section, expected):
    assert errors(section) == expected


def test_phalanx_keys_are_typed():
    assert [(loc, t) for loc, t in ((e["loc"], e["type"]) for e in _raw({"mpi": {"pmix": True}}))] == [
        (("mpi",), "string_type")
    ]  # "slurm.mpi: must be a string"
    assert [e["type"] for e in _raw({"prologue": "module load x"})] == ["list_type"]
    assert [e["type"] for e in _raw({"allocation": "pilots"})] == ["literal_error"]
    assert [e["type"] for e in _raw({"pilot": {"ntasks": "4"}})] == ["int_type"]
    assert [e["type"] for e in _raw({"poll_interval": 0})] == ["greater_than"]
    assert [e["type"] for e in _raw({"job_name": "a b"})] == ["string_pattern_mismatch"]


def _raw(section: dict) -> list[dict]:
    with pytest.raises(ValidationError) as info:
        SlurmConfig.model_validate(section)
    return info.value.errors()


def test_spellings_aliases_and_the_pilots_options():
    cfg = SlurmConfig.model_validate({**PILOT, "ranks-per-node": 2, "spread-job": True, "exclusive": False})
    assert cfg.model_dump(exclude_unset=True)["ntasks_per_node"] == 2
    assert cfg.options() == {
        "partition": "debug",
        "time": "1:00:00",
        "nodes": 9,
        "cpus-per-task": 2,
        "ntasks-per-node": 2,
        "spread-job": True,
        "exclusive": False,
    }
    # the pilot: the section's options less those sizing one gang, under its own keys
    pilot = cfg.pilot_config()
    assert pilot.options() == {
        "partition": "debug",
        "time": "1:00:00",
        "spread-job": True,
        "exclusive": False,
        "nodes": 3,
    }
    assert pilot.ntasks == 6 and cfg.slots() == 6
    assert SlurmConfig.model_validate({**PILOT, "allocation": "per-stage"}).slots() is None
    assert SlurmConfig.model_validate({"allocation": "pilot", "pilot": {"nodes": 2, "ranks_per_node": 4}}).slots() == 8
    assert config_model("slurm") is SlurmConfig
    schema = SlurmConfig.model_json_schema()
    assert "pilot" in schema["properties"]["allocation"]["description"]
    assert schema["properties"]["mem_per_cpu"]["description"].startswith("sbatch/srun --mem-per-cpu")


def test_capacity_is_the_pilots_ntasks_and_cores_may_not_exceed_it():
    assert SlurmExecutor(PILOT).capacity() == 6
    assert SlurmExecutor(PILOT, cores=4).capacity() == 4
    assert SlurmExecutor({"partition": "debug"}).capacity() is None  # per stage: the queue decides
    assert SlurmExecutor({"partition": "debug"}, cores=64).capacity() == 64
    with pytest.raises(ValueError, match=r"cores: 8 is more than the 6 tasks the pilot holds \(slurm.pilot.ntasks\)"):
        create("slurm", PILOT, cores=8)
    caps = capabilities("slurm")
    assert (caps.reuse_gangs, caps.pins_cpus, caps.runs_commands, caps.mpi_world, caps.remote_ranks) == (
        False,
        False,
        True,
        True,
        True,
    )


def test_check_refuses_what_a_launch_would_without_starting_anything():
    ex = SlurmExecutor(PILOT, site="hpc")
    ex.check(6, ex.config)
    with pytest.raises(px.GangError, match=r"a gang of 7 ranks does not fit the pilot's 6 tasks \(site 'hpc'\)"):
        ex.check(7, ex.config)
    with pytest.raises(ValueError, match="a stage cannot change it"):
        ex.check(2, ex.stage_config({"pilot": {"ntasks": 2}}))
    with pytest.raises(ValueError, match=r"slurm.cpus_per_task: must be a whole number ≥ 1, not 'two'"):
        ex.check(2, ex.stage_config({"cpus-per-task": "two"}))
    per_stage = SlurmExecutor({"partition": "debug"})
    per_stage.check(500, per_stage.config)  # a job of any size: SLURM says whether it fits
    assert ex._pilot is None  # nothing was made


def test_launchers_get_the_gangs_options_and_the_runs_hook():
    hook = object()
    ex = SlurmExecutor({"partition": "debug", "ranks_per_node": 2, "cpus_per_task": 2}, site="hpc", rank_memory=3 << 30)
    ex.open_run(hook=hook)
    job = ex.launcher(5)
    assert isinstance(job, SlurmJobLauncher) and job.allocation_hook is hook and job.site == "hpc"
    # nodes from ranks_per_node; the site's memory per rank over its CPUs as --mem-per-cpu
    assert job.options == {"partition": "debug", "ntasks-per-node": 2, "nodes": 3, "mem-per-cpu": "1536M"}
    assert job.cpus_per_rank == 2 and job.placement(1) == [{"PHALANX_THREADS": "2"}]
    stage = ex.launcher(2, config=ex.stage_config({"mem": "10G", "time": "5:00", "nodes": 1}))
    assert stage.options == {"partition": "debug", "ntasks-per-node": 2, "nodes": 1, "mem": "10G", "time": "5:00"}
    assert job.status() == "slurm: not launched" and job.reason() is None and job.memory_note(0) == ""
    assert job.redirect(job.log_dir) is False  # srun's --output is fixed at launch
    ex.close_run()  # no pilot: nothing to do


def test_the_pilot_is_the_executors_own_made_on_first_use():
    a, b = SlurmExecutor(PILOT), SlurmExecutor(PILOT)
    hook = object()
    a.open_run(hook=hook)
    assert a._pilot is None  # nothing before a gang needs it
    step = a.launcher(2)
    assert isinstance(step, SlurmStepLauncher) and step.pilot is a.pilot() and step.pilot.hook is hook
    assert step.pilot.ntasks == 6 and step.pilot.options == {"partition": "debug", "time": "1:00:00", "nodes": 3}
    assert b.launcher(2).pilot is not a.pilot()  # two runs, two pilots
    a.close_run()  # never started: nothing to cancel
    assert a._pilot is None and a.launcher(2).pilot is not step.pilot  # the next run gets a fresh one
    # a pilot the caller gives stays the caller's
    mine = SlurmPilot({"nodes": 1, "ntasks": 4})
    c = SlurmExecutor({"allocation": "pilot"}, pilot=mine)
    assert c.launcher(2).pilot is mine and c.capacity() == 4
    c.close_run()
    assert c.pilot() is mine


def test_from_site_in_pilot_mode_needs_a_pilot():
    from phalanx.executors.slurm import SlurmLauncher

    with pytest.raises(ValueError, match="needs pilot="):
        SlurmLauncher.from_site(PILOT, 2)
    mine = SlurmPilot({"ntasks": 2})
    assert SlurmLauncher.from_site(PILOT, 2, pilot=mine).pilot is mine
    assert SlurmLauncher.from_site({"time": "1:00"}, 2, nodes=1).options == {"time": "1:00", "nodes": 1}
