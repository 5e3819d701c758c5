"""RADICAL-Pilot executor: one pilot per run, every gang a task with ``ranks = N`` on it.

RADICAL-Pilot (RP) holds an allocation — a *pilot*: an agent on a machine's nodes, started
by fork on this machine (``local.localhost``) or as a batch job on a supercomputer — and runs
tasks on its cores without queueing each one.  phalanx submits one pilot per run
(``open_run``; the first gang waits for it within its start timeout) and cancels it when the
run ends (``close_run``); every gang is one RP task of ``ranks = N`` and ``cores_per_rank``
cores, whose ranks take their rank from ``RP_RANK``.  The pattern of Radical-Cylon, on RP's
public API (``rp.Session``, ``PilotManager``, ``TaskManager``; no MongoDB since RP 1.40).

- **One session per process.**  RP's session (a dozen ZeroMQ bridges and components) is the
  process's, made at the first pilot and closed at exit; each run's pilot is its own.
- **What RP needs to start here** is set for RP's own processes (``session``): the driver's
  venv (``VIRTUAL_ENV``, ``PATH``), a private resource configuration with ``resource_config``
  merged over RP's (on ``local.*``: this machine's real core count), the sandbox under the
  state directory, OpenMPI's consent to run as root, and with ``interface: lo`` every RP
  endpoint bound to loopback (radical.utils binds ``tcp://*`` otherwise).
- **Ranks' output and exit codes** are spooled into the task's sandbox by a wrapper and copied
  to the attempt's ``log_dir/rank-R.log`` (``launcher``): RP reports one exit code per task.
- **Nothing left behind.**  The pilot and every task are in the run DB before RP knows them
  (``base.held``), found again by their sandbox; ``kill`` cancels a task and ends what RP left
  of it, ``close_run`` cancels the pilot, and ``release`` (``phalanx status``/``cancel``/
  ``--resume`` after a killed driver) asks the agent through its command port and ends a
  local pilot's processes.

Site keys (``RadicalConfig``; the ``radical:`` section of a site, a stage's over it)::

    resource: local.localhost           # RP resource label (tacc.frontera, ornl.frontier, ...)
    access_schema: local | ssh | batch  # default: the resource's
    queue: normal                       # the pilot job's partition
    project: ABC123                     # its account
    cores: 64                           # cores the pilot holds (default: the site's cores, or
    nodes: 2                            #   this machine's on local.*) — or nodes
    gpus: 0
    runtime: 60                         # pilot walltime, minutes (local: a week)
    sandbox: $SCRATCH/phalanx-rp        # shared by the nodes and the driver (default: state dir)
    resource_config: {cores_per_node: 2}  # merged over RP's config of the resource
    interface: lo                       # RP's endpoints on this interface only (loopback here)
    venv: auto                          # the Python environment RP starts from
    pilot_timeout: 600                  # default: the site's start_timeout
    job_name: phalanx                   # prefix of pilot and task uids
    cores_per_rank: 1                   # per gang (a stage may override these)
    gpus_per_rank: 0
    mem_per_rank: 4096                  # MB (default: the site's memory_gb over its slots)
    pre_launch: ["module load openmpi"] # before the task's launcher (mpiexec/srun)
    pre_exec: ["source env.sh"]         # in every rank, before its program
    env: {OMP_PROC_BIND: close}         # further environment of every rank

Modules: ``config`` (the section, importable without RP), ``session`` (the process's RP
session and the environment it starts in), ``pilot`` (the run's pilot; ``release``),
``launcher`` (one gang as one task), ``executor`` (the plug-in).  Nothing imports
``radical.pilot`` until a pilot is submitted.
"""

from .config import SITE_KEYS, RadicalConfig
from .executor import RadicalExecutor

__all__ = ["RadicalConfig", "RadicalExecutor", "SITE_KEYS"]
