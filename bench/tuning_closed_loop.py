"""The tuner's closed loop on the real engine (issue 13, section 3).

The engine (:class:`~specula.runtime.engine.llm_engine.LLMEngine`, the one ``specula
serve`` runs) serves behind the runtime's HTTP app, in this process under uvicorn on a
loopback socket; the operator's own tuning tick (:func:`specula.operator.tuning.tune`,
``Auto`` mode) drives it through the operator's :class:`RuntimeClient`: ``GET
/metrics``, ``GET`` and ``PUT /v1/speculative_config`` over HTTP, with status kept on an
in-memory SpeculativeModel object in place of the API server (:class:`InMemoryKube`).

Workload, as ``bench/step_costs.py``: a Llama-3.1-8B-shaped target in bfloat16 with
random weights and a 1-layer EAGLE-3 head, acceptance set through the engine's
``synthetic_acceptance_rate`` (each draft token accepted with that probability given the
ones before it; vLLM's ``rejection_sample_method="synthetic"``).  Phases (the issue's
table): batch 1 at acceptance 0.85, batch 64 at 0.5, batch 16 at 0.15, batch 32 at 0.8.

Closed-loop clients: inside a phase exactly ``batch`` requests are in the engine; a
request that finishes is replaced before the next step, from a deterministic stream per
phase (request ``i`` of phase ``p`` has the same random prompt, length and sampling seed
in every run, so the synthetic acceptance draws are the same where the positions are).
A phase starts by aborting the previous phase's requests and admitting ``batch`` new ones.

Logical time: the engine runs in lockstep with the tuner.  An *interval* is a fixed
amount of engine time (the sum of step durations, ``--interval-engine-s``) or a fixed
number of steps (``--interval-steps``); between two intervals the engine is idle and
the operator's tick runs with its clock at ``interval * 30 s``, so the tuner sees the
shipped defaults (``interval: 30s``, ``cooldown: 2m`` = 4 intervals, half-lives and
blacklist in the same proportion) while the whole run takes minutes.  A window then
holds far fewer steps than a real 30 s one (above the tuner's ``min_steps`` and
``min_drafts``), so the tuner decides on noisier data than it would in production.

Comparison: every static k of ``--static-ks`` runs the same phase streams for
``--static-intervals`` intervals each.  Goodput is generated tokens per second of engine
time.  A static phase is extrapolated to the tuned run's phase length: the first
interval (prefill of the new batch) as measured, the rest at the rate of the later
intervals (the phase is stationary for a fixed k).  Metrics
(:func:`closed_loop_metrics`): ``gain_over_best_static``,
``oracle_headroom_captured`` (the hindsight oracle runs the best static k of each
phase), ``k0_phase_loss`` (the acceptance-0.15 phase against k = 0),
``worst_phase_fraction_after_3`` (per phase, the tuned rate after its first 3
intervals over the best static k's rate after its first interval).

Run on the GPU machine::

    PYTHONPATH=. python3 bench/tuning_closed_loop.py --output $OUT/tuning_closed_loop_h100.json

``--dry-run`` runs tiny shapes on the CPU to check the plumbing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import datetime as dt
import json
import platform
import random
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

NAMESPACE, NAME = "bench", "closed-loop"
TICK_INTERVAL_S = 30.0
"""Logical seconds per interval: ``spec.tuning.interval``'s default."""


@dataclass(frozen=True)
class Phase:
    batch: int
    """Requests in the engine throughout the phase (a bursty phase: while high)."""
    acceptance: float
    """Synthetic per-position (conditional) acceptance rate."""
    intervals: int | None = None
    """Tuned intervals of this phase (``None``: ``LoopConfig.intervals_per_phase``)."""
    low_batch: int | None = None
    """Bursty phase: the client count alternates between ``batch`` and this every
    ``burst_steps`` engine steps (``None``: steady)."""
    burst_steps: int = 12

    @property
    def batches(self) -> tuple[int, ...]:
        """The batch sizes the phase runs at."""
        return (self.batch,) if self.low_batch is None else (self.low_batch, self.batch)

    def label(self) -> str:
        if self.low_batch is None:
            return f"B={self.batch}, acceptance {self.acceptance:g}"
        return (f"B={self.low_batch}<->{self.batch} every {self.burst_steps} steps, "
                f"acceptance {self.acceptance:g}")


PHASES = (Phase(1, 0.85), Phase(64, 0.5), Phase(16, 0.15), Phase(32, 0.8))
"""The issue's table."""
K0_PHASE = 2
"""Index of the phase where k = 0 should win (acceptance 0.15)."""

SCHEDULE_PHASES = (
    Phase(64, 0.8, low_batch=8, burst_steps=12),
    Phase(16, 0.8),
    Phase(64, 0.6, low_batch=8, burst_steps=12),
)
"""``--per-batch-size`` (issue 13, section 4): the batch varies within every interval
(8 <-> 64 every 12 steps), then the load moves to a batch size the bursty phase never
ran (16), then the bursty load returns at a lower acceptance."""


