"""Every ``PHALANX_*`` environment variable, by name: one constant each, ``ENV_`` + the name
without its ``PHALANX_`` prefix, with what it carries.

Most of them are how a driver configures its ranks (an executor sets them, the rank worker reads
them back); some are user settings.  The overrides of default paths are the exception that proves
the layering rule: they are defined with their defaults in ``phalanx.paths`` (the one module that
decides default places) and only re-exported here.  Rank-side shell templates (srun's, mpirun's,
RADICAL-Pilot's wrappers) spell a few of these names inside their scripts.
"""

from __future__ import annotations

# Default paths, decided in phalanx.paths; user settings.
from ..paths import ENV_LOG_DIR as ENV_LOG_DIR  # gang (rank) log root
from ..paths import ENV_SHM_DIR as ENV_SHM_DIR  # where the per-gang shared-memory segment directory is made
from ..paths import ENV_SPILL as ENV_SPILL  # PHALANX_STORE_SPILL: where datasets over the memory budget spill
from ..paths import ENV_STATE as ENV_STATE  # run database and run logs
from ..paths import ENV_STORE as ENV_STORE  # store root: a directory, or an s3:// URL

ENV_PREFIX = "PHALANX_"  # every variable of this module starts with it

# ---- the rank protocol: set by the driver and its executor, read by the rank worker ---------------
ENV_CONTROL = "PHALANX_CONTROL"  # host:port of the driver's control listener
ENV_AUTHKEY = "PHALANX_AUTHKEY"  # hex; authenticates the control connection
ENV_RANK = "PHALANX_RANK"  # this rank's index (also for a command stage's program)
ENV_WORLD_SIZE = "PHALANX_WORLD_SIZE"  # number of ranks in the gang
ENV_RDZV = "PHALANX_RDZV"  # rendezvous URL prepared by the driver
ENV_COMM = "PHALANX_COMM"  # communicator name
ENV_GANG_ID = "PHALANX_GANG_ID"  # the gang's id (names its shared-memory segments, marks its processes)
ENV_CPUS = "PHALANX_CPUS"  # "0,1": CPU affinity for this rank
ENV_CPUS_BY_RANK = "PHALANX_CPUS_BY_RANK"  # "0|1|2,3": per rank, when all ranks share one env
ENV_THREADS = "PHALANX_THREADS"  # threads for this rank's local kernels
ENV_TIMEOUT = "PHALANX_TIMEOUT"  # seconds for rendezvous and collectives
ENV_PDEATHSIG = "PHALANX_PDEATHSIG"  # "1": die with the launching process
ENV_DRIVER_TIMEOUT = "PHALANX_DRIVER_TIMEOUT"  # seconds of silence after which the driver is gone
ENV_HOST = "PHALANX_HOST"  # where the rank runs, as its executor names it (node/pod)
ENV_BIND_HOST = "PHALANX_BIND_HOST"  # the address a rank listens on (default: the route to its peers)
ENV_PRELOAD = "PHALANX_PRELOAD"  # modules a warm worker imports before it is given a gang
ENV_PARAM_PREFIX = "PHALANX_PARAM_"  # + KEY: a command stage's params, one variable each
ENV_SAMPLE = "PHALANX_SAMPLE_S"  # seconds between a rank's resource samples while a task runs (0: off)

# ---- the DataFrame ----------------------------------------------------------------------------
# "polars" (default): a rank's local pipeline runs in Polars, or fused into the next DuckDB query,
# and one holding joins with a small side runs apart (Polars, each join on its own);
# "duckdb": as "polars", but a pipeline holding joins is one DuckDB query where it has an SQL form;
# "acero": always in Acero, never fused (the engine before 2026-11-28, for comparison)
ENV_PIPELINE_ENGINE = "PHALANX_PIPELINE_ENGINE"

