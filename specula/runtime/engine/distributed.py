"""Starting a tensor-parallel engine: one process per rank, each on its own device,
every one running the same :class:`~specula.runtime.engine.llm_engine.LLMEngine`
(SPMD, as vLLM's multiprocessing executor does with its workers).

Rank 0 is the calling process (``specula serve``'s engine thread): it takes requests
and, at each step, sends the other ranks the calls they replay. Ranks 1..N-1 are
spawned processes that join the group, load their shards and run
:meth:`~specula.runtime.engine.llm_engine.LLMEngine.follow`. A rank that dies takes the
server down with it (exit 1): the others would wait in the next collective forever.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING

import torch

from specula.runtime.worker.parallel import destroy_parallel, init_parallel

if TYPE_CHECKING:
    from specula.api.runtime_config import RuntimeConfig
    from specula.runtime.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

stopping = threading.Event()
"""Set at rank 0's exit and shutdown: ranks that end then are not failures."""
atexit.register(stopping.set)


def launch(config: RuntimeConfig, device_type: str) -> LLMEngine:
    """Start ranks 1..N-1 of ``config.tensor_parallel_size`` N, join as rank 0, and
    return rank 0's engine (whose :meth:`~LLMEngine.shutdown` ends the others).

    Raises:
        ValueError: fewer CUDA devices than ranks (names both numbers), or a target
            that cannot be sharded (:func:`~specula.runtime.models.registry.
            check_servable`), both before any rank starts; the engine's load errors.
        RuntimeError: the group cannot be formed.
    """
    from specula.runtime.engine.llm_engine import LLMEngine
    from specula.runtime.loader import resolve_model_uri
    from specula.runtime.models.config import ModelConfig
    from specula.runtime.models.registry import check_servable

    n = config.tensor_parallel_size
    # Resolved (downloaded) once here, where the ranks find it; refused before they start.
    target = ModelConfig.from_pretrained(resolve_model_uri(config.model, config.revision))
    check_servable(replace(target, tensor_parallel_size=n))
    engine = start_ranks(n, device_type, partial(LLMEngine.from_config, config))
    atexit.register(_shutdown_at_exit, engine)
    return engine


def _shutdown_at_exit(engine: LLMEngine, timeout_s: float = 10.0) -> None:
    """Leave the group when the server exits (an NCCL group never destroyed holds the
    process at exit) and wait for the other ranks to end, before ``multiprocessing``'s
    exit hook would terminate them. Ranks stuck in a collective (a failed step) would
    hold it too: past ``timeout_s`` the process exits 1 without them."""

    def stop() -> None:
        engine.shutdown()
        for process in _ranks:
            process.join()

    done = threading.Thread(target=stop, daemon=True, name="tp-shutdown")
    done.start()
    done.join(timeout_s)
    if done.is_alive():
        logger.error("the tensor-parallel ranks did not stop within %.0f s", timeout_s)
        os._exit(1)


_ranks: list = []
"""The processes of ranks 1..N-1 of the group :func:`start_ranks` started last."""


def start_ranks(world_size: int, device_type: str,
                build: Callable[[torch.device], LLMEngine]) -> LLMEngine:
    """Spawn ranks 1..N-1, each running ``build(its device).follow()``, join the group
    as rank 0 and return ``build(cuda:0 or cpu)``. ``build`` must be picklable (a
    module-level function or a ``functools.partial`` of one), the same on every rank.

    Raises:
        ValueError: fewer CUDA devices than ranks (names both numbers).
    """
    n = world_size
    if device_type == "cuda" and torch.cuda.device_count() < n:
        raise ValueError(f"tensor_parallel_size {n} needs {n} GPUs; "
                         f"{torch.cuda.device_count()} visible")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        init_method = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    stopping.clear()
    ctx = multiprocessing.get_context("spawn")
    devices = [torch.device(f"cuda:{r}" if device_type == "cuda" else "cpu") for r in range(n)]
    ranks = [ctx.Process(target=_follower_main, args=(build, rank, n, init_method, devices[rank]),
                         name=f"specula-tp-rank-{rank}", daemon=True) for rank in range(1, n)]
    for process in ranks:
        process.start()
    _ranks[:] = ranks
    threading.Thread(target=_watch, args=(ranks,), daemon=True, name="tp-watch").start()
    init_parallel(0, n, init_method, devices[0])
    return build(devices[0])


def _watch(ranks: list) -> None:
    """Exit the server when a rank ends before it was told to (its last words are in
    its own log): the group cannot go on without it."""
    for process in ranks:
        process.join()
        if process.exitcode != 0 and not stopping.is_set():
            logger.error("%s exited with %s; stopping", process.name, process.exitcode)
            from specula.runtime import download

            download.write_termination_message(f"engine failed: tensor-parallel {process.name} "
                                               f"exited with {process.exitcode}")
            os._exit(1)


def _follower_main(build: Callable[[torch.device], LLMEngine], rank: int, world_size: int,
                   init_method: str, device: torch.device) -> None:
    """A spawned rank: join, load this rank's shards, replay rank 0 until it stops."""
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    init_parallel(rank, world_size, init_method, device)
    build(device).follow()
    destroy_parallel()  # with rank 0's, which waits for every rank's
    logger.info("rank %d left the group", rank)