@dataclass(frozen=True)
class LoopConfig:
    """One closed-loop comparison."""

    phases: tuple[Phase, ...] = PHASES
    intervals_per_phase: int = 16
    interval_engine_s: float | None = 1.25
    """Engine seconds per interval (``None``: ``interval_steps``)."""
    interval_steps: int | None = None
    static_ks: tuple[int, ...] = tuple(range(9))
    static_intervals: int = 5
    """Intervals each static k runs per phase (the first is the phase's prefill)."""
    start_k: int = 3
    """``speculator.numSpeculativeTokens``: the k the tuner starts from."""
    max_k: int = 8
    prompt_len: int = 128
    max_tokens: tuple[int, int] = (64, 256)
    """Generated tokens per request, drawn uniformly in this range."""
    seed: int = 0
    cooldown: str = "2m"
    """``spec.tuning.cooldown`` (logical; the default)."""
    k0_phase: int | None = K0_PHASE


# ---- closed-loop clients and the step gate ------------------------------------------


class RequestStream:
    """Requests of one phase: request ``i`` is the same in every run."""

    def __init__(self, tag: str, phase_index: int, vocab: int, cfg: LoopConfig) -> None:
        self.tag, self.phase_index, self.vocab, self.cfg = tag, phase_index, vocab, cfg
        self.issued = 0

    def next(self) -> tuple[str, list[int], Any]:
        """The next request: its id, prompt and sampling parameters."""
        from specula.runtime.engine.sampling_params import SamplingParams

        i = self.issued
        self.issued += 1
        rng = random.Random((self.cfg.seed * 1_000_003 + self.phase_index) * 1_000_003 + i)
        prompt = [rng.randrange(1, self.vocab) for _ in range(self.cfg.prompt_len)]
        params = SamplingParams(
            max_tokens=rng.randint(*self.cfg.max_tokens), ignore_eos=True,
            seed=rng.randrange(2**31),
        )
        return f"{self.tag}-p{self.phase_index}-{i}", prompt, params


class ClosedLoopEngine:
    """The engine as :class:`EngineLoop` sees it: the real engine's attributes and
    methods, a ``step`` that replaces finished requests at once, and a gate that lets
    the loop step only within a granted budget of steps or engine seconds.

    Budgets are granted (and phases started) through ``EngineLoop.call``, so every
    change happens on the loop's thread between two steps.  ``clock`` is what the loop
    times steps with (``time.perf_counter``); ``step_cost(batch, k)``, when given,
    advances a logical clock by that many seconds per step (deterministic tests).

    A bursty phase (``low_batch``) alternates the number of clients between ``batch``
    and ``low_batch`` every ``burst_steps`` steps: going down, the clients of the most
    recently issued requests leave (their requests are aborted; the tokens they
    generated count), going up, new clients each send a request.
    """

    def __init__(
        self,
        engine: Any,
        clock: Callable[[], float] = time.perf_counter,
        step_cost: Callable[[int, int], float] | None = None,
        advance: Callable[[float], None] | None = None,
    ) -> None:
        self._engine = engine
        self._clock = clock
        self._step_cost = step_cost
        self._advance = advance
        self._steps_left = 0
        self._seconds_left = 0.0
        self.idle = threading.Event()
        self.idle.set()
        self._live: dict[str, int] = {}
        """Request id -> order of issue."""
        self._stream: RequestStream | None = None
        self._batch = 0
        self._burst: tuple[int, int, int] | None = None
        """(high, low, steps) of a bursty phase."""
        self._phase_steps = 0
        self.steps = 0
        self.engine_s = 0.0
        self.k_steps: Counter[int] = Counter()
        """Decode steps per k used."""
        self.k_steps_by_batch: Counter[tuple[int, int]] = Counter()
        """Decode steps per (batch size, k used)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._engine, name)

    @property
    def tokens(self) -> int:
        return int(self._engine.generation_tokens_total)

    # Called on the loop thread (through EngineLoop.call).
    def start_phase(self, stream: RequestStream, batch: int, acceptance: float,
                    low_batch: int | None = None, burst_steps: int = 0) -> None:
        for rid in sorted(self._live):
            self._engine.abort_request(rid)
        self._live.clear()
        self._engine.synthetic_acceptance_rate = acceptance
        self._stream, self._batch = stream, batch
        self._burst = (batch, low_batch, burst_steps) if low_batch is not None else None
        self._phase_steps = 0
        self._top_up()

    def grant(self, steps: int | None = None, seconds: float | None = None) -> None:
        self._steps_left = steps or 0
        self._seconds_left = seconds or 0.0
        self.idle.clear()

    def _top_up(self) -> None:
        assert self._stream is not None
        while len(self._live) < self._batch:
            rid, prompt, params = self._stream.next()
            self._engine.add_request(rid, prompt, params)
            self._live[rid] = self._stream.issued

    def _burst_turn(self) -> None:
        """Bursty phase: every ``burst_steps`` steps the client count switches."""
        if self._burst is None:
            return
        high, low, every = self._burst
        self._phase_steps += 1
        if self._phase_steps % every:
            return
        self._batch = low if self._batch == high else high
        leaving = sorted(self._live, key=self._live.__getitem__)[self._batch:]
        for rid in leaving:
            self._engine.abort_request(rid)
            del self._live[rid]

    def has_unfinished_requests(self) -> bool:
        granted = self._steps_left > 0 or self._seconds_left > 0
        return granted and self._engine.has_unfinished_requests()

    def step(self) -> list:
        t0 = self._clock()
        outputs = self._engine.step()
        for out in outputs:
            if out.finished:
                self._live.pop(out.request_id, None)
        self._burst_turn()
        self._top_up()
        batch = self._engine.last_step_num_reqs
        k = self._engine.last_step_num_speculative_tokens
        if self._step_cost is not None and self._advance is not None:
            self._advance(self._step_cost(batch, k))
        elapsed = self._clock() - t0
        self._steps_left -= 1
        self._seconds_left -= elapsed
        if self._steps_left <= 0 and self._seconds_left <= 0:
            # The step in flight (asynchronous scheduling) belongs to this interval:
            # finish its device work inside the timed step, not during the pause.
            if self._engine.device.type == "cuda":
                import torch

                torch.cuda.synchronize()
                elapsed = self._clock() - t0
            self.idle.set()
        self.steps += 1
        self.engine_s += elapsed
        if batch > 0:
            self.k_steps[k] += 1
            self.k_steps_by_batch[batch, k] += 1
        return outputs


# ---- the operator's side --------------------------------------------------------------


def _merge_patch(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """RFC 7386 JSON merge patch, as the API server applies a status patch."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge_patch(target[key], value)
        else:
            target[key] = copy.deepcopy(value)
    return target