# ---- the shared-memory exchange (runtime.comm.shm) ----------------------------------------------
ENV_SHM = "PHALANX_SHM"  # "0": tcp/gloo keep every byte on their wire
ENV_SHM_LIMIT = "PHALANX_SHM_LIMIT"  # bytes one rank's segments may hold (default: no limit)
ENV_SHM_POOL_MAX = "PHALANX_SHM_POOL_MAX"  # larger segments are used once, not kept for reuse
ENV_SHM_FALLBACK = "PHALANX_SHM_FALLBACK"  # "0": no room in shared memory is an error
ENV_SHM_HOSTS = "PHALANX_SHM_HOSTS"  # tests: one host label per rank, comma-separated

# ---- the store a gang's ranks open (Store.env; with ENV_STORE and ENV_SPILL above) -------------
ENV_STORE_SESSION = "PHALANX_STORE_SESSION"  # session (namespace)
ENV_STORE_METADATA = "PHALANX_STORE_METADATA"  # sqlite:///path/meta.sqlite | redis://host:port/db
ENV_STORE_BUDGET = "PHALANX_STORE_BUDGET"  # memory budget of a file-tier root, bytes ("4GiB" works)
ENV_STORE_ATTEMPT = "PHALANX_STORE_ATTEMPT"  # the run attempt: what it wrote or checked is not checked again
ENV_STORE_DURABLE = "PHALANX_STORE_DURABLE"  # write-through target (store.durable): partitions copied there too
ENV_STORE_TOKEN = "PHALANX_STORE_TOKEN"  # the store services' bearer secret itself (prefer the file)
ENV_STORE_TOKEN_FILE = "PHALANX_STORE_TOKEN_FILE"  # a 0600 file holding it (default: STATE/store.token)
ENV_STORE_SERVICE_KEY = "PHALANX_STORE_SERVICE_KEY"  # names this host's store service: ROOT/.services/KEY.json

# ---- workflows and sites -------------------------------------------------------------------------
ENV_SITE_PATH = "PHALANX_SITE_PATH"  # directories searched for <site>.yaml (os.pathsep-separated)

# ---- executors -----------------------------------------------------------------------------------
ENV_NODE = "PHALANX_NODE"  # Kubernetes: the pod's node (downward API), for ENV_HOST
ENV_POD = "PHALANX_POD"  # Kubernetes: the pod's name (downward API), for ENV_HOST
ENV_RAY_NODE_ID = "PHALANX_RAY_NODE_ID"  # Ray: the node a rank actor runs on
ENV_RAY_NODE_IP = "PHALANX_RAY_NODE_IP"  # Ray: that node's address
ENV_RAY_ACTOR_ID = "PHALANX_RAY_ACTOR_ID"  # Ray: the rank actor's id
ENV_RADICAL_BIND = "PHALANX_RADICAL_BIND"  # RADICAL-Pilot: the address its ZeroMQ endpoints bind to
ENV_RP_WRAPPER = "PHALANX_RP_WRAPPER"  # RADICAL-Pilot: the shell wrapper a rank task runs
ENV_RP_ARGC = "PHALANX_RP_ARGC"  # RADICAL-Pilot: how many ENV_RP_ARG_<i> the wrapper reads
ENV_RP_ARG_PREFIX = "PHALANX_RP_ARG_"  # RADICAL-Pilot: + i: the rank program's argument i

# ---- integrations --------------------------------------------------------------------------------
ENV_PARSL_DRIVER_HOST = "PHALANX_PARSL_DRIVER_HOST"  # Parsl: the address ranks reach the driver at
ENV_PARSL_RENDEZVOUS = "PHALANX_PARSL_RENDEZVOUS"  # Parsl: the rendezvous the site names
ENV_RANK_VARS = "PHALANX_RANK_VARS"  # Parsl: variables that may hold the rank, first present wins
ENV_RANK_LOG_DIR = "PHALANX_RANK_LOG_DIR"  # Parsl: where rank R writes rank-R.log
