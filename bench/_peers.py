"""Shared pieces of the peer benchmarks (bench/operators.py, bench/tpch.py).

- peak RSS of a process tree over one workload: every process's high-water mark (VmHWM) is
  reset through /proc/PID/clear_refs before and read after, so a peak belongs to the workload;
- Apache Spark sessions: ``local[N]`` or a standalone cluster (a master and one worker bound to
  127.0.0.1, started here with ``spark-class`` and ended by PID) with N one-core executors;
- Daft (native runner, N threads), Ray Data (a local Ray of N CPUs), Dask (LocalCluster with
  N single-threaded worker processes): set-up and the settings each one prints.
"""

from __future__ import annotations

import gc
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SPARK_DRIVER_MEM = os.environ.get("PX_BENCH_SPARK_DRIVER_MEM", "4g")
SPARK_EXECUTOR_MEM = os.environ.get("PX_BENCH_SPARK_EXECUTOR_MEM", "2g")
SPARK_START_TIMEOUT = 600.0  # s: this shared VM can be very loaded; a JVM start then crawls


# ---- machine --------------------------------------------------------------------------------
def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def version(mod: str) -> str | None:
    try:
        return __import__(mod).__version__
    except Exception:
        return None


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# ---- peak RSS --------------------------------------------------------------------------------
def tree_pids(root: int | None = None) -> list[int]:
    """``root`` (default: this process) and all its descendants."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])  # after "pid (comm) state"
        children.setdefault(ppid, []).append(int(entry.name))
    if not Path(f"/proc/{root}").exists():
        return []
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _status(pid: int) -> dict:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("Name:", "VmHWM:", "VmRSS:")):
                k, v = line.split(":", 1)
                out[k] = v.strip()
    except OSError:
        pass
    return out


def reset_peaks(pids) -> None:
    for pid in pids:
        try:
            with open(f"/proc/{pid}/clear_refs", "w") as f:
                f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
        except OSError:
            pass


def read_peaks(pids) -> dict[int, tuple[str, int]]:
    """pid -> (name, peak RSS bytes since the last reset)."""
    out = {}
    for pid in pids:
        st = _status(pid)
        if "VmHWM" in st:
            out[pid] = (st.get("Name", "?"), int(st["VmHWM"].split()[0]) * 1024)
    return out


class PeakRSS:
    """``with PeakRSS() as m: ...`` then ``m.result()``: peak RSS per process of this process
    tree (plus ``extra_roots``' trees) during the block.  Processes that end inside the block
    are missed; the engines here keep theirs (workers, executors) alive."""

    def __init__(self, extra_roots=()):
        self.extra_roots = list(extra_roots)
        self.peaks: dict[int, tuple[str, int]] = {}

    def _pids(self):
        pids = tree_pids()
        for r in self.extra_roots:
            pids += tree_pids(r)
        return sorted(set(pids))

    def __enter__(self):
        reset_peaks(self._pids())
        return self

    def __exit__(self, *exc):
        self.peaks = read_peaks(self._pids())
        return False

    def result(self) -> dict:
        if not self.peaks:
            return {"max_bytes": None, "sum_bytes": None, "procs": 0}
        name, top = max(self.peaks.values(), key=lambda v: v[1])
        return {
            "max_bytes": top,
            "max_proc": name,
            "sum_bytes": sum(v[1] for v in self.peaks.values()),
            "procs": len(self.peaks),
        }


def own_peak_reset() -> None:
    reset_peaks([os.getpid()])


def own_peak() -> int | None:
    st = _status(os.getpid())
    return int(st["VmHWM"].split()[0]) * 1024 if "VmHWM" in st else None


def fmt_mib(b) -> str:
    return "-" if b is None else f"{b / 2**20:.0f}"


# ---- Spark -----------------------------------------------------------------------------------
def spark_home() -> str:
    import pyspark

    return str(Path(pyspark.__file__).parent)


def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"spark {what} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"spark {what} did not listen on 127.0.0.1:{port} in {timeout:.0f}s")


def _stop_pid(proc: subprocess.Popen | None, grace: float = 20.0) -> None:
    """End one process we started, by its PID: SIGTERM, then SIGKILL after ``grace``."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    except ProcessLookupError:
        pass


class Spark:
    """A SparkSession for ``mode`` 'local' (local[N]) or 'cluster' (standalone master + worker
    on 127.0.0.1, N executors of one core each).  ``stop()`` ends the session and, by PID, the
    master and worker this object started."""

    def __init__(self, mode: str, n: int, shuffle_partitions: int | None = None, log=print):
        self.mode, self.n = mode, n
        self.shuffle_partitions = shuffle_partitions or n
        self.log = log
        self.master_proc = self.worker_proc = None
        self.tmp = tempfile.mkdtemp(prefix="px-bench-spark-")
        self.session = None
        self.start_s = None
        self.settings: dict = {}

    # the JVMs run with our environment: loopback only, no Spark UI
    def _env(self):
        home = spark_home()
        return {
            **os.environ,
            "SPARK_HOME": home,
            "SPARK_LOCAL_IP": "127.0.0.1",
            "SPARK_LOCAL_HOSTNAME": "localhost",
            "PYSPARK_PYTHON": sys.executable,
            "PYSPARK_DRIVER_PYTHON": sys.executable,
            "SPARK_LOG_DIR": self.tmp,
            "SPARK_WORKER_DIR": os.path.join(self.tmp, "work"),
        }

    def start(self):
        t = time.perf_counter()
        env = self._env()
        os.environ.update(
            {
                k: env[k]
                for k in (
                    "SPARK_HOME",
                    "SPARK_LOCAL_IP",
                    "SPARK_LOCAL_HOSTNAME",
                    "PYSPARK_PYTHON",
                    "PYSPARK_DRIVER_PYTHON",
                )
            }
        )
        from pyspark.sql import SparkSession

        b = (
            SparkSession.builder.appName("phalanx-bench")
            .config("spark.driver.bindAddress", "127.0.0.1")
            .config("spark.driver.host", "127.0.0.1")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", str(self.shuffle_partitions))
            .config("spark.default.parallelism", str(self.n))
            .config("spark.sql.execution.arrow.pyspark.enabled", "true")
            .config("spark.local.dir", os.path.join(self.tmp, "local"))
            .config("spark.driver.extraJavaOptions", "-XX:+UseParallelGC")
            .config("spark.executor.extraJavaOptions", "-XX:+UseParallelGC")
        )
        if self.mode == "local":
            b = b.master(f"local[{self.n}]").config("spark.driver.memory", SPARK_DRIVER_MEM)
        elif self.mode == "cluster":
            home = env["SPARK_HOME"]
            cls = os.path.join(home, "bin", "spark-class")
            mport = free_port()
            out = open(os.path.join(self.tmp, "master.log"), "w")
            self.master_proc = subprocess.Popen(
                [
                    cls,
                    "org.apache.spark.deploy.master.Master",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(mport),
                    "--webui-port",
                    str(free_port()),
                ],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            _wait_port(mport, self.master_proc, "master", SPARK_START_TIMEOUT)
            url = f"spark://127.0.0.1:{mport}"
            wmem = int(SPARK_EXECUTOR_MEM.rstrip("g")) * self.n + 1
            out = open(os.path.join(self.tmp, "worker.log"), "w")
            self.worker_proc = subprocess.Popen(
                [
                    cls,
                    "org.apache.spark.deploy.worker.Worker",
                    url,
                    "--host",
                    "127.0.0.1",
                    "--cores",
                    str(self.n),
                    "--memory",
                    f"{wmem}g",
                    "--webui-port",
                    str(free_port()),
                    "--work-dir",
                    env["SPARK_WORKER_DIR"],
                ],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            b = (
                b.master(url)
                .config("spark.driver.memory", "2g")
                .config("spark.executor.cores", "1")
                .config("spark.cores.max", str(self.n))
                .config("spark.executor.memory", SPARK_EXECUTOR_MEM)
                .config("spark.scheduler.minRegisteredResourcesRatio", "1.0")
                .config("spark.scheduler.maxRegisteredResourcesWaitingTime", f"{int(SPARK_START_TIMEOUT)}s")
            )
        else:
            raise ValueError(self.mode)
        self.session = b.getOrCreate()
        self.session.sparkContext.setLogLevel("ERROR")
        if self.mode == "cluster":  # wait for N executors (+ the driver's block manager)
            sc = self.session.sparkContext
            deadline = time.monotonic() + SPARK_START_TIMEOUT
            while sc._jsc.sc().getExecutorMemoryStatus().size() < self.n + 1:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"spark cluster: {self.n} executors did not register")
                time.sleep(0.5)
        self.start_s = time.perf_counter() - t
        conf = self.session.sparkContext.getConf()
        keys = (
            "spark.master",
            "spark.driver.memory",
            "spark.executor.memory",
            "spark.executor.cores",
            "spark.cores.max",
            "spark.sql.shuffle.partitions",
            "spark.default.parallelism",
            "spark.sql.adaptive.enabled",
        )
        self.settings = {k: conf.get(k, None) for k in keys}
        self.settings["spark.sql.adaptive.enabled"] = self.session.conf.get("spark.sql.adaptive.enabled")
        self.settings["version"] = self.session.version
        self.settings["start_s"] = round(self.start_s, 1)
        return self.session

    def pids(self) -> list[int]:
        """Roots of the JVM trees: the driver JVM is our child; master/worker (and their
        executors) are in their own sessions."""
        return [p.pid for p in (self.master_proc, self.worker_proc) if p is not None]

    def stop(self):
        try:
            if self.session is not None:
                self.session.stop()
                from pyspark import SparkContext

                gw = SparkContext._gateway
                if gw is not None:  # the driver JVM: our child, launched by pyspark
                    proc = getattr(gw, "proc", None)
                    gw.shutdown()
                    SparkContext._gateway = SparkContext._jvm = None
                    if proc is not None:
                        _stop_pid(proc)
        finally:
            _stop_pid(self.worker_proc)
            _stop_pid(self.master_proc)
            shutil.rmtree(self.tmp, ignore_errors=True)


def spark_noop(df) -> None:
    """Materialise a Spark DataFrame without collecting it (the noop sink)."""
    df.write.format("noop").mode("overwrite").save()


# ---- Daft, Ray ------------------------------------------------------------------------------
def daft_start(n: int) -> dict:
    import daft

    daft.set_runner_native(num_threads=n)
    return {"version": daft.__version__, "runner": "native", "num_threads": n}


def ray_start(n: int, tmp: str | None = None) -> dict:
    import ray

    tmp = tmp or tempfile.mkdtemp(prefix="pxray-bench-")
    ray.init(
        num_cpus=n,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        _temp_dir=tmp,
        object_store_memory=2 << 30,
    )
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    try:
        ctx.print_on_execution_start = False
    except Exception:
        pass
    return {"version": ray.__version__, "num_cpus": n, "object_store_gib": 2, "temp_dir": tmp}


def time_reps(fn, reps: int, roots=(), max_rep_s: float | None = None) -> tuple[list[float], dict, object]:
    """Run ``fn`` up to ``reps`` times (stopping after a repetition slower than ``max_rep_s``):
    (wall seconds per repetition, the peak RSS of the repetition that peaked highest over the
    process tree of ``roots``, the last result).  The previous result is dropped before each run."""
    times, peaks, res = [], [], None
    for _ in range(reps):
        res = None
        gc.collect()
        with PeakRSS(roots) as m:
            t = time.perf_counter()
            res = fn()
            times.append(time.perf_counter() - t)
        peaks.append(m.result())
        if max_rep_s is not None and times[-1] > max_rep_s:
            break
    return times, max(peaks, key=lambda p: p["max_bytes"] or 0), res


def log_settings(log, settings: dict, width: int = 16) -> None:
    """Print every peer's version and settings, one line each, under a heading."""
    log("")
    log("## peers: version and settings")
    for key, st in settings.items():
        log(f"{key:<{width}} " + "  ".join(f"{k}={v}" for k, v in (st or {}).items()))
    log("")


class Tee:
    """``log(line)``: print it now and keep it (``log.lines``) for the run's JSON."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, s: str = "") -> None:
        print(s, flush=True)
        self.lines.append(s)
