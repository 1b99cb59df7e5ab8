"""``specula download``: fetch the ``hf://`` checkpoints of a runtime config into the
local Hugging Face cache (``HF_HOME``), from which ``specula serve`` loads them offline.

The init container of ``engine: specula`` pods; the cache is an ``emptyDir`` or a
PersistentVolumeClaim (``spec.modelCache``), so a restart or a second replica on a
shared claim finds the files already there.  ``huggingface_hub`` reads ``HF_ENDPOINT``
and ``HF_TOKEN`` (from ``spec.hfTokenSecret``).  A failure prints one line that says
why (missing repository or revision, refused token, gated repository, full disk,
unreachable Hub) to stderr and to the termination-message file, and exits 1.  No torch.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from pathlib import Path

TERMINATION_LOG = Path("/dev/termination-log")
"""The kubelet's default ``terminationMessagePath``, mounted into each container."""


def write_termination_message(message: str) -> None:
    """Write ``message`` to the kubelet's termination-message file where it exists; the
    pod's status then carries it (the operator's ``Degraded`` message) instead of the
    last log lines, whose start a traceback would fill."""
    if TERMINATION_LOG.exists():
        with contextlib.suppress(OSError):  # a read-only file: the log has the reason too
            TERMINATION_LOG.write_text(message)


class DownloadError(RuntimeError):
    """A checkpoint could not be downloaded; the message is the reason for the user."""


def hf_checkpoints(config_path: Path) -> list[tuple[str, str | None]]:
    """``(repo_id, revision)`` of the target and draft ``hf://`` URIs of a runtime config.

    Raises:
        DownloadError: the file is unreadable or not a valid runtime config.
    """
    from pydantic import ValidationError

    from specula.api.runtime_config import RuntimeConfig

    try:
        config = RuntimeConfig.model_validate_json(config_path.read_text())
    except (OSError, ValidationError) as exc:
        raise DownloadError(f"cannot read runtime config {config_path}: {exc}") from exc
    draft = config.speculator.model if config.speculator is not None else None
    uris = [(config.model, config.revision), (draft or "", None)]
    return [(uri.removeprefix("hf://").strip("/"), revision)
            for uri, revision in uris if uri.startswith("hf://")]


def download(repo_id: str, revision: str | None) -> Path:
    """``snapshot_download`` of one model repository into the cache; the snapshot's path.

    Raises:
        DownloadError: with the reason (see module docstring).
    """
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, revision=revision))
    except Exception as exc:  # noqa: BLE001 - any failure gets its reason out
        where = f"hf://{repo_id}" + (f" (revision {revision})" if revision else "")
        raise DownloadError(f"{where}: {_reason(exc)}") from exc


def _reason(exc: Exception) -> str:
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    token = os.environ.get("HF_TOKEN")
    token_note = "with the token from HF_TOKEN" if token else "without a token"
    if isinstance(exc, RevisionNotFoundError):
        return f"revision not found on {endpoint}"
    if isinstance(exc, GatedRepoError):
        return f"gated repository; access was refused {token_note}"
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else None
        if isinstance(exc, RepositoryNotFoundError) and status == 401 and token:
            return f"the Hub at {endpoint} refused the token from HF_TOKEN (401)"
        if isinstance(exc, RepositoryNotFoundError):
            return f"repository not found on {endpoint}, or private and not accessible {token_note}"
        if status in (401, 403):
            return f"the Hub at {endpoint} refused access {token_note} ({status})"
        return f"HTTP error from {endpoint}: {exc}"
    if isinstance(exc, LocalEntryNotFoundError):  # an OSError too: before the test below
        return f"cannot reach the Hub at {endpoint}: {exc}"
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return (f"no space left on device in the model cache "
                f"({os.environ.get('HF_HOME', 'HF_HOME')}); give spec.modelCache more room")
    return str(exc) if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"


def run_download(args) -> int:
    """Entry point of ``specula download`` (``args.config``, or ``args.model`` with
    ``args.revision``); 0 on success, 1 with the reason written on failure."""
    # One line per checkpoint in the pod's log, not a progress bar per file.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        if args.model:
            if not args.model.startswith("hf://"):
                raise DownloadError(f"{args.model}: only hf:// URIs are downloaded")
            targets = [(args.model.removeprefix("hf://").strip("/"), args.revision)]
        else:
            targets = hf_checkpoints(Path(args.config))
        for repo_id, revision in targets:
            path = download(repo_id, revision)
            print(f"downloaded hf://{repo_id} into {path}", flush=True)
        if not targets:
            print("no hf:// checkpoint to download", flush=True)
        return 0
    except DownloadError as exc:
        print(f"specula download: {exc}", file=sys.stderr, flush=True)
        write_termination_message(str(exc))
        return 1
