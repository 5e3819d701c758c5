"""``config_from_site``: a Parsl ``Config`` from a phalanx site file.

Two kinds, one per placement of ``bsp_app``:

- ``mode="site"`` (default): a ``HighThroughputExecutor`` on a ``LocalProvider`` — its workers
  are gang drivers; phalanx's executor for the site places the ranks (local processes, SLURM jobs
  or pilot steps, Ray...).  One worker per block by default, so a persistent gang is one per block.
- ``mode="mpi"``: an ``MPIExecutor`` whose tasks start their ranks with ``$PARSL_MPI_PREFIX``:
  on a SLURM site a ``SlurmProvider`` block (sbatch with the site's partition, account, QOS,
  time...) and ``srun``; on this machine a ``LocalProvider`` with a nodefile and an ``mpiexec``
  that takes Parsl's MPICH-style prefix (a wrapper for Open MPI, written into the run directory,
  when the ``mpiexec`` found is Open MPI's).

Every listener is on ``driver_host`` of the site (``127.0.0.1`` unless the site says ``auto``
or an address: workers on other machines must reach the interchange).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

from ...runtime.envvars import ENV_PREFIX

MODES = ("site", "mpi")

# Open MPI settings of phalanx's mpirun executor (executors/mpirun.py: one host, shared memory)
_OMPI_MCA = {"btl": "self,vader", "orte_abort_on_non_zero_status": "1", "odls_base_sigkill_timeout": "0"}

_WRAPPER = """\
#!{python} -S
# mpiexec with MPICH/Hydra's options (Parsl's $PARSL_MPI_PREFIX: -n N -ppn P -hosts H1,H2) for
# Open MPI; written by phalanx.integrations.parsl.config_from_site.
import os, sys
OMPI = {ompi!r}
MCA = {mca!r}
args, n, ppn, hosts = sys.argv[1:], None, None, None
while args and args[0] in ("-n", "-np", "-ppn", "-hosts", "-host"):
    flag, value, args = args[0], args[1], args[2:]
    if flag in ("-n", "-np"):
        n = value
    elif flag == "-ppn":
        ppn = value
    else:
        hosts = value
