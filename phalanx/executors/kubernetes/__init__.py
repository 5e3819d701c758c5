"""Kubernetes executor: a gang is one Indexed Job whose pod index is the rank.

- **All or nothing.**  With ``gang: auto`` (the default) a gang's pods join a PodGroup of the
  API server's native gang scheduling (``scheduling.k8s.io`` ``PodGroup``, ``minCount`` = ranks;
  Kubernetes 1.36 with the GenericWorkload and GangScheduling gates) where the server serves one,
  so a partly placed stage never holds nodes while it waits for the rest.  ``kueue`` (the Job's
  ``queue-name`` label; Kueue admits its whole quota at once) and ``volcano`` (a Volcano
  PodGroup) are there for clusters that use them; ``none`` creates plain Jobs.
- **One failure fails the gang.**  ``backoffLimit: 0`` and a pod failure policy that fails the
  Job on any non-zero exit or disruption: the stage retries on a fresh gang (a new Job).
- **The control key stays secret.**  Ranks read the control connection's key from a Secret
  (``secretKeyRef``); the Job, its pods and ``kubectl describe`` never show it.
- **Networking.**  ``network: host`` (default) runs rank pods on their node's network: the
  site's rendezvous and ``driver_host`` as given (the test cluster: every node is this host).
  ``network: service`` puts them on the pod network with a headless Service
  (``publishNotReadyAddresses``): rank 0's rendezvous is ``<job>-0.<job>.<ns>.svc`` (needs
  cluster DNS).  A rank whose pod cannot reach a loopback-only driver fails at once, naming it.
- **State through watches.**  One watch of the Job's pods per gang gives exit codes, Kubernetes'
  reasons (OOMKilled, Evicted, DeadlineExceeded, ImagePullBackOff, the scheduler's
  Unschedulable message) and starts each rank's log stream (``log_dir/rank-R.log`` through the
  API server: no shared filesystem needed for logs).
- **Ranks where their input is.**  ``prefer_hosts`` maps the store's hosts to nodes (name or
  ``kubernetes.io/hostname``); a placed gang's pods start behind the ``phalanx.dev/placement``
  scheduling gate, which the watch lifts pod by pod after giving each a *preferred* node
  affinity (weight 100) for its rank's node: one pod template cannot differ by rank, and a
  required term would hold the gang while that node is full.
- **Nothing left behind.**  The Job is in the run DB before it exists (``base.held``); the
  Secret, Service and PodGroup are owned by it.  ``kill`` (gang end, cancel, a failed start)
  and ``release`` (``phalanx status``/``--resume`` after a killed driver) delete them all; a
  TTL (``ttl_after_finished_s``) catches the rest.

Modules, one job each: ``config`` (the ``kubernetes:`` section, importable without the client),
``manifests`` (the objects of a gang, as dicts), ``client`` (the connection and API discovery),
``launcher`` (create, watch, stream logs, delete), ``executor`` (capacity, checks, host mounts,
a launcher per gang).  Nothing imports the ``kubernetes`` client until a gang needs it.
"""

from .config import GANG_MODES, SITE_KEYS, KubernetesConfig
from .executor import KubernetesExecutor

__all__ = ["GANG_MODES", "KubernetesConfig", "KubernetesExecutor", "SITE_KEYS"]
