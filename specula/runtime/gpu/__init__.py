"""The GPU execution path of the target: paged KV blocks and tensors, the paged forward
over the Triton kernels, and CUDA graphs per batch shape.

- :mod:`.block_manager`: KV block allocation and per-request block tables (pure Python);
- :mod:`.paged_kv`: per-layer cache tensors and the attention metadata of a forward;
- :mod:`.model_runner`: the Llama / Qwen3 forward on the kernels, over the model
  classes' own parameters;
- :mod:`.cudagraph`: graphs captured per ``BatchExecutionDescriptor``, each with the
  ``CapturedAttentionState`` it reads;
- :mod:`.eagle3_runner`: the EAGLE-3 head's forward on the kernels;
- :mod:`.draft_graphs`: the draft's prefill (reusing the verification's attention
  state) and decode steps, eager and in CUDA graphs;
- :mod:`.spec_decode`: the speculative step (verify, reject, roll back, draft) of one
  static batch, for benchmarks;
- :mod:`.per_layer_kv`, :mod:`.gemma4_runner`, :mod:`.gemma4_mtp`: Gemma4 (per-layer KV
  shapes, sliding windows, KV-shared layers) and its MTP drafter reading the target's KV;
- :mod:`.scheduler`: continuous batching over the block manager (admission, preemption);
- :mod:`.engine`: the GPU engine that ``specula serve`` runs on a CUDA device.
"""
