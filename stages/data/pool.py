"""The forked worker pool tokenize spreads its chunks over: sized to the input, results in input order.

    resolve_workers(n)        tokenize.workers: 0 = every core in this process's CPU affinity
    plan_pool(...)            how many processes, how large the chunks (PoolPlan); memory and speed only
    fork_pool(n, **state)     a fork pool of n workers that inherit `state` (e.g. the loaded tokenizer, never
                              pickled), or None for n <= 1 (everything in this process); worker_state(key) reads it
    ordered_results(...)      fn(job) for each job, yielded in job order, at most 2 * n jobs in flight

The workers die with the stage (die_with_parent): a killed tokenize leaves none behind.
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

from stages.data.limits import TokenizeError

# The least pairs a pool worker is handed at once: ~0.1 s of rendering + encoding, against a few ms to fork and
# feed a worker, so small inputs do not start (or wait on) more processes than they can keep busy.
MIN_CHUNK_PAIRS = 64
_STATE: dict = {}  # what the workers inherit from the parent at fork (fork_pool's **state)


def resolve_workers(workers: int) -> int:
    """tokenize.workers: 0 = every core this process may run on (its CPU affinity), else that many."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise TokenizeError(f"tokenize.workers must be an integer >= 0 (0 = all cores), got {workers!r}")
    return workers or len(os.sched_getaffinity(0))


@dataclass(frozen=True)
class PoolPlan:
    """How tokenize spreads the work: `processes` forked workers (1 = none, all in this process), the train
    pairs in chunks of `train_chunk`, the probe in pieces of `probe_chunk`. Memory and speed only: the outputs
    are the same bytes for any plan."""
    processes: int
    train_chunk: int
    probe_chunk: int


def plan_pool(n_train: int, n_probe: int, workers: int, chunk_pairs: int) -> PoolPlan:
    """Size the pool to the work: chunks no larger than chunk_pairs, small enough that every worker gets one
    (never under MIN_CHUNK_PAIRS), no more workers than chunks nor than one per MIN_CHUNK_PAIRS pairs (so a
    small input runs in this process, without a pool). tokenize.workers 0 = all 16 cores of a GPU
    host used to fork 16 workers for 2 chunks of HH's 1.8k train pairs, with the 512 probe pairs tokenized
    alone before them; now the probe's 64-pair pieces and 112-pair train chunks keep all 16 busy."""
    if chunk_pairs < 1:
        raise TokenizeError(f"--chunk-pairs must be >= 1, got {chunk_pairs}")
    workers = max(1, workers)

    def per_worker(n: int) -> int:
        return max(1, min(chunk_pairs, max(MIN_CHUNK_PAIRS, -(-n // workers))))

    train_chunk, probe_chunk = per_worker(n_train), per_worker(n_probe)
    chunks = -(-n_train // train_chunk) + -(-n_probe // probe_chunk)
    return PoolPlan(max(1, min(workers, chunks, -(-(n_train + n_probe) // MIN_CHUNK_PAIRS))), train_chunk, probe_chunk)


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux prctl PR_SET_PDEATHSIG): a killed
    tokenize (kill -9, the OOM killer, a cancelled job) otherwise leaves its forked workers blocked on the pool's
    queue for good (found alive 35 minutes later). The signal follows the parent *thread* that forked: the fork
    pool starts all its workers at once from the thread that first submits (the stage's main thread), and never
    replaces one. If the parent is already gone (it died between fork and here), exit now: no signal would come."""
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        os._exit(1)


def _worker_init(parent_pid: int) -> None:
    # The pool already uses every core it is given: the Rust tokenizer's own thread pool inside each
    # worker would only oversubscribe them.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if sys.platform == "linux":
        die_with_parent(parent_pid)


def worker_state(key: str) -> Any:
    """What fork_pool(**state) handed the workers (and this process, when there is no pool)."""
    return _STATE[key]


@contextmanager
def fork_pool(processes: int, **state):
    """A fork pool of `processes` workers inheriting `state`, or None for processes <= 1 (all in-process; the
    state is readable through worker_state either way)."""
    _STATE.update(state)
    try:
        if processes <= 1:
            yield None
            return
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # fork: the workers inherit the loaded tokenizer instead of importing transformers again. (A fork pool starts
        # all its workers at once, so plan_pool never asks for more than there are chunks.)
        pool = ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("fork"), initializer=_worker_init,
                                   initargs=(os.getpid(),))
        try:
            yield pool
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)  # refused input: do not finish the queued chunks
            raise
        else:
            pool.shutdown(wait=True)
    finally:
        _STATE.clear()


def ordered_results(pool, fn: Callable, jobs: Iterable[tuple], processes: int) -> Iterator[tuple[tuple, Any]]:
    """(job, fn(*job)) in job order; with a pool, at most 2 * processes jobs in flight (bounded memory). `fn` is a
    module-level function (the pool pickles it by name) that reads what it shares through worker_state."""
    if pool is None:
        for job in jobs:
            yield job, fn(*job)
        return
    from collections import deque

    pending: deque = deque()
    for job in jobs:
        pending.append((job, pool.submit(fn, *job)))
        if len(pending) >= 2 * processes:
            j, f = pending.popleft()
            yield j, f.result()
    while pending:
        j, f = pending.popleft()
        yield j, f.result()
