"""The local directory of a checkpoint URI (the schemes of
:data:`specula.api.runtime_config.MODEL_URI_PATTERN`), holding a Hugging Face-layout
checkpoint: ``config.json``, ``*.safetensors``, tokenizer files."""

from __future__ import annotations

from pathlib import Path

from specula.api.runtime_config import PVC_MOUNT_ROOT


def resolve_model_uri(uri: str, revision: str | None = None) -> Path:
    """The local checkpoint directory that ``uri`` names.

    - ``file:///abs/path`` (or ``file://rel/path``) -> that path;
    - ``pvc://claim/sub/path`` -> ``{PVC_MOUNT_ROOT}/claim/sub/path``, where the operator
      mounts the claim;
    - ``hf://org/name`` -> that Hub repository's snapshot (``revision``: a branch, tag or
      commit) in the local Hugging Face cache; nothing is downloaded here.

    Raises:
        ValueError: the URI has no supported scheme or an empty path.
        FileNotFoundError: the directory does not exist, or the Hub repository is not
            in the local cache.
    """
    scheme, _, rest = uri.partition("://")
    if scheme not in ("file", "pvc", "hf") or not rest.strip("/"):
        raise ValueError(f"unsupported model URI {uri!r}: expected file://, pvc:// or hf://")
    if scheme == "file":
        path = Path(rest)
    elif scheme == "pvc":
        path = Path(PVC_MOUNT_ROOT) / rest.lstrip("/")
    else:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        repo_id = rest.strip("/")
        try:
            path = Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
        except LocalEntryNotFoundError as exc:
            raise FileNotFoundError(f"hf://{repo_id} (revision {revision or 'main'}) is not in "
                                    "the local Hugging Face cache; populate the cache (HF_HOME) "
                                    "or use a file:// or pvc:// URI") from exc
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(path)!r} for {uri!r} does not exist")
    return path
