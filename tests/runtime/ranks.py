"""Run a test function on several ranks, each a spawned process (collectives and kernels
that two ranks drive together)."""

from __future__ import annotations

from collections.abc import Callable

import torch.multiprocessing as mp

from specula.demo.server_process import free_port

__all__ = ["free_port", "run_ranks"]  # free_port: a rendezvous address for the ranks


def _report(fn: Callable, rank: int, args: tuple, errors) -> None:
    try:
        fn(rank, *args)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, then re-raised
        errors.put(f"rank {rank}: {exc!r}")
        raise


def run_ranks(fn: Callable, *args, world: int = 2, timeout: float = 300) -> None:
    """``fn(rank, *args)`` for every rank, each in a spawned process (``fn`` and ``args``
    picklable). Ranks still running after ``timeout`` seconds are killed.

    Raises:
        AssertionError: a rank did not exit 0; the message has every rank's exit code and
            the exceptions the ranks raised.
    """
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    procs = [ctx.Process(target=_report, args=(fn, r, args, errors)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    reported = [errors.get() for _ in range(errors.qsize())]
    assert [p.exitcode for p in procs] == [0] * world, ([p.exitcode for p in procs], reported)
