"""Report builds on a Dask cluster: each notebook one task, papermill inside the worker.

`workbench report --workers N` starts a local cluster (`distributed.LocalCluster`: N worker processes of
one thread, so each runs one notebook at a time); `--scheduler ADDRESS` uses a cluster that runs already,
whose workers have this package installed and see the notebook and report folders at the same paths.
The serial build's rules hold unchanged, because each task runs the serial build's own function
(`runner._run_one`): the same staging folders, the same lock around moving a report into place, the same
`run.json` and index. What only a cluster adds is a worker that dies mid-notebook (a crash, the OOM
killer): its notebook is recorded failed by the client and the last good report is kept.

GPU notebooks (`is_gpu_notebook`): a `device` parameter naming CUDA, or a device left to the notebook that
will be CUDA (on a local cluster: CUDA present here; on a cluster elsewhere: the `gpu` and `paper`
profiles). On a cluster whose workers declare a `GPU` resource (`dask worker ADDRESS --resources GPU=1`,
one worker per device) they ask for one `GPU`, so they run only there, one per GPU; on a local cluster one
runs at a time. A scheduler of yours keeps its own `distributed.scheduler.allowed-failures` (3 unless set:
a notebook that takes its worker down is retried elsewhere up to that many times); a local cluster's is 0.

Issue 20 ("Report builds on a cluster"); Dask: https://distributed.dask.org (LocalCluster, resources).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from .results import UsageError

__all__ = ["GPU", "MAX_WORKERS", "check_cluster_options", "connect", "is_gpu_notebook", "run_on_cluster"]

GPU = "GPU"  # the resource a worker declares per GPU: `dask worker ADDRESS --resources GPU=1`
GPU_PROFILES = ("gpu", "paper")  # profiles sized for a GPU
MAX_WORKERS = 256
CONNECT_TIMEOUT = 10  # seconds to reach a scheduler, and to find a worker there
_THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def check_cluster_options(workers: int | None, scheduler: str | None) -> None:
    """UsageError, before anything runs, for a bad worker count, a malformed address, or both given."""
    if workers is not None and scheduler is not None:
        raise UsageError(f"workers={workers!r} and scheduler={scheduler!r}: give one, --workers N for a local "
                         f"cluster or --scheduler ADDRESS for one that runs already")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int)
                                or not 1 <= workers <= MAX_WORKERS):
        raise UsageError(f"workers={workers!r}: give a whole number of worker processes in 1..{MAX_WORKERS}")
    if scheduler is not None:
        _host_port(scheduler)


def _host_port(address) -> tuple[str, int] | None:
    """(host, port) of a scheduler address `[scheme://]host:port` (None for a scheme without them, e.g.
    ucx); UsageError naming the address and the form expected when it is malformed."""
    expected = "give the scheduler's address as [tcp://]HOST:PORT, e.g. tcp://127.0.0.1:8786"
    if not isinstance(address, str) or not address.strip():
        raise UsageError(f"scheduler={address!r}: {expected}")
    from distributed.comm import registry
    from distributed.comm.addressing import parse_address, parse_host_port

    try:
        scheme, location = parse_address(address.strip())
    except ValueError as exc:
        raise UsageError(f"scheduler={address!r}: {exc}; {expected}") from None
    known = sorted(name for name in registry.backends if name != "inproc")  # inproc: this process only
    if scheme not in known:
        raise UsageError(f"scheduler={address!r}: unknown scheme {scheme!r}; choose one of {', '.join(known)}; "
                         f"{expected}")
    if scheme not in ("tcp", "tls", "ws", "wss"):
        # NOTE: distributed lists `ucx` whether or not its backend can run (without distributed-ucxx its
        # connector is an abstract class): a build accepted the address, planned, and then crashed.
        try:
            registry.get_backend(scheme).get_connector()
        except Exception as exc:  # noqa: BLE001 - whatever the backend raises, it cannot connect
            raise UsageError(f"scheduler={address!r}: the {scheme!r} scheme cannot be used here ({type(exc).__name__}: "
                             f"{exc}); {expected}") from None
        return None
    try:
        host, port = parse_host_port(location)
    except ValueError as exc:
        raise UsageError(f"scheduler={address!r}: {exc}; {expected}") from None
    if not host or not 1 <= port <= 65535:
        raise UsageError(f"scheduler={address!r}: the port must lie in 1..65535 after a host name; {expected}")
    return host, port


def _probe(address: str) -> None:
    """UsageError, within CONNECT_TIMEOUT, when nothing listens at the scheduler's host and port."""
    # NOTE: a plain socket first, because a distributed.Client that fails to connect spends another 20 s
    # closing itself when it is collected (its __del__), with a traceback, after the error is reported.
    where = _host_port(address)
    if where is None:
        return
    try:
        socket.create_connection(where, timeout=CONNECT_TIMEOUT).close()
    except OSError as exc:
        problem = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or exc)
        raise UsageError(f"cannot reach the Dask scheduler at {address!r}: {problem}; start one with "
                         f"`dask scheduler` (and workers with `dask worker ADDRESS`), or use --workers N for a "
                         f"local cluster") from None


