"""Multi-process harness for CPU tests: N gloo ranks with megatron parallel_state initialised.

Usage (the function must be importable at module level so that it can be pickled)::

    def _check(tmp_dir):
        ...  # runs in every rank with parallel_state initialised
        return some_picklable_value

    results = run_distributed(_check, world_size=2, tp=2, args=(tmp_dir,))

Each rank returns its value; `run_distributed` returns them as a list indexed by global rank.
A failure in any rank is re-raised in the caller with that rank's traceback. Process groups
are always destroyed and children never outlive the call: a rank that hangs past `timeout`
is killed. Ports are picked free per call, so test files can run in parallel.

The ranks are forked from a "forkserver" process that imported torch and megatron-core once
(multiprocessing's forkserver, preloaded): spawned, every rank imported them again, about 2.5 s
of CPU each, and a suite's in-process tests start about 60 ranks. A rank gets the caller's
environment as it is at the call, as a spawned one did.

`run_distributed` pickles its function by module name, which a child process can only import if
the parent's import of that module is reproducible; under pytest's `--import-mode=importlib`
test files are not importable by name. `call_in_file(path, name, *args)` is an importable
trampoline that loads the file by location in the child and calls `name(*args)`::

    run_distributed(call_in_file, 2, tp=2, args=(__file__, "_check_tp", ...))

`run_entry(entry, nproc, argv, cwd=..., log_path=...)` runs a command (`python -m
pretrain_leviathan`, `python tools/evaluate.py`) on N processes forked from the same server,
each with the environment torchrun gives its workers, for the tests of what a command computes;
the tests of how a run is launched, signalled and restarted start real torchrun jobs
(tests/support/jobs.py).
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import runpy
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_ext.config.layout import ParallelConfig
from megatron_ext.launch import find_free_port, job_environment
from megatron_ext.parallel import destroy_parallel, initialize_parallel

__all__ = ["call_in_file", "find_free_port", "run_distributed", "run_entry"]

# What the forkserver imports once for every rank forked from it: torch and megatron-core, the
# training entry and TorchDynamo (which building a torch optimizer imports).
PRELOAD = ["megatron_ext.megatron_import", "torch._dynamo", "pretrain_leviathan"]


def _forkserver() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts (the first call)
    return ctx


def _worker(
    rank: int,
    world_size: int,
    port: int,
    layout: ParallelConfig,
    fn: Callable[..., Any],
    args: Sequence[Any],
    queue: "mp.SimpleQueue",
    threads: int,
    environ: dict[str, str],
) -> None:
    torch.set_num_threads(threads)
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    try:
        initialize_parallel(
            tensor_model_parallel_size=layout.tensor_model_parallel_size,
            pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
            context_parallel_size=layout.context_parallel_size,
            backend="gloo",
        )
        result = fn(*args)
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        try:
            destroy_parallel()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    args: Sequence[Any] = (),
    timeout: float = 600.0,
    threads_per_rank: int = 1,
) -> list[Any]:
    """Run `fn(*args)` in `world_size` gloo processes, its groups at TP x PP x CP (the run's
    `ParallelConfig`, DP derived), and return each rank's result.

    Raises:
        ValueError: the ranks do not split into TP x PP x CP.
        RuntimeError: if a rank raised (its traceback is included) or the run timed out.
    """
    layout = ParallelConfig(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp
    ).resolve(world_size)
    ctx = _forkserver()
    queue = ctx.SimpleQueue()
    port = find_free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(
                rank,
                world_size,
                port,
                layout,
                fn,
                tuple(args),
                queue,
                threads_per_rank,
                dict(os.environ),
            ),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    failures: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(failures) < world_size:
            if time.monotonic() > deadline:
                raise RuntimeError(f"distributed run of {fn.__name__} timed out after {timeout}s")
            if queue.empty():
                if any(p.exitcode not in (None, 0) for p in procs) and queue.empty():
                    time.sleep(0.5)  # give a dying rank's message time to arrive
                    if queue.empty():
                        codes = [p.exitcode for p in procs]
                        raise RuntimeError(f"a rank died without reporting (exit codes {codes})")
                time.sleep(0.02)
                continue
            rank, ok, payload = queue.get()
            if ok:
                results[rank] = payload
            else:
                failures.append(f"--- rank {rank} ---\n{payload}")
                # Peers of a failed rank may block in a collective: stop waiting for them.
                break
    finally:
        for proc in procs:
            proc.join(timeout=5 if not failures else 1)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    if failures:
        raise RuntimeError(f"{fn.__name__} failed:\n" + "\n".join(failures))
    return [results[r] for r in range(world_size)]


def call_in_file(path: str, name: str, *args: Any) -> Any:
    """Import the Python file at `path` (once per process) and return `<name>(*args)`."""
    module_name = f"_test_file_{Path(path).stem}"
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return getattr(module, name)(*args)


def _without_the_servers_coverage() -> None:
    """Under coverage.py (the suite measured with its subprocess patch, which starts it in the
    server too) the server's Coverage and its atexit handler are inherited; in a forked child
    it has nothing to stop, so it is dropped: the child's own (started by the multiprocessing
    bootstrap, the last one) saves this process's data."""
    coverage = sys.modules.get("coverage")
    for inherited in coverage.Coverage._instances[:-1] if coverage else []:
        atexit.unregister(inherited._atexit)


