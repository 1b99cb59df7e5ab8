"""The target's execution: paged KV tensors and attention metadata, the paged forward of
each target family on the kernels, and CUDA graphs per batch shape.

- :mod:`.paged_kv`: per-layer cache tensors and the attention metadata of a forward;
- :mod:`.model_runner`: the Llama / Qwen3 forward, over the model classes' parameters;
- :mod:`.gemma4_runner`: Gemma4 (per-layer KV shapes, sliding windows, KV-shared layers);
- :mod:`.cudagraph`: graphs captured per ``BatchExecutionDescriptor``, each with the
  ``CapturedAttentionState`` it reads.
"""

from __future__ import annotations

from torch import nn

from specula.runtime.worker.paged_kv import PagedKVCache


def create_model_runner(model: nn.Module, kv_cache: PagedKVCache, max_model_len: int):
    """The paged runner of ``model``'s family: :class:`~.gemma4_runner.Gemma4Runner` for
    Gemma4, :class:`~.model_runner.ModelRunner` for Llama and Qwen3.

    Raises:
        ValueError: a model no runner serves (the mixture-of-experts Gemma4 included),
            or a cache that does not match it.
    """
    from specula.runtime.models.gemma4 import Gemma4ForCausalLM
    from specula.runtime.worker.gemma4_runner import Gemma4Runner
    from specula.runtime.worker.model_runner import ModelRunner

    runner = Gemma4Runner if isinstance(model, Gemma4ForCausalLM) else ModelRunner
    return runner(model, kv_cache, max_model_len)