def is_gpu_notebook(parameters: dict, profile: str, *, cuda_here: bool | None = None) -> bool:
    """True when a notebook run needs a GPU: its `device` parameter names CUDA ("cuda", "cuda:1"). A device
    left to the notebook ("", "auto") is the one it will pick: on a local cluster (`cuda_here` given) CUDA
    when present here (WORKBENCH_DEVICE overrides, as in `devices.pick_device`); on another machine's
    cluster the `gpu` and `paper` profiles, sized for one."""
    device = str(parameters.get("device") or "").strip().lower()
    if device in ("", "auto") and cuda_here is not None:
        device = (os.environ.get("WORKBENCH_DEVICE") or ("cuda" if cuda_here else "cpu")).strip().lower()
    if device and device != "auto":
        return device.startswith("cuda")
    return profile in GPU_PROFILES


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def _thread_env(workers: int) -> dict[str, str]:
    """The worker processes' thread settings, which the kernels they start inherit: the user's own, else an
    equal share of the cores (one worker gets them all, as in the serial build)."""
    # NOTE: a Dask nanny sets OMP_NUM_THREADS=1 in its workers by default (its pre-spawn-environ); a
    # notebook's torch would then run single-threaded even on a one-worker cluster. We set it ourselves.
    share = str(max(1, _cores() // workers))
    return {name: os.environ.get(name) or share for name in _THREAD_VARIABLES}


def _local_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@contextmanager
def connect(*, workers: int | None = None, scheduler: str | None = None) -> Iterator[tuple]:
    """`(client, gpu_limit, cuda_here)` for a local cluster of `workers` processes, or for the cluster at
    `scheduler`; closes the client (and the local cluster) on exit, whatever happens. `gpu_limit`: how many
    GPU notebooks may run at once when no worker declares a GPU resource (None: no limit); `cuda_here`:
    whether this machine, where a local cluster's notebooks run, has CUDA (None for a scheduler's)."""
    check_cluster_options(workers, scheduler)
    if workers is None and scheduler is None:
        raise UsageError("give workers (a local cluster) or scheduler (the address of one that runs already)")
    import dask
    from distributed import Client, LocalCluster

    if scheduler is not None:
        _probe(scheduler)
        try:
            client = Client(scheduler, timeout=CONNECT_TIMEOUT, set_as_default=False)
        except Exception as exc:  # noqa: BLE001 - OSError, TimeoutError, or what a scheme's backend raises
            raise UsageError(f"cannot reach the Dask scheduler at {scheduler}: {exc} (is a Dask scheduler "
                             f"listening there?)") from None
        with client:
            try:
                client.wait_for_workers(1, timeout=CONNECT_TIMEOUT)
            except (OSError, TimeoutError) as exc:
                raise UsageError(f"the Dask scheduler at {scheduler} has no workers ({exc}); start one with "
                                 f"`dask worker {scheduler}`") from None
            yield client, None, None
        return
    # NOTE: allowed-failures 0: the scheduler marks a task failed (KilledWorker) at the first worker that dies
    # running it, instead of running the notebook that killed its worker up to three more times.
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
        try:
            cluster = LocalCluster(
                n_workers=workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                dashboard_address=None, scheduler_kwargs={"dashboard_address": "127.0.0.1:0"},  # any free port
                memory_limit=0,  # the notebooks run in kernels, outside the worker: Dask cannot see their memory
                silence_logs=logging.CRITICAL,  # a dying worker is reported with its notebook, not as a log trace
                env=_thread_env(workers),
            )
        except (OSError, RuntimeError, TimeoutError) as exc:
            raise UsageError(f"could not start a local Dask cluster of {workers} worker(s): {exc}; its workers "
                             f"start as new Python processes, so a script calling build_reports(workers=...) "
                             f"must do so under `if __name__ == '__main__':`") from None
    # NOTE: notebooks that say "cuda" (or pick it) all use the current device, cuda:0, so on a local cluster
    # one GPU notebook runs at a time however many devices there are; a cluster of `dask worker
    # --resources GPU=1` processes, one per device (CUDA_VISIBLE_DEVICES), runs one per GPU.
    cuda_here = _local_gpus() > 0
    with cluster, Client(cluster, set_as_default=False) as client:
        yield client, (1 if cuda_here else None), cuda_here


def _slots(client) -> tuple[int, int]:
    """(worker threads, GPUs the workers declare) of the cluster now."""
    threads = sum(client.nthreads().values())
    # an older distributed may list only some workers here: fewer GPUs counted, never more
    workers = client.scheduler_info().get("workers", {}).values()
    gpus = sum(float((w.get("resources") or {}).get(GPU, 0)) for w in workers)
    return max(1, threads), int(gpus)


def _why(exc: BaseException) -> tuple[str, int | None]:
    """What to record for a task that failed as a task, and the process id of the worker that died."""
    from distributed import KilledWorker

    if isinstance(exc, KilledWorker):
        worker = getattr(exc, "last_worker", None)
        where = f"on {worker.address}: " if getattr(worker, "address", None) else ""
        return (f"the Dask worker running this notebook died ({where}a crash, out of memory, or killed); "
                f"its run is lost", getattr(worker, "pid", None))
    return f"the Dask task failed: {type(exc).__name__}: {exc}", None


def run_on_cluster(
    client, jobs: list, task: Callable, *, lost: Callable, done: Callable, gpu: Callable,
    gpu_limit: int | None = None, progress=None,
) -> list[dict]:
    """Run `task(job)` for every job, one Dask task each, as many at once as the cluster has worker threads.

    `task` returns the job's record; when the task itself fails (its worker died), `lost(job, error, started,
    seconds, pid)` records the failure instead (`pid`: the dead worker's process id, when known).
    `done(record)` runs in this process after each job (the index); `gpu(job)` says whether it is a GPU
    notebook. Returns the records in the order of `jobs`.
    """
    from distributed import as_completed

    # NOTE: submitting only as many tasks as there are worker threads keeps one task per worker: when a
    # worker dies, the scheduler blames every task assigned to it, and a notebook merely queued there
    # would be marked failed with the one that killed it. The threads are counted again before each
    # submission: a worker that died and did not come back leaves fewer.
    declared = _slots(client)[1]
    limit = declared or gpu_limit
    pending, running, records = list(jobs), {}, {}
    finished = as_completed(loop=client.loop)

    def submit_next() -> None:
        threads = _slots(client)[0]
        gpus_busy = sum(uses_gpu for _, uses_gpu, _, _ in running.values())
        for job in list(pending):
            if len(running) >= threads:
                return
            uses_gpu = bool(gpu(job))
            if uses_gpu and limit and gpus_busy >= limit:
                continue
            future = client.submit(task, job, key=f"notebook-{job.name}-{uuid.uuid4().hex[:8]}", pure=False,
                                   resources={GPU: 1} if uses_gpu and declared else None)
            running[future] = (job, uses_gpu, time.perf_counter(), time.strftime("%Y-%m-%d %H:%M:%S"))
            gpus_busy += uses_gpu
            pending.remove(job)
            finished.add(future)

    try:
        submit_next()
        for future in finished:
            job, _, start, started = running.pop(future)
            try:
                record = future.result()
            except Exception as exc:  # the worker died (KilledWorker), or the task could not run there
                error, pid = _why(exc)
                record = lost(job, error, started, round(time.perf_counter() - start, 1), pid)
            records[job.name] = record
            done(record)
            if progress is not None:
                progress.update(1)
            submit_next()
    finally:
        if running:  # interrupted: nothing more starts on a cluster that outlives this build
            client.cancel(list(running))
    return [records[job.name] for job in jobs]