def _entry_rank(
    entry: str, argv: list[str], cwd: str, paths: tuple[str, str], environ: dict
) -> None:
    _without_the_servers_coverage()
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    for stream, path in zip((sys.stdout, sys.stderr), paths):
        stream.flush()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, stream.fileno())
        os.close(fd)
        stream.reconfigure(line_buffering=True)  # the job's PYTHONUNBUFFERED=1
    torch.set_num_threads(int(environ["OMP_NUM_THREADS"]))
    mp.set_start_method(None, force=True)  # a forkserver child inherits "forkserver"
    sys.argv = [entry, *argv]
    code = 0
    try:
        if entry.endswith(".py"):
            sys.path.insert(0, os.path.dirname(os.path.abspath(entry)))
            runpy.run_path(entry, run_name="__main__")  # python SCRIPT
        else:
            runpy.run_module(entry, run_name="__main__", alter_sys=True)  # python -m MODULE
    except SystemExit as exit_:
        code = exit_.code
    finally:
        atexit._run_exitfuncs()  # as the interpreter does at exit (a forked child skips them)
    sys.exit(code)


def run_entry(
    entry: str,
    nproc: int,
    argv: Sequence[str],
    *,
    cwd: Path,
    log_path: Path,
    stderr_path: Path | None = None,
    env: dict | None = None,
    timeout: float = 300.0,
    torchrun: bool | None = None,
) -> int:
    """Run `python -m entry argv` (`python entry argv` for a .py path) on `nproc` ranks forked
    from the preloaded forkserver, in `cwd`, with the environment `megatron_ext.launch.launch`
    gives a job (`env` added) and, with `torchrun` (default: more than one rank), the rank
    variables torchrun sets and its agent's store (without: one process as plain python starts
    it). The ranks' stdout and stderr append to `log_path` (stderr to `stderr_path` if given).
    Returns the job's exit status: 0, or the first failing rank's (its peers are killed 5 s
    after it, as torchrun stops a job whose worker failed).

    Raises:
        TimeoutError: the job ran past `timeout` seconds (every rank is killed first).
    """
    ctx = _forkserver()
    torchrun = nproc > 1 if torchrun is None else torchrun
    base = job_environment(env)
    base["MASTER_ADDR"] = "127.0.0.1"
    store = None
    if torchrun:  # the ranks share the agent's store, as under torchrun's static rendezvous
        store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False, multi_tenant=True)
        base["MASTER_PORT"] = str(store.port)
    else:
        base["MASTER_PORT"] = str(find_free_port())
    paths = (str(log_path), str(stderr_path or log_path))
    argv = [str(a) for a in argv]
    ranks = {}
    for rank in range(nproc):
        environ = dict(base)
        if torchrun:
            environ.update(
                RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                ROLE_NAME="default", WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                GROUP_WORLD_SIZE="1", ROLE_WORLD_SIZE=str(nproc), TORCHELASTIC_RUN_ID="none",
                TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
                TORCHELASTIC_USE_AGENT_STORE="True",
            )  # fmt: skip
        args = (str(entry), argv, str(cwd), paths, environ)
        ranks[rank] = ctx.Process(target=_entry_rank, args=args, daemon=False)
    for proc in ranks.values():
        proc.start()
    deadline, failed_at, status = time.monotonic() + timeout, None, 0
    try:
        while any(p.exitcode is None for p in ranks.values()):
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"{entry} on {nproc} ranks ran past {timeout:.0f} s")
            if failed_at is None:
                status = next((p.exitcode for p in ranks.values() if p.exitcode), 0)
                failed_at = now if status else None
            elif now > failed_at + 5:
                break
            time.sleep(0.05)
    finally:
        for proc in ranks.values():
            if proc.exitcode is None:
                proc.kill()
            proc.join()
        del store
    return status or next((p.exitcode for p in ranks.values() if p.exitcode), 0)
