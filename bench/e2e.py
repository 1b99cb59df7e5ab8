"""Wall time of the README's commands on a fresh machine, and the demo's speedup.

Each phase runs in a fresh clone of this repository (``../shared`` linked beside it) with
``HOME`` pointed at an empty directory, so that every cache the project fills (the
virtual environment's wheels, the Go module and build caches, the control plane, the node
binaries, Helm, the images, the demo models) starts empty, as on a new machine.  Debian
packages that ``hack/node.sh`` installs stay installed; on a new machine they add the
time of one ``apt-get install``.

Phases (run as root, one at a time; each needs about 30 GB of free disk):

- ``cold-test``: ``make test`` in a fresh clone and home;
- ``warm-test``: ``make test`` again in the clone and home of ``cold-test``;
- ``cold-demo``: ``make demo`` in another fresh clone and home; the demo's speedup comes
  from its ``cluster-demo-results.json`` (or ``demo-results.json`` without a node).

Usage::

    python bench/e2e.py cold-test warm-test cold-demo [--workdir DIR] [--keep]

Results are merged into ``bench/results/e2e.json`` (keys ``cold_make_test_s``,
``warm_make_test_s``, ``cold_make_demo_s``, ``demo_speedup``, ``e2e_tests_passed``, with
the machine and the date).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "e2e.json"


def _fresh(workdir: Path, name: str) -> tuple[Path, Path]:
    """A clone of HEAD at ``workdir/name/repo`` with ``shared`` beside it, and an empty
    home ``workdir/name/home``."""
    root = workdir / name
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    subprocess.run(["git", "clone", "-q", str(REPO), str(root / "repo")], check=True)
    shared = REPO.parent / "shared"
    if shared.exists():
        (root / "shared").symlink_to(shared.resolve())
    (root / "home").mkdir()
    return root / "repo", root / "home"


def _make(repo: Path, home: Path, target: str, log: Path) -> tuple[int, float]:
    # -rA: a "PASSED <node id>" line per test in the summary, to count the e2e tier's.
    env = {**os.environ, "HOME": str(home), "PYTEST_ADDOPTS": "-rA"}
    # The caches this process itself may point elsewhere go under the fresh home too.
    for key in ("GOPATH", "GOCACHE", "GOMODCACHE", "PIP_CACHE_DIR", "XDG_CACHE_HOME"):
        env.pop(key, None)
    t0 = time.monotonic()
    with open(log, "wb") as out:
        rc = subprocess.run(["make", target], cwd=repo, env=env, stdout=out,
                            stderr=subprocess.STDOUT).returncode
    return rc, time.monotonic() - t0


def _passed(log: Path, pattern: str) -> int | None:
    """Tests passed in the pytest run of ``log`` whose node ids match ``pattern``."""
    text = log.read_text(errors="replace")
    ids = re.findall(r"^PASSED (tests/\S+)", text, re.M)
    if ids:
        return sum(1 for i in ids if re.match(pattern, i))
    return None


def _demo_speedup(home: Path) -> float | None:
    for name in ("cluster-demo-results.json", "demo-results.json"):
        for path in sorted((home / ".cache" / "specula" / "demo").glob(f"*/{name}")):
            data = json.loads(path.read_text())
            measured = data.get("measured") or data.get("summary") or {}
            if measured.get("speedup") is not None:
                return float(measured["speedup"])
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("phases", nargs="+", choices=["cold-test", "warm-test", "cold-demo"])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/specula-e2e-bench"))
    parser.add_argument("--keep", action="store_true", help="keep the clones and homes")
    args = parser.parse_args(argv)
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    test_repo = test_home = None
    for phase in args.phases:
        if phase == "cold-test":
            test_repo, test_home = _fresh(args.workdir, "test")
        if phase in ("cold-test", "warm-test"):
            if test_repo is None:
                test_repo, test_home = args.workdir / "test" / "repo", args.workdir / "test" / "home"
            log = args.workdir / f"{phase}.log"
            rc, wall = _make(test_repo, test_home, "test", log)
            key = "cold_make_test_s" if phase == "cold-test" else "warm_make_test_s"
            results[key] = round(wall, 1)
            results[f"{key[:-2]}_exit_code"] = rc
            passed = _passed(log, "tests/e2e/")
            if passed is not None:
                results["e2e_tests_passed"] = passed
            if phase == "warm-test" and not args.keep:
                shutil.rmtree(args.workdir / "test", ignore_errors=True)
        if phase == "cold-demo":
            repo, home = _fresh(args.workdir, "demo")
            rc, wall = _make(repo, home, "demo", args.workdir / "cold-demo.log")
            results["cold_make_demo_s"] = round(wall, 1)
            results["cold_make_demo_exit_code"] = rc
            results["demo_speedup"] = _demo_speedup(home)
            if not args.keep:
                shutil.rmtree(args.workdir / "demo", ignore_errors=True)
        RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
        print(f"{phase}: {json.dumps({k: v for k, v in results.items() if phase.split('-')[1] in k})}",
              flush=True)
    results["machine"] = {"platform": platform.platform(), "cpus": os.cpu_count(),
                          "memory_gib": round(os.sysconf("SC_PAGE_SIZE")
                                              * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)}
    results["date"] = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    results["command"] = "python bench/e2e.py " + " ".join(args.phases)
    RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
