"""KV-cache memory that Gemma4's ``num_kv_shared_layers`` saves, for Gemma 4 E2B.

The figures come from the runtime's own accounting (the paged KV cache's
:class:`specula.runtime.worker.paged_kv.KVCacheSpec`, built from the
``kv_cache_shapes()`` of the layers that own KV storage: bytes per token =
``bytes_per_block / block_size``) applied to Gemma 4 E2B's text config, once as
published and once with sharing turned off. No weights are needed.

Usage::

    .venv/bin/python bench/gemma4_kv.py [--out bench/results/gemma4_kv.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import platform
import sys
from pathlib import Path

import torch

from specula.runtime.models.config import ModelConfig
from specula.runtime.worker.paged_kv import KVCacheSpec

GEMMA4_E2B_TEXT = dict(
    vocab_size=262144,
    hidden_size=1536,
    intermediate_size=6144,
    num_hidden_layers=35,
    layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7,
    num_attention_heads=8,
    num_key_value_heads=1,
    head_dim=256,
    global_head_dim=512,
    attention_k_eq_v=False,
    sliding_window=512,
    num_kv_shared_layers=20,
    hidden_size_per_layer_input=256,
    vocab_size_per_layer_input=262144,
    use_double_wide_mlp=True,
    max_position_embeddings=131072,
    final_logit_softcapping=30.0,
)
"""``text_config`` of google/gemma-4-E2B's ``config.json`` (the fields that shape the
model; rope parameters are ``transformers``' Gemma4 defaults, as published)."""

BLOCK_SIZE = 16
"""KV tokens per block (the engine's default); bytes per token do not depend on it."""

CONTEXTS = (4096, 32768, 131072)
"""Context lengths (tokens per sequence) to report whole-sequence KV sizes for."""


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """KV-cache bytes one token takes over every layer that owns storage, keys and
    values, as the engine's paged cache allocates them."""
    spec = KVCacheSpec.from_model_config(config, dtype, block_size=BLOCK_SIZE)
    return spec.bytes_per_block // BLOCK_SIZE  # exact: a block is BLOCK_SIZE tokens


def kv_report() -> dict:
    """Per-token and per-sequence KV bytes (bf16) with and without sharing."""
    from transformers import Gemma4TextConfig

    config = ModelConfig.from_hf_config(Gemma4TextConfig(**GEMMA4_E2B_TEXT))
    unshared = dataclasses.replace(config, num_kv_shared_layers=0)
    shared_bytes = kv_bytes_per_token(config, torch.bfloat16)
    unshared_bytes = kv_bytes_per_token(unshared, torch.bfloat16)
    producers = config.kv_producer_layers()
    return {
        "model": "google/gemma-4-E2B (text_config)",
        "dtype": "bfloat16",
        "num_hidden_layers": config.num_hidden_layers,
        "num_kv_shared_layers": config.num_kv_shared_layers,
        "layers_with_kv": len(config.kv_cache_shapes()),
        "kv_shape_per_layer_type": {
            t: {"num_kv_heads": config.layer_num_kv_heads[i], "head_dim": config.layer_head_dims[i]}
            for t, i in producers.items()
        },
        "shared_layers_read": producers,
        "bytes_per_token_without_sharing": unshared_bytes,
        "bytes_per_token_with_sharing": shared_bytes,
        "bytes_per_token_saved": unshared_bytes - shared_bytes,
        "fraction_saved": round(1 - shared_bytes / unshared_bytes, 4),
        "mib_per_sequence": {
            str(n): {
                "without_sharing": round(n * unshared_bytes / 2**20, 1),
                "with_sharing": round(n * shared_bytes / 2**20, 1),
            }
            for n in CONTEXTS
        },
        "note": "full-length cache for every layer that owns KV (sliding layers are not "
        "truncated to their window)",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/gemma4_kv.json"))
    args = parser.parse_args()
    result = {
        "command": " ".join([".venv/bin/python bench/gemma4_kv.py", *sys.argv[1:]]),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "hardware": {"python": platform.python_version(), "platform": platform.platform()},
        **kv_report(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
