"""Triton kernels of the GPU engine, each with a thin launcher and a torch reference.

- :mod:`.paged_attention`: decode and (k + 1)-token verification attention over vLLM's
  paged KV layout, split-K for long contexts;
- :mod:`.reshape_and_cache`: writing new keys/values into the paged cache;
- :mod:`.layernorm`: RMSNorm, plain and fused with the residual add (Llama and Gemma);
- :mod:`.rotary`: rotary embedding in place, rotate-half layout, partial rotary;
- :mod:`.rejection_sampler`: greedy and random verification of draft tokens;
- :mod:`.draft_inputs`: the draft's next inputs from the verification result, on device.

Launchers assert on shapes, dtypes and layouts before launching. On a CUDA device they launch
the kernel; on any other device they run the kernel's torch reference, so the engine runs the
same code on a CPU (:mod:`.dispatch`). Triton's interpreter (``TRITON_INTERPRET=1`` set before
triton is imported) runs the kernels themselves on CPU tensors, for the kernels' own tests.
"""
