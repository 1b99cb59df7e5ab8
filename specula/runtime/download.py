"""``specula download``: fetch the ``hf://`` checkpoints of a runtime config into the
local Hugging Face cache (``HF_HOME``), so that ``specula serve`` then loads them
offline.

The operator runs it as the init container of ``engine: specula`` pods; the cache is
an ``emptyDir`` or a PersistentVolumeClaim (``spec.modelCache``), so a restart or a
second replica on a shared claim finds the files already there (``snapshot_download``
skips files whose content is cached).  The Hub is ``HF_ENDPOINT`` (default
huggingface.co), the token ``HF_TOKEN`` (from ``spec.hfTokenSecret``); both are read
by ``huggingface_hub``, the real client.

A failure prints one line that says why (missing repository or revision, refused
token, gated repository, full disk, unreachable Hub) to stderr and to the container's
termination-message file, and exits 1.  No torch import.
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

TERMINATION_LOG = Path("/dev/termination-log")
"""The kubelet's default ``terminationMessagePath``: the kubelet mounts it into each
container, so it is written only where it exists."""


def write_termination_message(message: str) -> None:
    """Write ``message`` to the kubelet's termination-message file where it exists; the
    pod's status then carries it (the operator's ``Degraded`` message) instead of the
    last log lines, whose start a traceback would fill."""
    if TERMINATION_LOG.exists():
        try:
            TERMINATION_LOG.write_text(message)
        except OSError:
            pass  # a read-only or foreign file: the log has the reason too


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
    """``snapshot_download`` of one model repository into the cache; returns the
    snapshot directory.

    Raises:
        DownloadError: with the reason (see module docstring).
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"hf://{repo_id}" + (f" (revision {revision})" if revision else "")
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    token_note = "with the token from HF_TOKEN" if os.environ.get("HF_TOKEN") else "without a token"
    try:
        return Path(snapshot_download(repo_id, revision=revision))
    except RevisionNotFoundError as exc:
        raise DownloadError(f"{where}: revision not found on {endpoint}") from exc
    except GatedRepoError as exc:
        raise DownloadError(
            f"{where}: gated repository; access was refused {token_note}"
        ) from exc
    except RepositoryNotFoundError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status == 401 and os.environ.get("HF_TOKEN"):
            raise DownloadError(
                f"{where}: the Hub at {endpoint} refused the token from HF_TOKEN (401)"
            ) from exc
        raise DownloadError(
            f"{where}: repository not found on {endpoint}, or private and not "
            f"accessible {token_note}"
        ) from exc
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403):
            raise DownloadError(
                f"{where}: the Hub at {endpoint} refused access {token_note} ({status})"
            ) from exc
        raise DownloadError(f"{where}: HTTP error from {endpoint}: {exc}") from exc
    except LocalEntryNotFoundError as exc:  # an OSError too: before the clause below
        raise DownloadError(f"{where}: cannot reach the Hub at {endpoint}: {exc}") from exc
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise DownloadError(
                f"{where}: no space left on device in the model cache "
                f"({os.environ.get('HF_HOME', 'HF_HOME')}); give spec.modelCache more room"
            ) from exc
        raise DownloadError(f"{where}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - any other failure still gets its reason out
        raise DownloadError(f"{where}: {type(exc).__name__}: {exc}") from exc


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
        message = str(exc)
        print(f"specula download: {message}", file=sys.stderr, flush=True)
        write_termination_message(message)
        return 1
