"""The GPU execution path of the target: paged KV blocks and tensors, the paged forward
over the Triton kernels, and CUDA graphs per batch shape.

- :mod:`.block_manager`: KV block allocation and per-request block tables (pure Python);
- :mod:`.paged_kv`: per-layer cache tensors and the attention metadata of a forward;
- :mod:`.model_runner`: the Llama / Qwen3 forward on the kernels, over the model
  classes' own parameters;
- :mod:`.cudagraph`: graphs captured per ``BatchExecutionDescriptor``, each with the
  ``CapturedAttentionState`` it reads.
"""
