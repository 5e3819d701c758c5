"""Ray executor: a gang is one Ray placement group with one actor per rank.

CylonFlow-on-Ray's stateful actors: the placement group reserves every rank's bundle at once
(all or nothing: wait for it with a timeout, else remove it and fail with Ray's reason), then
one actor per rank is scheduled on its bundle and runs the phalanx rank worker
(``phalanx.runtime.worker.main``) *inside the actor process*.  So

- killing the actor kills the rank: the rank's control connection drops, and the gang fails
  fast exactly as when a local rank process dies;
- the communicator (Gloo) is built once per gang and kept across apps (a persistent
  ``px.Gang`` reuses the same actors, same PIDs);
- ranks talk to each other over Gloo directly (TCP), out of band: Ray's object store carries
  nothing but the actors' tiny start-up calls.

Differences from the local executor, by design:

- ``argv`` is not executed when it is the phalanx worker (``python -m phalanx.runtime.worker``):
  the actor calls the worker's ``main()`` in-process.  Any other ``argv`` (a command stage's
  program) runs as a child process of the actor that dies with it; the driver's Python path
  in ``argv[0]`` becomes the node's own, and the driver's working directory is used where it
  exists on the node.
- The actor is a process the raylet started, so the worker's parent-death signal does not
  apply: Ray itself kills a job's actors and placement groups when the driver exits.  CPU
  pinning is dropped too (Ray reserves CPUs as counts, not core ids); ``PHALANX_THREADS`` is
  the bundle's CPU count.
- Rank output goes to ``log_dir/rank-R.log`` written by the actor itself (its stdout and
  stderr file descriptors are redirected there).  On a multi-host cluster ``log_dir`` must be
  on a shared filesystem for the driver to show a failed rank's last lines (and for ``echo``).
- A dead actor's rank reports exit code -9 (SIGKILL), and Ray's reason is appended to its log
  (``[phalanx ray] the rank's Ray actor died: ...``), which the gang's error shows.

Locality: ``RayLauncher.prefer_hosts`` pins rank r's bundle to the node named (host name or
node IP) by ``hosts[r]`` with Ray's built-in ``node:<ip>`` resource (the scheduler asks it for
the hosts holding most of a stage's input).

When the driver dies: the rank actors are named (``phalanx-<gang>-rankR``) but not detached, so
they and the placement group belong to the driver's Ray job.  Measured on Ray 2.60 with the
driver SIGKILLed: the GCS marks the job finished, kills its actors and removes its placement
groups within 0.3 s.  Where Ray would keep them longer (a Ray Client driver keeps its job for a
reconnect grace period; a partitioned driver), the placement group is in the run DB from before
its creation (``base.held``) and ``release`` removes it and kills its actors.

The modules, one job each: ``config`` (the ``ray:`` section, importable without Ray),
``executor`` (``RayExecutor``: capacity, checks, a launcher per gang), ``launcher``
(``RayLauncher``: placement group, actors, exit codes, logs), ``actor`` (the code that runs in
the rank actor), ``placement`` (why a group cannot be placed), ``network`` (reachability and the
rendezvous address), ``connection`` (this process's connection to Ray), ``release`` (free a
recorded gang from any process), ``services`` (one store service per node for a run whose store
is a directory root: each node's own /dev/shm, read by the others through it).  None imports ``ray`` until a gang needs it.

Site section (all optional; ``RayConfig`` documents each key)::

    ray:
      address: auto            # auto | host:port of the GCS | ray://host:10001 | local
      namespace: phalanx
      strategy: PACK           # STRICT_PACK | PACK | SPREAD | STRICT_SPREAD
      cpus_per_rank: 1         # the CPU count of every rank's bundle
      resources: {}            # extra resources of every bundle, or a list with one per rank
      ready_timeout_s: 60      # how long to wait for the whole placement group (at most start_timeout)
      runtime_env: {}          # Ray runtime_env of the rank actors (pip, env_vars, ...)
      init: {}                 # extra keyword arguments of ray.init()
"""

from .actor import ENV_ACTOR_ID, ENV_NODE_ID, ENV_NODE_IP, RankActor
from .config import SITE_KEYS, STRATEGIES, RayConfig, ray_config
from .connection import connect, import_ray
from .executor import RayExecutor
from .launcher import RayLauncher
from .placement import diagnose
from .release import release

__all__ = [
    "ENV_ACTOR_ID",
    "ENV_NODE_ID",
    "ENV_NODE_IP",
    "SITE_KEYS",
    "STRATEGIES",
    "RankActor",
    "RayConfig",
    "RayExecutor",
    "RayLauncher",
    "connect",
    "diagnose",
    "import_ray",
    "ray_config",
    "release",
]
