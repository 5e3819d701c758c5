"""SLURM executor: the ranks of a gang are the tasks of one ``srun``.

Driven through SLURM's own commands (``sbatch``, ``srun``, ``squeue``, ``sacct``, ``scancel``):
pyslurm does not build against the Slurm 22.05 of Debian 12, and the commands work with every
Slurm a site runs.  Two ways to get the nodes, chosen by the site's ``slurm:`` section:

``allocation: per-stage`` (default)
    Every gang is its own batch job: ``sbatch`` of a script whose body ``srun``\\ s the ranks.
    Simple and fair to other users; every stage queues once.  One-rank gangs that start
    together (a fan-out's instances) go as ONE job array, each gang a task ``A_i``
    (``arrays.py``); one ``squeue`` polls all the run's jobs (``commands.JobWatcher``).
``allocation: pilot``
    One allocation (a ``SlurmPilot``: a holder job submitted with ``sbatch`` that sleeps) is
    held for the whole run, and every gang is a job step ``srun --jobid=J --exact -n N`` on
    a share of it: no queueing per stage (the RADICAL-Pilot / Parsl pattern).  Concurrent gangs
    get disjoint CPUs (``--exact``); a gang that does not fit waits until a step ends.  The
    pilot belongs to the run's ``SlurmExecutor`` (made for its first gang, cancelled by
    ``close_run``); the site's slots are its ntasks.  For a directory store it also runs one
    store service per node for its whole life (``pilot.py``).

``SlurmExecutor`` (``executor.py``) is the plug-in: its config model ``SlurmConfig``
(``config.py``) types the section below; ``launcher()`` gives a ``SlurmJobLauncher`` or a
``SlurmStepLauncher`` (``launcher.py``).

Ranks learn their rank from ``SLURM_PROCID`` (a small shell wrapper also exports it as
``PHALANX_RANK`` for command stages); everything else in their environment is common to all
ranks and passed through ``--export=ALL``.  Each rank's stdout and stderr go to
``log_dir/rank-N.log`` (``srun --output=.../rank-%t.log``), its exit code to
``log_dir/rank-N.exit`` (written by the wrapper), so ``log_dir`` must be on a filesystem the
compute nodes and the driver share.  SLURM's own view — job state and reason — comes from
``squeue`` (``sacct`` once the job has left the controller's memory) and is reported by
``status()`` and ``reason()``; a job that can never start (e.g. PENDING (PartitionNodeLimit))
or that sbatch rejects raises ``GangError`` naming the site and SLURM's reason.

Site keys (the ``slurm:`` section of a site file, or of a stage over the site's; ``-`` and
``_`` are interchangeable; ``SlurmConfig`` holds the full list)::

    allocation: per-stage | pilot       # default per-stage
    conf: /path/to/slurm.conf           # SLURM_CONF for every command (a private cluster)
    partition, account, qos, time, nodes, mem, mem_per_cpu, constraint, reservation, gres,
    gpus_per_task, exclusive, nodelist, exclude, ...    # sbatch/srun options, as on the CLI
    ranks_per_node: 1                   # --ntasks-per-node; nodes = ceil(ranks / this)
    mem_per_cpu: 4G                     # default: the site's memory_gb over its slots
    spread_job: true                    # --spread-job: a gang over as many nodes as possible
    cpus_per_task: 2                    # default: the stage's CPUs per rank
    mpi: pmix                           # srun --mpi=... (communicator: mpi)
    prologue: ["module load python"]    # shell lines run before srun (per-stage mode)
    sbatch_args: [...], srun_args: [...]  # anything else, verbatim
    srun_via: [CMD, ARG]                # pilot steps: the driver's srun runs under it (env passed)
    array: true                         # per-stage: one-rank gangs starting together = one job array
    array_window: 0.2                   # ...gathered until this long passes with none joining
    array_max: 1000                     # ...at most this many tasks (under MaxArraySize)
    poll_interval: 0.5                  # seconds between squeue calls (one for all the run's jobs)
    pending_timeout: 600                # fail a gang whose job is PENDING longer (default: wait)
    job_name: phalanx                   # prefix of job and step names
    pilot:                              # allocation: pilot — the held allocation
      nodes: 4
      ntasks: 64                        # rank slots held: the site's capacity (or nodes x ntasks_per_node)
      time: "12:00:00"                  # plus partition/account/qos/... (default: from above)
"""

from .commands import ACTIVE, FAILED, HOPELESS, JobInfo, SlurmCommands, release
from .config import OPTION_KEYS, SlurmConfig, SlurmPilotConfig
from .executor import SlurmExecutor
from .launcher import SlurmJobLauncher, SlurmLauncher, SlurmStepLauncher
from .pilot import SlurmPilot

__all__ = [
    "ACTIVE",
    "FAILED",
    "HOPELESS",
    "OPTION_KEYS",
    "JobInfo",
    "SlurmCommands",
    "SlurmConfig",
    "SlurmExecutor",
    "SlurmJobLauncher",
    "SlurmLauncher",
    "SlurmPilot",
    "SlurmPilotConfig",
    "SlurmStepLauncher",
    "release",
]
