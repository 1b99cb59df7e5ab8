"""Run the Triton kernels on the CPU, in Triton's interpreter, isolated from this process.

Triton reads ``TRITON_INTERPRET`` when a ``@triton.jit`` function is defined, that is when
``triton.language`` (whose ``tl.sum``, ``tl.max``, ... are jit functions too) and the
kernel modules are imported, not when a kernel is launched. Setting it here would come
too late if another test file imported triton first, and would switch every later
import in this process to the interpreter. So the kernel checks run in one worker
process started (spawn, a fresh interpreter) with ``TRITON_INTERPRET=1`` in its
environment; this process's environment is restored right after the start.

Fixture ``interpreted(fn, *args, **kwargs)`` runs the module-level function ``fn`` in
that worker and returns its result; an assertion failing there fails the calling test
with the worker's traceback. ``fn`` is pickled by reference, so it must live at the top
level of a test module (pytest's default "prepend" import mode puts this directory on
``sys.path``, which the worker inherits).
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch


@pytest.fixture(scope="session")
def interpreted():
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        pool = ProcessPoolExecutor(
            max_workers=1,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=torch.set_num_threads,
            initargs=(1,),
        )
        # The worker starts on the first submit and copies the environment then.
        assert pool.submit(os.getenv, "TRITON_INTERPRET").result() == "1"
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous

    def run(fn, *args, **kwargs):
        return pool.submit(fn, *args, **kwargs).result()

    yield run
    pool.shutdown()