class InMemoryKube:
    """The calls :func:`specula.operator.tuning.tune` makes of
    :class:`specula.operator.kube.Kube`, on one in-memory SpeculativeModel whose
    Service has one ready endpoint (the served runtime), and its Secrets."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = copy.deepcopy(body)
        self.slices: list[dict[str, Any]] = []
        self.secrets: dict[str, dict[str, Any]] = {}
        self.events: list[tuple[str, str, str]] = []

    def get_speculative_model(self, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.body)

    def list_endpoint_slices(self, namespace: str, service: str) -> list[dict[str, Any]]:
        return copy.deepcopy(self.slices)

    def get_deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        return None

    def get_secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.secrets.get(name))

    def create_secret(self, manifest: dict[str, Any]) -> dict[str, Any]:
        self.secrets[manifest["metadata"]["name"]] = copy.deepcopy(manifest)
        return copy.deepcopy(manifest)

    def patch_status(self, namespace: str, name: str, status: dict[str, Any],
                     resource_version: str | None = None) -> dict[str, Any]:
        meta = self.body["metadata"]
        if resource_version is not None and resource_version != meta["resourceVersion"]:
            from specula.operator.kube import ApiException

            raise ApiException(status=409, reason="Conflict")
        self.body["status"] = _merge_patch(self.body.get("status") or {}, status)
        meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)
        return copy.deepcopy(self.body)

    def post_event(self, body: dict[str, Any], type_: str, reason: str, message: str,
                   now: str) -> None:
        self.events.append((type_, reason, message))


def speculative_model(cfg: LoopConfig) -> dict[str, Any]:
    """The SpeculativeModel the tuner works on: ``Auto`` mode, the shipped interval and
    cooldown, k from ``cfg.start_k`` up to ``cfg.max_k``."""
    return {
        "apiVersion": "specula.dev/v1alpha1",
        "kind": "SpeculativeModel",
        "metadata": {"name": NAME, "namespace": NAMESPACE, "uid": "closed-loop-uid",
                     "generation": 1, "resourceVersion": "1"},
        "spec": {
            "model": {"uri": "file:///models/target"},
            # The engine's max_num_seqs: the range a per-batch-size schedule covers.
            "maxNumSeqs": max(b for p in cfg.phases for b in p.batches),
            "speculator": {"method": "eagle3", "model": {"uri": "file:///models/eagle3"},
                           "numSpeculativeTokens": cfg.start_k},
            "tuning": {"mode": "Auto", "maxSpeculativeTokens": cfg.max_k,
                       "interval": f"{TICK_INTERVAL_S:g}s", "cooldown": cfg.cooldown},
        },
    }


@contextlib.contextmanager
def per_batch_size(kube: InMemoryKube) -> Iterator[str]:
    """Per-batch-size schedules on for the resource in ``kube`` while in the block.

    Through the CRD (``spec.tuning.perBatchSize: true``) where the operator's spec
    model has that field; otherwise (an operator without it) through the same settings
    path, ``TuningSettings.apply_schedule``, set on what the operator's
    :func:`specula.operator.tuner.tuning_settings` builds from the spec.  Yields which
    of the two is in use."""
    from specula.operator import tuner as pure
    from specula.operator.reconcile import parse_spec

    tuning = kube.body["spec"]["tuning"]
    tuning["perBatchSize"] = True
    spec, problem = parse_spec(kube.body)
    if (spec is not None and problem is None
            and getattr(spec.tuning, "per_batch_size", None) is True
            and pure.tuning_settings(spec).apply_schedule):
        try:
            yield "spec.tuning.perBatchSize"
        finally:
            tuning.pop("perBatchSize", None)
        return
    tuning.pop("perBatchSize")
    original = pure.tuning_settings
    pure.tuning_settings = lambda s: replace(original(s), apply_schedule=True)
    try:
        yield "TuningSettings.apply_schedule"
    finally:
        pure.tuning_settings = original


@dataclass
class ServedRuntime:
    """The runtime's HTTP app(s) under uvicorn on loopback, and how the operator
    reaches them: its Kubernetes view (:class:`InMemoryKube`, whose EndpointSlice lists
    the served ports) and its :class:`RuntimeClient`."""

    kube: InMemoryKube
    client: Any
    servers: list[Any] = field(default_factory=list)

    def close(self) -> None:
        self.client.close()
        for server, thread in self.servers:
            server.should_exit = True
            thread.join(10)


def _uvicorn(app: Any) -> tuple[Any, Any, int]:
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    return server, thread, sock.getsockname()[1]


def serve(loop: Any, kube: InMemoryKube, timeout_s: float = 10.0) -> ServedRuntime:
    """Serve ``loop`` (started by the app's lifespan) as a runtime pod of ``kube.body``.

    Where the runtime has its admin API on a port of its own (``create_admin_app``),
    the admin app listens on a second port, listed in the EndpointSlice as ``admin``,
    and checks the resource's admin token, which the operator's reconcile code
    (``reconcile.admin_token``) creates in the resource's Secret; otherwise the admin
    routes answer on the model port.
    """
    from specula.operator import reconcile
    from specula.operator.runtime_client import RuntimeClient
    from specula.runtime.server import app as app_module

    model = app_module.create_app(loop)
    make_admin = getattr(app_module, "create_admin_app", None)
    server, thread, port = _uvicorn(model)
    servers = [(server, thread)]
    ports = [{"name": "http", "port": port}]
    client_kwargs: dict[str, Any] = {}
    if make_admin is not None:
        token = reconcile.admin_token(kube, reconcile.owner_of(kube.body))
        a_server, a_thread, a_port = _uvicorn(make_admin(model, lambda: token))
        servers.append((a_server, a_thread))
        ports.append({"name": "admin", "port": a_port})
        client_kwargs["admin_token"] = token  # the static runs' PUTs
    kube.slices = [{
        "ports": ports,
        "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": True},
                       "targetRef": {"kind": "Pod", "name": f"{NAME}-0"}}],
    }]
    return ServedRuntime(kube, RuntimeClient(timeout_s, **client_kwargs), servers)


# ---- the driver -----------------------------------------------------------------------


def _call(loop: Any, fn: Callable[[Any], Any]) -> Any:
    """``fn(engine)`` on the engine loop's thread between two steps."""
    return asyncio.run(loop.call(fn))


class Harness:
    """The served engine, driven interval by interval."""

    def __init__(self, loop: Any, gate: ClosedLoopEngine, served: ServedRuntime,
                 cfg: LoopConfig, vocab: int, log: Callable[[str], None] = print) -> None:
        self.loop, self.gate, self.served, self.cfg, self.vocab = loop, gate, served, cfg, vocab
        self.log = log
        self.runs = 0
        self.schedules_through: str | None = None

    def start_phase(self, tag: str, index: int, batch: int | None = None) -> None:
        """Start phase ``index``'s request stream (at a steady ``batch`` if given)."""
        phase = self.cfg.phases[index]
        stream = RequestStream(tag, index, self.vocab, self.cfg)
        if batch is not None:
            _call(self.loop, lambda e: e.start_phase(stream, batch, phase.acceptance))
        else:
            _call(self.loop, lambda e: e.start_phase(
                stream, phase.batch, phase.acceptance, phase.low_batch, phase.burst_steps))

    def interval(self) -> dict[str, Any]:
        """Run one interval; its tokens, engine seconds, steps and k used."""
        g = self.gate
        tokens, seconds, steps, ks = g.tokens, g.engine_s, g.steps, Counter(g.k_steps)
        by_batch = Counter(g.k_steps_by_batch)
        cfg = self.cfg
        _call(self.loop, lambda e: e.grant(steps=cfg.interval_steps, seconds=cfg.interval_engine_s))
        if not g.idle.wait(600):
            raise RuntimeError("the engine did not finish its interval")
        used = {k: n - ks.get(k, 0) for k, n in g.k_steps.items() if n - ks.get(k, 0)}
        per_batch: dict[str, dict[str, int]] = {}
        for (b, k), n in sorted(g.k_steps_by_batch.items()):
            if n - by_batch.get((b, k), 0):
                per_batch.setdefault(str(b), {})[str(k)] = n - by_batch.get((b, k), 0)
        return {
            "tokens": g.tokens - tokens,
            "engine_s": round(g.engine_s - seconds, 6),
            "steps": g.steps - steps,
            "k_steps": {str(k): n for k, n in sorted(used.items())},
            "k_steps_by_batch": per_batch,
        }

    def put_k(self, k: int) -> None:
        from specula.operator.tuner import Endpoint, ready_endpoints

        endpoints: list[Endpoint] = ready_endpoints(self.served.kube.slices)
        failed = self.served.client.put_all(endpoints, {"num_speculative_tokens": k})
        if failed:
            raise RuntimeError(f"PUT k={k} failed: {failed}")

    def run_static(self, k: int, write: Callable[[], None] = lambda: None) -> list[list[dict]]:
        """Every phase at a fixed k for ``static_intervals`` intervals."""
        self.put_k(k)
        tag = f"static{k}-{self.runs}"
        self.runs += 1
        phases = []
        for p in range(len(self.cfg.phases)):
            self.start_phase(tag, p)
            phases.append([self.interval() for _ in range(self.cfg.static_intervals)])
            self.log(f"static k={k} phase {p + 1}: {_rate(phases[-1]):.1f} tok/s")
            write()
        return phases

    def run_tuned(self, record: Callable[[list[list[dict]]], None] = lambda _: None,
                  schedules: bool = False) -> list[list[dict]]:
        """Every phase with the operator's tuning tick between intervals; with
        ``schedules``, the tuner decides per-batch-size schedules (:func:`per_batch_size`)."""
        self.put_k(self.cfg.start_k)  # clears a schedule an earlier run left
        self.served.kube.body = speculative_model(self.cfg)
        if not schedules:
            return self._run_tuned(record)
        with per_batch_size(self.served.kube) as how:
            self.log(f"per-batch-size schedules on through {how}")
            self.schedules_through = how
            return self._run_tuned(record)

    def _run_tuned(self, record: Callable[[list[list[dict]]], None]) -> list[list[dict]]:
        from specula.operator.settings import OperatorSettings
        from specula.operator.tuning import tune

        cfg = self.cfg
        kube = self.served.kube
        settings = OperatorSettings()
        clock = {"now": 1_800_000_000.0}

        def tick() -> dict[str, Any]:
            before = len(kube.events)
            update = tune(kube.body, kube, self.served.client, settings, clock=lambda: clock["now"])
            status = kube.body.get("status") or {}
            tuned = next((c for c in status.get("conditions", []) if c["type"] == "Tuned"), {})
            spec = status.get("speculation") or {}
            state = (status.get("tuner") or {}).get("state") or {}
            return {
                "written": update is not None,
                "k": spec.get("numSpeculativeTokens"),
                "schedule": state.get("schedule"),
                "reason": tuned.get("reason"),
                "message": (tuned.get("message") or "")[:200],
                "measured_goodput": spec.get("goodputTokensPerSecond"),
                "predicted_goodput": spec.get("predictedGoodputTokensPerSecond"),
                "events": [f"{r}: {m}"[:200] for _, r, m in kube.events[before:]],
            }

        first = tick()  # baselines, and the spec's k onto the pod
        self.log(f"tuner start: k={first['k']} ({first['reason']})")
        tag = f"tuned-{self.runs}"
        self.runs += 1
        phases: list[list[dict]] = []
        for p, phase in enumerate(cfg.phases):
            self.start_phase(tag, p)
            phases.append([])
            for i in range(phase.intervals or cfg.intervals_per_phase):
                rec = self.interval()
                clock["now"] += TICK_INTERVAL_S
                rec["tuner"] = tick()
                phases[-1].append(rec)
                t = rec["tuner"]
                sched = " ".join(f"{a}-{b}:{k}" for a, b, k in t["schedule"] or ())
                self.log(f"tuned phase {p + 1} interval {i + 1}: ran k={rec['k_steps_by_batch']} "
                         f"{rec['tokens'] / rec['engine_s']:.1f} tok/s -> k={t['k']}"
                         f"{' [' + sched + ']' if sched else ''} ({t['message'][:90]})")
                record(phases)
        return phases


def _rate(intervals: Sequence[dict]) -> float:
    seconds = sum(r["engine_s"] for r in intervals)
    return sum(r["tokens"] for r in intervals) / seconds if seconds > 0 else 0.0


# ---- metrics ------------------------------------------------------------------------


def static_phase_goodput(intervals: Sequence[dict], duration_s: float) -> float:
    """A static k's goodput over a phase of ``duration_s`` engine seconds: its first
    interval as measured, the rest at the rate of its later intervals."""
    first, rest = intervals[0], intervals[1:]
    if not rest or duration_s <= first["engine_s"]:
        return _rate(intervals)
    return (first["tokens"] + _rate(rest) * (duration_s - first["engine_s"])) / duration_s


def closed_loop_metrics(
    tuned: Sequence[Sequence[dict]],
    static: dict[int, Sequence[Sequence[dict]]],
    k0_phase: int | None = K0_PHASE,
    settle_intervals: int = 3,
) -> dict[str, Any]:
    """The issue's figures from per-interval records (``tokens``, ``engine_s``).

    Args:
        tuned: per phase, the tuned run's intervals.
        static: k -> per phase, that static k's intervals.
        k0_phase: index of the phase where k = 0 should win (``None``: none).
        settle_intervals: intervals a phase gives the tuner before
            ``worst_phase_fraction_after_3`` counts.

    Returns:
        per-phase goodputs (tokens per engine second) and ``gain_over_best_static``
        (tuned overall / best static k overall - 1; overall = total tokens / total
        engine seconds, the static phases extrapolated to the tuned phases' lengths),
        ``oracle_headroom_captured`` ((tuned - best static) / (oracle - best static),
        the oracle running each phase's best static k), ``k0_phase_loss`` (1 - tuned /
        k = 0 in phase ``k0_phase``), ``worst_phase_fraction_after_3`` (min over phases
        of the tuned rate after ``settle_intervals`` intervals over the best static
        rate after its first interval), and the verdict.

    Raises:
        ValueError: no static run, or runs with different numbers of phases.
    """
    if not static:
        raise ValueError("no static k to compare with")
    n = len(tuned)
    if any(len(runs) != n for runs in static.values()):
        raise ValueError("every run needs the same phases")
    durations = [sum(r["engine_s"] for r in ph) for ph in tuned]
    total = sum(durations)
    tuned_phase = [_rate(ph) for ph in tuned]
    tuned_overall = sum(g * d for g, d in zip(tuned_phase, durations, strict=True)) / total
    static_phase = {k: [static_phase_goodput(runs[p], durations[p]) for p in range(n)]
                    for k, runs in static.items()}
    static_overall = {k: sum(g * d for g, d in zip(gs, durations, strict=True)) / total
                      for k, gs in static_phase.items()}
    best_k = max(static_overall, key=lambda k: static_overall[k])
    best = static_overall[best_k]
    phase_best_k = [max(static, key=lambda k: static_phase[k][p]) for p in range(n)]
    oracle = sum(static_phase[phase_best_k[p]][p] * durations[p] for p in range(n)) / total
    headroom = oracle - best
    steady = {k: [_rate(runs[p][1:] or runs[p]) for p in range(n)] for k, runs in static.items()}
    after = []
    for p in range(n):
        settled = tuned[p][settle_intervals:]
        best_steady = max(steady[k][p] for k in steady)
        after.append(_rate(settled) / best_steady if settled and best_steady > 0 else None)
    gain = tuned_overall / best - 1
    captured = (tuned_overall - best) / headroom if headroom > 0 else None
    k0_loss = None
    if k0_phase is not None and 0 in static_phase:
        k0_loss = 1 - tuned_phase[k0_phase] / static_phase[0][k0_phase]
    worst = min((a for a in after if a is not None), default=None)
    checks = {
        "above_best_static": gain > 0,
        "headroom_captured_ge_0.5": captured is not None and captured >= 0.5,
        "phases_ge_0.97_after_3": worst is not None and worst >= 0.97,
        "k0_phase_loss_le_0.02": k0_loss is not None and k0_loss <= 0.02,
    }
    verdict = "pass" if all(checks.values()) else "refuted" if gain <= 0 else "not met"
    return {
        "gain_over_best_static": round(gain, 4),
        "oracle_headroom_captured": None if captured is None else round(captured, 4),
        "k0_phase_loss": None if k0_loss is None else round(k0_loss, 4),
        "worst_phase_fraction_after_3": None if worst is None else round(worst, 4),
        "checks": checks,
        "verdict": verdict,
        "best_static_k": best_k,
        "oracle_headroom": round(headroom / best, 4),
        "overall_goodput": {"tuned": round(tuned_overall, 2),
                            **{f"k={k}": round(g, 2) for k, g in sorted(static_overall.items())},
                            "oracle": round(oracle, 2)},
        "phase_goodput": {"tuned": [round(g, 2) for g in tuned_phase],
                          **{f"k={k}": [round(g, 2) for g in gs]
                             for k, gs in sorted(static_phase.items())}},
        "phase_best_static_k": phase_best_k,
        "phase_fraction_after_3": [None if a is None else round(a, 4) for a in after],
        "phase_engine_s": [round(d, 3) for d in durations],
    }


def drop_stalls(intervals: Sequence[dict], fraction: float = 0.6) -> list[dict]:
    """``intervals`` without those whose goodput is below ``fraction`` of the median of
    the list: on the H100 these were first-use kernel compilations (a bursty phase mixes
    prefill and decode in shapes a steady warm-up never ran), 2-3x slow and only in the
    first run of a k at those shapes."""
    if not intervals:
        return []
    rates = sorted(r["tokens"] / r["engine_s"] for r in intervals if r["engine_s"] > 0)
    median = rates[len(rates) // 2]
    return [r for r in intervals if r["engine_s"] > 0 and r["tokens"] / r["engine_s"] >= fraction * median]


def schedule_metrics(
    single: Sequence[Sequence[dict]],
    schedule: Sequence[Sequence[dict]],
    static: dict[int, Sequence[Sequence[dict]]],
    settle_intervals: int = 3,
) -> dict[str, Any]:
    """The tuner with per-batch-size schedules against the tuner with one k, on the same
    phases (``--per-batch-size``).

    Returns:
        ``schedule_over_single_k`` (overall goodput ratio - 1, total tokens over total
        engine seconds of each run), per phase the ratio over the whole phase
        (``phase_ratio``), over its first ``settle_intervals`` intervals (``phase_ratio_first``,
        where the load has just moved) and after them (``phase_ratio_after``), and each
        tuned run's :func:`closed_loop_metrics` against the static k (no k = 0 phase).

    Raises:
        ValueError: the runs have different numbers of phases.
    """
    if len(single) != len(schedule):
        raise ValueError("both tuned runs need the same phases")

    def ratio(a: Sequence[dict], b: Sequence[dict]) -> float | None:
        ra, rb = _rate(a), _rate(b)
        return round(rb / ra - 1, 4) if a and b and ra > 0 else None

    every_single = [r for ph in single for r in ph]
    every_schedule = [r for ph in schedule for r in ph]
    n = settle_intervals
    return {
        "schedule_over_single_k": ratio(every_single, every_schedule),
        "phase_ratio": [ratio(a, b) for a, b in zip(single, schedule, strict=True)],
        "phase_ratio_first": [ratio(a[:n], b[:n]) for a, b in zip(single, schedule, strict=True)],
        "phase_ratio_after": [ratio(a[n:], b[n:]) for a, b in zip(single, schedule, strict=True)],
        "single_k": closed_loop_metrics(single, static, None, settle_intervals),
        "schedule": closed_loop_metrics(schedule, static, None, settle_intervals),
    }


def schedule_metrics_without_stalls(
    single: Sequence[Sequence[dict]],
    schedule: Sequence[Sequence[dict]],
    static: dict[int, Sequence[Sequence[dict]]],
    settle_intervals: int = 3,
) -> dict[str, Any]:
    """:func:`schedule_metrics` with every run's stalled intervals dropped
    (:func:`drop_stalls`, per run and phase), and which intervals those were."""
    dropped = {
        name: [[i for i, r in enumerate(ph) if r not in drop_stalls(ph)] for ph in run]
        for name, run in [("tuned", single), ("tuned_schedule", schedule)]
        + [(f"k={k}", v) for k, v in sorted(static.items())]
    }
    return {
        "dropped_intervals": {n: d for n, d in dropped.items() if any(d)},
        **schedule_metrics(
            [drop_stalls(ph) for ph in single],
            [drop_stalls(ph) for ph in schedule],
            {k: [drop_stalls(ph) for ph in v] for k, v in static.items()},
            settle_intervals,
        ),
    }


# ---- building and running ---------------------------------------------------------------


def start(engine: Any, cfg: LoopConfig, gate: ClosedLoopEngine | None = None,
          log: Callable[[str], None] = print) -> Harness:
    """Serve ``engine`` (started with ``cfg.max_k``) behind the HTTP app; ready to drive."""
    from specula.runtime.server.engine_loop import EngineLoop

    gate = gate or ClosedLoopEngine(engine)
    loop = EngineLoop(lambda: gate)
    served = serve(loop, InMemoryKube(speculative_model(cfg)))
    if not loop.wait_ready(600):
        raise RuntimeError(f"the engine loop did not start: {loop.error!r}")
    return Harness(loop, gate, served, cfg, engine.vocab_size, log)


def compare(h: Harness, write: Callable[[dict], None] = lambda _: None) -> dict[str, Any]:
    """The tuned run, then every static k; the metrics once all have run."""
    out: dict[str, Any] = {"tuned": [], "static": {}}
    out["tuned"] = h.run_tuned(lambda phases: write(out | {"tuned": phases}))
    write(out)
    for k in h.cfg.static_ks:
        out["static"][str(k)] = h.run_static(k, lambda: write(out))
        write(out)
    out["metrics"] = closed_loop_metrics(
        out["tuned"], {int(k): v for k, v in out["static"].items()}, h.cfg.k0_phase
    )
    write(out)
    return out


def compare_schedules(h: Harness, write: Callable[[dict], None] = lambda _: None,
                      time_left: Callable[[], float] = lambda: float("inf")) -> dict[str, Any]:
    """The tuner with one k, the tuner with per-batch-size schedules, then the static k
    in ``cfg.static_ks`` order while ``time_left()`` (seconds) allows another one at the
    pace of the runs so far; the metrics once all have run (:func:`schedule_metrics`)."""
    out: dict[str, Any] = {"tuned": [], "tuned_schedule": [], "static": {}, "static_skipped": []}
    out["tuned"] = h.run_tuned(lambda phases: write(out | {"tuned": phases}))
    write(out)
    out["tuned_schedule"] = h.run_tuned(
        lambda phases: write(out | {"tuned_schedule": phases}), schedules=True)
    out["schedules_through"] = h.schedules_through
    write(out)
    cfg = h.cfg
    per_interval = []
    for k in cfg.static_ks:
        need = cfg.static_intervals * len(cfg.phases) * max(per_interval, default=0.0)
        if need > time_left():
            h.log(f"static k={k} skipped: {need:.0f} s needed, {time_left():.0f} s left")
            out["static_skipped"].append(k)
            continue
        t = time.perf_counter()
        out["static"][str(k)] = h.run_static(k, lambda: write(out))
        per_interval.append((time.perf_counter() - t) / (cfg.static_intervals * len(cfg.phases)))
        static = {int(k): v for k, v in out["static"].items()}
        out["metrics"] = schedule_metrics(out["tuned"], out["tuned_schedule"], static)
        out["metrics_without_stalls"] = schedule_metrics_without_stalls(
            out["tuned"], out["tuned_schedule"], static)
        write(out)
    return out


def warm_up(h: Harness, steps: int = 6) -> None:
    """A few steps at every k for every phase's batch size, before anything is timed.

    The first step at a new batch size or k compiles kernels for its shapes (Triton's
    JIT); in a real 30 s window that is noise, in an interval of about a second it is a
    large part of the interval.  Without this the tuner's first probe of a k measured
    the compilation (an H100 run reverted a k=1 probe at batch 16 that way and then
    could not reach k=0), and the first interval of each new batch size was slowed."""
    cfg = h.cfg
    first_phase = {}
    for p, phase in enumerate(cfg.phases):
        for batch in phase.batches:
            first_phase.setdefault(batch, p)
    runs = [(p, batch, steps) for batch, p in sorted(first_phase.items())]
    # A bursty phase also runs its own mix of prefill and decode (new clients arriving
    # while others decode): an H100 run without this stalled 2-3x in the first
    # intervals of the first run of each k there.
    bursty = {(ph.batch, ph.low_batch, ph.burst_steps): p
              for p, ph in enumerate(cfg.phases) if ph.low_batch is not None}
    runs += [(p, None, 4 * ph[2]) for ph, p in sorted(bursty.items())]
    for p, batch, n in runs:
        for k in range(cfg.max_k, -1, -1):
            h.put_k(k)
            h.start_phase(f"warmup-p{p}-b{batch}-k{k}", p, batch)
            _call(h.loop, lambda e, n=n: e.grant(steps=n))
            if not h.gate.idle.wait(600):
                raise RuntimeError("the engine did not finish its warm-up")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=None,
                        help="default bench/results/tuning_closed_loop_h100.json "
                             "(--per-batch-size: tuning_closed_loop_schedule_h100.json)")
    parser.add_argument("--per-batch-size", action="store_true",
                        help="the tuner with one k and with per-batch-size schedules on "
                             "bursty and steady phases (SCHEDULE_PHASES), and the static k")
    parser.add_argument("--intervals-per-phase", type=int, default=None,
                        help="default 16 (--per-batch-size: 10)")
    parser.add_argument("--interval-engine-s", type=float, default=1.25)
    parser.add_argument("--interval-steps", type=int, default=None,
                        help="intervals of this many steps instead of engine seconds")
    parser.add_argument("--static-intervals", type=int, default=None,
                        help="default 5 (--per-batch-size: 4)")
    parser.add_argument("--static-ks", default=None,
                        help="static k in the order they run (a cut run keeps a spread); "
                             "default 0,2,4,6,8,1,3,5,7 (--per-batch-size: 4,3,5,6,2,0,7,8,1)")
    parser.add_argument("--prompt-len", type=int, default=None,
                        help="prompt tokens per request; default 128 (--per-batch-size: 32, "
                             "so that the clients arriving in a burst prefill little)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="--per-batch-size: skip the static k that would end past this "
                             "many seconds from the start")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    sched = args.per_batch_size
    if args.output is None:
        name = "tuning_closed_loop_schedule_h100.json" if sched else "tuning_closed_loop_h100.json"
        args.output = HERE / "results" / name

    import torch

    # Before the model loads: a missing server or operator dependency fails at once.
    import uvicorn  # noqa: F401
    from engine_e2e import LLAMA_8B, TINY, TINY_DRAFT, make_engine, write_checkpoints

    import specula.operator.tuning  # noqa: F401
    import specula.runtime.server.app  # noqa: F401

    device = "cpu" if args.dry_run else "cuda"
    if sched:
        phases = SCHEDULE_PHASES if not args.dry_run else (
            Phase(8, 0.8, low_batch=2, burst_steps=6), Phase(4, 0.8))
    else:
        phases = PHASES if not args.dry_run else (Phase(1, 0.85), Phase(8, 0.15))
    static_ks = args.static_ks or ("4,3,5,6,2,0,7,8,1" if sched else "0,2,4,6,8,1,3,5,7")
    cfg = LoopConfig(
        phases=phases,
        intervals_per_phase=args.intervals_per_phase or (10 if sched else 16),
        interval_engine_s=None if args.interval_steps else args.interval_engine_s,
        interval_steps=args.interval_steps,
        static_ks=tuple(int(k) for k in static_ks.split(",")),
        static_intervals=args.static_intervals or (4 if sched else 5),
        k0_phase=None if sched else K0_PHASE if not args.dry_run else 1,
        prompt_len=args.prompt_len or (16 if args.dry_run else 32 if sched else 128),
        **({} if not args.dry_run else {"max_tokens": (16, 48)}),
    )
    target, draft = (TINY, TINY_DRAFT) if args.dry_run else (LLAMA_8B, LLAMA_8B)
    t0 = time.perf_counter()
    meta = {
        "command": "python3 bench/tuning_closed_loop.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "gpu": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
        "software": {"python": platform.python_version(), "torch": torch.__version__,
                     "cuda": torch.version.cuda},
        "model": "Llama-3.1-8B shape, bfloat16, random weights" if not args.dry_run
                 else "tiny Llama, float32",
        "speculator": "eagle3: 1 decoder layer, draft vocabulary 32000, synthetic acceptance",
        "config": asdict(cfg),
        "phases": [ph.label() for ph in phases],
        "logical_time": (
            f"one interval = {cfg.interval_engine_s or cfg.interval_steps} "
            f"{'engine seconds' if cfg.interval_engine_s else 'engine steps'} = "
            f"{TICK_INTERVAL_S:g} s on the tuner's clock (spec.tuning.interval 30s, "
            f"cooldown {cfg.cooldown}); the engine is idle while the tuner ticks"
        ),
    }

    def write(result: dict) -> None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.output.with_suffix(".tmp")
        tmp.write_text(json.dumps(meta | {"elapsed_s": round(time.perf_counter() - t0, 1)}
                                  | result, indent=1) + "\n")
        tmp.replace(args.output)

    with tempfile.TemporaryDirectory() as tmp:
        dirs = write_checkpoints(Path(tmp), target, draft)
        batches = tuple(sorted({b for p in phases for b in p.batches}))
        engine = make_engine(dirs, "eagle3", cfg.max_k, batches, device, phases[0].acceptance)
        h = start(engine, cfg, log=lambda s: print(f"[{time.perf_counter() - t0:6.1f}s] {s}",
                                                   flush=True))
        meta["engine_startup_s"] = round(time.perf_counter() - t0, 1)
        try:
            warm_up(h)
            if sched:
                budget = args.budget_s if args.budget_s is not None else float("inf")
                result = compare_schedules(h, write, lambda: budget - (time.perf_counter() - t0))
            else:
                result = compare(h, write)
        finally:
            h.loop.stop()
            h.served.close()
    m = result["metrics"]
    if sched:
        print(json.dumps({k: m[k] for k in ("schedule_over_single_k", "phase_ratio",
                                            "phase_ratio_first", "phase_ratio_after")}))
        m = m["schedule"]
    print(json.dumps({k: m[k] for k in ("gain_over_best_static", "oracle_headroom_captured",
                                        "k0_phase_loss", "worst_phase_fraction_after_3",
                                        "verdict", "best_static_k", "phase_best_static_k")}))
    print(f"wrote {args.output} ({time.perf_counter() - t0:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