cmd = [OMPI, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none"]
if n:
    cmd += ["-np", n]
if hosts:
    cmd += ["--host", ",".join(h + ":" + (ppn or n or "1") for h in hosts.split(","))]
if ppn:
    cmd += ["--map-by", "ppr:" + ppn + ":node"]
for key, value in MCA.items():
    cmd += ["--mca", key, value]
for name in sorted(os.environ):  # names only: values (the control key) stay out of ps
    if name.startswith({prefix!r}) or name in ("PYTHONPATH", "PYTHONUNBUFFERED"):
        cmd += ["-x", name]
os.execv(OMPI, cmd + args)
"""


def config_from_site(
    site: Any = "local",
    *,
    mode: str = "site",
    run_dir: str | os.PathLike | None = None,
    label: str | None = None,
    workers: int = 1,
    nodes_per_block: int | None = None,
    max_blocks: int = 1,
    walltime: str | None = None,
    ranks_per_node: int | None = None,
    worker_init: str = "",
    mpiexec: str = "auto",
    strategy_period: float = 0.2,
    **config: Any,
) -> Any:
    """A Parsl ``Config`` for ``site`` (a name from site-configs/, a file, or a loaded ``Site``).

    ``mode``: ``"site"`` (HTEX; ``bsp_app`` places ranks with phalanx's executor for the site)
    or ``"mpi"`` (MPIExecutor; ranks through ``$PARSL_MPI_PREFIX``: srun on a SLURM site,
    mpiexec here).  ``workers``: apps one block runs at once; ``nodes_per_block``: nodes of an
    MPI block (default: the site's ``slurm.nodes``, else 1); ``walltime``: a SLURM block's time
    (default: the site's ``slurm.time``); ``ranks_per_node``: CPUs a SLURM MPI block holds on each
    node for ranks (default: the site's ``slurm.ranks_per_node``, else 1); ``worker_init``: shell
    lines before the workers start;
    ``mpiexec``: ``"auto"`` (a wrapper when the ``mpiexec`` on PATH is Open MPI's), ``"wrapper"``
    or the path of an MPICH/Hydra ``mpiexec``; further keywords go to ``Config``.
    """
    from parsl.config import Config

    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    site = _site(site)
    run_dir = Path(run_dir or "runinfo").absolute()
    support = run_dir / "phalanx"
    support.mkdir(parents=True, exist_ok=True)
    address = _address(site.driver_host)
    init = [f"export PATH={shlex.quote(str(Path(sys.executable).parent))}:$PATH"] + _site_env(site)
    if mode == "site":
        executor = _htex(site, label or "phalanx", address, workers, max_blocks, init, worker_init)
    elif site.executor == "slurm":
        executor = _slurm_mpi(
            site,
            label or "phalanx-mpi",
            address,
            workers,
            nodes_per_block,
            max_blocks,
            walltime,
            ranks_per_node,
            init,
            worker_init,
        )
    elif site.executor in ("local", "mpirun"):
        executor = _local_mpi(
            site, label or "phalanx-mpi", address, workers, nodes_per_block, init, worker_init, support, mpiexec
        )
    else:
        raise ValueError(
            f"mode 'mpi' needs a SLURM site or this machine (executor local or mpirun); site "
            f"{site.name!r} has executor {site.executor!r}: use mode 'site' (phalanx's executor "
            "places the ranks)"
        )
    options = {
        "strategy": "none",
        "strategy_period": strategy_period,
        "usage_tracking": 0,
        "run_dir": str(run_dir),
        **config,
    }
    return Config(executors=[executor], **options)


# What an MPIExecutor task takes from the site (it has no site of its own): where ranks reach
# their driver, how they rendezvous, and the store (read by BSPTask and by Store()).


def _site_env(site: Any) -> list[str]:
    from ...runtime.envvars import ENV_PARSL_DRIVER_HOST, ENV_PARSL_RENDEZVOUS, ENV_STORE, ENV_STORE_METADATA

    env = {ENV_PARSL_DRIVER_HOST: site.driver_host, ENV_PARSL_RENDEZVOUS: site.rendezvous}
    if site.store.root:
        env[ENV_STORE] = site.store.root
    if site.store.metadata:
        env[ENV_STORE_METADATA] = site.store.metadata
    return [f"export {k}={shlex.quote(str(v))}" for k, v in env.items()]


def _site(site: Any) -> Any:
    if hasattr(site, "create_executor"):
        return site
    from ...orchestrator.loading import load_site

    return load_site(str(site))


def _address(driver_host: str) -> str:
    if driver_host == "auto":
        from parsl.addresses import address_by_hostname

        return address_by_hostname()
    return driver_host


def _htex_commands(mpi: bool = False) -> dict[str, Any]:
    """The interchange and worker pool of this interpreter's Parsl (no PATH lookup of its scripts)."""
    scripts = Path(sysconfig.get_path("scripts"))
    out: dict[str, Any] = {}
    if (scripts / "interchange.py").exists():
        # MPIExecutor types it as one string (run as a program: the script's own #! line)
        out["interchange_launch_cmd"] = (
            str(scripts / "interchange.py") if mpi else [sys.executable, str(scripts / "interchange.py")]
        )
    if (scripts / "process_worker_pool.py").exists():
        from parsl.executors.high_throughput.executor import DEFAULT_LAUNCH_CMD

        out["launch_cmd"] = DEFAULT_LAUNCH_CMD.replace(
            "process_worker_pool.py",
            f"{shlex.quote(sys.executable)} {shlex.quote(str(scripts / 'process_worker_pool.py'))}",
            1,
        )
    return out


def _htex(site: Any, label: str, address: str, workers: int, max_blocks: int, init: list[str], worker_init: str) -> Any:
    from parsl.executors import HighThroughputExecutor
    from parsl.launchers import SimpleLauncher
    from parsl.providers import LocalProvider

    provider = LocalProvider(
        init_blocks=1,
        min_blocks=0,
        max_blocks=max_blocks,
        launcher=SimpleLauncher(),
        worker_init="\n".join(init + [worker_init]),
    )
    return HighThroughputExecutor(
        label=label,
        address=address,
        loopback_address="127.0.0.1",
        max_workers_per_node=workers,
        cores_per_worker=1e-6,
        provider=provider,
        **_htex_commands(),
    )


def _local_mpi(
    site: Any,
    label: str,
    address: str,
    workers: int,
    nodes_per_block: int | None,
    init: list[str],
    worker_init: str,
    support: Path,
    mpiexec: str,
) -> Any:
    from parsl.executors import MPIExecutor
    from parsl.launchers import SimpleLauncher
    from parsl.providers import LocalProvider

    if (nodes_per_block or 1) != 1:
        raise ValueError("this machine is one node: nodes_per_block must be 1 in mode 'mpi' on a local site")
    nodefile = support / "nodefile"
    nodefile.write_text("localhost\n")
    init = init + [f"export PBS_NODEFILE={shlex.quote(str(nodefile))}"]
    bin_dir = mpiexec_dir(support / "bin", mpiexec)
    if bin_dir is not None:
        init.append(f"export PATH={shlex.quote(str(bin_dir))}:$PATH")
    provider = LocalProvider(
        init_blocks=1,
        min_blocks=0,
        max_blocks=1,
        launcher=SimpleLauncher(),
        worker_init="\n".join(init + [worker_init]),
    )
    return MPIExecutor(
        label=label,
        address=address,
        loopback_address="127.0.0.1",
        max_workers_per_block=workers,
        mpi_launcher="mpiexec",
        provider=provider,
        **_htex_commands(mpi=True),
    )


def _slurm_mpi(
    site: Any,
    label: str,
    address: str,
    workers: int,
    nodes_per_block: int | None,
    max_blocks: int,
    walltime: str | None,
    ranks_per_node: int | None,
    init: list[str],
    worker_init: str,
) -> Any:
    from parsl.executors import MPIExecutor
    from parsl.launchers import SimpleLauncher

    cfg = site.section()
    opts = cfg.options() if cfg is not None else {}
    nodes = nodes_per_block or (opts.get("nodes") if isinstance(opts.get("nodes"), int) else None) or 1
    per_node = opts.get("ntasks-per-node")
    per_node = ranks_per_node or (per_node if isinstance(per_node, int) and not isinstance(per_node, bool) else 1)
    scheduler = [f"#SBATCH {arg}" for arg in (cfg.sbatch_args if cfg is not None else [])]
    for key in ("mem", "mem-per-cpu", "reservation", "licenses", "wckey", "exclude", "nodelist"):
        if opts.get(key) not in (None, False):
            scheduler.append(f"#SBATCH --{key}" + ("" if opts[key] is True else f"={opts[key]}"))
    lines = init + list(cfg.prologue if cfg is not None else []) + [worker_init]
    if cfg is not None and cfg.mpi:  # srun's --mpi for the ranks' steps (communicator: mpi), as the executor's
        lines.insert(0, f"export SLURM_MPI_TYPE={shlex.quote(cfg.mpi)}")
    provider = slurm_provider(
        conf=cfg.conf if cfg is not None else None,
        partition=_str(opts.get("partition")),
        account=_str(opts.get("account")),
        qos=_str(opts.get("qos")),
        constraint=_str(opts.get("constraint")),
        nodes_per_block=nodes,
        cores_per_node=per_node,
        init_blocks=1,
        min_blocks=0,
        max_blocks=max_blocks,
        walltime=walltime or _str(opts.get("time")) or "00:30:00",
        exclusive=opts.get("exclusive") is True,
        scheduler_options="\n".join(scheduler),
        worker_init="\n".join(lines),
        launcher=SimpleLauncher(),
        cmd_timeout=30,
    )
    return MPIExecutor(
        label=label,
        address=address,
        loopback_address="127.0.0.1",
        max_workers_per_block=workers,
        mpi_launcher="srun",
        provider=provider,
        **_htex_commands(mpi=True),
    )


def _str(value: Any) -> str | None:
    return None if value in (None, False) else str(value)


def slurm_provider(conf: str | None = None, **kwargs: Any) -> Any:
    """Parsl's ``SlurmProvider`` whose every SLURM command (its first, ``sacct -X``, runs in
    the constructor) sees ``SLURM_CONF=conf``: a site's private cluster, as phalanx's SLURM
    executor runs its own commands; the block's job inherits it from sbatch."""
    from parsl.providers import SlurmProvider

    class _SiteSlurmProvider(SlurmProvider):
        slurm_conf: str | None  # set before SlurmProvider.__init__, whose first sacct needs it

        def execute_wait(self, cmd, timeout=None):
            if self.slurm_conf:
                cmd = f"SLURM_CONF={shlex.quote(self.slurm_conf)} {cmd}"
            return super().execute_wait(cmd, timeout)

    provider = _SiteSlurmProvider.__new__(_SiteSlurmProvider)
    provider.slurm_conf = os.path.expandvars(os.path.expanduser(conf)) if conf else None
    _SiteSlurmProvider.__init__(provider, **kwargs)  # SlurmProvider's
    return provider


def mpiexec_dir(directory: Path, mpiexec: str = "auto") -> Path | None:
    """A directory to put first on the workers' PATH so that ``mpiexec`` takes Parsl's
    MPICH-style prefix, or None when the ``mpiexec`` found already does (MPICH's Hydra).

    ``auto``: Open MPI's ``mpiexec`` gets a wrapper translating ``-n/-ppn/-hosts``; ``wrapper``:
    always that wrapper (Open MPI's ``mpiexec.openmpi`` or ``mpirun``); a path: that Hydra
    ``mpiexec`` (e.g. ``/usr/bin/mpiexec.mpich``) through a one-line script (a symlink would make
    Hydra look for ``hydra_pmi_proxy`` beside the link)."""
    from ...errors import MissingDependencyError

    directory.mkdir(parents=True, exist_ok=True)
    target = directory / "mpiexec"
    if mpiexec not in ("auto", "wrapper"):
        exe = shutil.which(mpiexec)
        if exe is None:
            raise MissingDependencyError(f"mpiexec {mpiexec!r} not found")
        _write_exe(target, f'#!/bin/sh\nexec {shlex.quote(exe)} "$@"\n')
        return directory
    found = shutil.which("mpiexec")
    if mpiexec == "auto" and found and _flavour(found) == "hydra":
        return None
    ompi = (
        shutil.which("mpiexec.openmpi")
        or (found if found and _flavour(found) == "openmpi" else None)
        or shutil.which("mpirun")
    )
    if ompi is None:
        raise MissingDependencyError(
            "mode 'mpi' on this machine needs an mpiexec: Open MPI (apt-get install "
            "openmpi-bin; phalanx wraps it) or MPICH (apt-get install mpich)"
        )
    _write_exe(
        target, _WRAPPER.format(python=sys.executable, ompi=os.path.realpath(ompi), mca=_OMPI_MCA, prefix=ENV_PREFIX)
    )
    return directory


def _flavour(exe: str) -> str:
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    text = (out.stdout + out.stderr).lower()
    if "hydra" in text or "mpich" in text:
        return "hydra"
    if "open mpi" in text or "openrte" in text or "open-mpi" in text:
        return "openmpi"
    return "unknown"


def _write_exe(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.chmod(0o755)
    tmp.replace(path)
