"""Every kernel compiles for Hopper (sm_90) at Llama-3.1-8B constants, without a GPU; the
per-layer ones in the variant launched with programmatic dependent launch (``PDL``).

The interpreter runs kernels as Python, so it accepts programs the compiler rejects (a
variable whose type differs between the branches of a runtime ``if``, a loop-carried
value that changes type, ...). Compiling to PTX and through the ``ptxas`` shipped with
triton catches those on a CPU-only machine. Runs in this process, where the kernels are
ordinary ``@triton.jit`` functions.
"""

from __future__ import annotations

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from specula.runtime.kernels import (
    all_reduce,
    draft_inputs,
    gemv,
    layernorm,
    paged_attention,
    rotary,
)
from specula.runtime.kernels import rejection_sampler as rs
from specula.runtime.kernels import reshape_and_cache as rc

pytestmark = pytest.mark.runtime

HOPPER = GPUTarget("cuda", 90, 32)


def _gemv(**constexprs):
    """A GEMV case: its pointer and float types, and the constexprs of a 16-row tile with
    no epilogue unless ``constexprs`` asks for one."""
    types = {"y_ptr": "*bf16", "x_ptr": "*bf16", "w_ptr": "*bf16", "part_max_ptr": "*fp32",
             "part_idx_ptr": "*i32", "res_ptr": "*bf16", "rms_ptr": "*fp32",
             "split_ptr": "*fp32", "count_ptr": "*i32", "next_ptr": "*bf16",
             "aux_ptr": "*fp32", "up_offset": "i64", "eps": "fp32"}
    flags = dict(BLOCK_M=16, EVEN=True, SILU_MUL=False, ARGMAX=False, RESIDUAL=False,
                 SQUARES=False, RMS=False, BLOCK_P=1, SPLIT_K=1, PDL=True, PREFETCH=False,
                 SCREEN=False)
    return gemv._gemv_kernel, types, flags | constexprs


def _paged(**constexprs):
    """A paged-attention case: bfloat16 tensors, 16-slot blocks, a 16-row tile."""
    types = {"out_ptr": "*bf16", "partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32",
             "query_ptr": "*bf16", "key_cache_ptr": "*bf16",
             "value_cache_ptr": "*bf16", "block_table_ptr": "*i32", "seq_lens_ptr": "*i32",
             "key_ptr": "*bf16", "value_ptr": "*bf16", "positions_ptr": "*i64",
             "slot_mapping_ptr": "*i64", "cos_sin_ptr": "*fp32", "scale_log2": "fp32"}
    flags = dict(BLOCK_SIZE=16, BLOCK_M=16, INPUT_PRECISION="tf32", SLIDING=False,
                 NEW_KV=False, PDL=True, PACK=1)
    return paged_attention._paged_attention_kernel, types, flags | constexprs


# kernel, pointer/float argument types (other runtime arguments are i32), constexprs
CASES = {
    "paged_attention_split": _paged(GROUP_SIZE=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_N=64,
                                    NUM_SPLITS=4),
    # Decode with rotary and the cache write in the kernel, split or not.
    "paged_attention_new_kv_split": _paged(GROUP_SIZE=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_N=64,
                                           NUM_SPLITS=3, NEW_KV=True),
    # Batch-128 decode: two KV heads a program, 16-key tiles.
    "paged_attention_packed": _paged(GROUP_SIZE=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_N=16,
                                     NUM_SPLITS=1, PACK=2),
    "paged_attention_packed_1b": _paged(GROUP_SIZE=4, HEAD_DIM=64, BLOCK_D=64, BLOCK_N=16,
                                        NUM_SPLITS=1, PACK=2),
    "paged_attention_new_kv": _paged(GROUP_SIZE=4, HEAD_DIM=64, BLOCK_D=64, BLOCK_N=64,
                                     NUM_SPLITS=1, NEW_KV=True),
    # Gemma4's sliding layers: 256-wide heads, a window, 32-key tiles.
    "paged_attention_sliding": _paged(GROUP_SIZE=8, HEAD_DIM=256, BLOCK_D=256, BLOCK_N=32,
                                      NUM_SPLITS=2, SLIDING=True),
    "merge_splits": (
        paged_attention._merge_splits_kernel,
        {"out_ptr": "*bf16", "partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32"},
        dict(HEAD_DIM=128, BLOCK_D=128, NUM_SPLITS=5, BLOCK_S=8, PDL=True),
    ),
    # The GEMV's epilogues at Llama-3.1-8B's gate_up_proj (with the 1/rms scale of a folded
    # norm), o_proj/down_proj (the residual add before a folded norm) and LM head
    # (bench/gemv.py configs).
    "gemv_silu_mul": _gemv(BLOCK_N=64, BLOCK_K=256, SILU_MUL=True, RMS=True, BLOCK_P=64),
    "gemv_residual": _gemv(BLOCK_N=32, BLOCK_K=256, RESIDUAL=True, SQUARES=True),
    "gemv_squares": _gemv(BLOCK_N=32, BLOCK_K=512, SQUARES=True),  # MTP's eh_proj
    # The next projection's weights asked of L2 after the loop (any epilogue).
    "gemv_prefetch": _gemv(BLOCK_N=32, BLOCK_K=256, RESIDUAL=True, SQUARES=True, PREFETCH=True),
    "gemv_split_k": _gemv(BLOCK_N=16, BLOCK_K=256, RESIDUAL=True, SQUARES=True, SPLIT_K=4),
    "gemv_split_k_silu_mul": _gemv(BLOCK_N=32, BLOCK_K=128, SILU_MUL=True, RMS=True, BLOCK_P=64,
                                   SPLIT_K=2),
    "gemv_argmax": _gemv(BLOCK_N=64, BLOCK_K=512, EVEN=False, ARGMAX=True),
    "argmax_first_pass": (
        gemv._argmax_kernel,
        {"max_ptr": "*fp32", "idx_ptr": "*i32", "x_ptr": "*bf16", "x_idx_ptr": "*bf16"},
        dict(BLOCK=4096, HAS_IDX=False),
    ),
    "argmax_merge": (
        gemv._argmax_kernel,
        {"max_ptr": "*fp32", "idx_ptr": "*i64", "x_ptr": "*fp32", "x_idx_ptr": "*i32"},
        dict(BLOCK=2048, HAS_IDX=True),
    ),
    "reshape_and_cache": (
        rc._reshape_and_cache_kernel,
        {"key_ptr": "*bf16", "value_ptr": "*bf16", "key_cache_ptr": "*bf16",
         "value_cache_ptr": "*bf16", "slot_mapping_ptr": "*i64"},
        dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_H=8, BLOCK_D=128),
    ),
    "fused_add_rms_norm_gemma": (
        layernorm._rms_norm_kernel,
        {"out_ptr": "*bf16", "residual_out_ptr": "*bf16", "x_ptr": "*bf16",
         "residual_ptr": "*bf16", "weight_ptr": "*bf16", "ids_ptr": "*i64", "eps": "fp32",
         "x2_ptr": "*bf16", "weight2_ptr": "*bf16", "eps2": "fp32"},
        dict(HIDDEN=4096, BLOCK=4096, HAS_RESIDUAL=True, GEMMA=True, GATHER=False, PAIR=False,
             PDL=True),
    ),
    "rotary": (
        rotary._rotary_kernel,
        {"positions_ptr": "*i64", "query_ptr": "*bf16", "key_ptr": "*bf16",
         "cos_sin_ptr": "*fp32"},
        dict(NUM_HEADS=32, NUM_KV_HEADS=8, HALF=64, BLOCK_SIZE=1, BLOCK_HALF=64, BLOCK_H=32,
             BLOCK_KH=8, HAS_KEY=True, WRITE_CACHE=False, PDL=True),
    ),
    "rejection_sample_random": (
        rs._rejection_sample_kernel,
        {"output_ptr": "*i64", "num_accepted_ptr": "*i64", "draft_token_ids_ptr": "*i64",
         "cu_num_draft_tokens_ptr": "*i32", "target_argmax_ptr": "*i64",
         "is_greedy_ptr": "*i1", "draft_probs_ptr": "*fp32", "target_probs_ptr": "*fp32",
         "uniform_ptr": "*fp32", "noise_ptr": "*fp32", "rate": "fp32"},
        dict(MAX_SPEC_LEN=4, BLOCK_K=8, BLOCK_V=2048, ALL_GREEDY=False, NO_DRAFT_PROBS=False,
             PLACEHOLDER=-1, SYNTHETIC=False),
    ),
    "prepare_draft_inputs": (
        draft_inputs._prepare_draft_inputs_kernel,
        {"draft_input_ids_ptr": "*i64", "draft_positions_ptr": "*i64",
         "last_token_indices_ptr": "*i64", "input_ids_ptr": "*i64", "positions_ptr": "*i64",
         "query_start_loc_ptr": "*i32", "cu_num_draft_tokens_ptr": "*i32",
         "num_accepted_ptr": "*i64", "next_token_ids_ptr": "*i64"},
        dict(BLOCK=128),
    ),
    "draft_step_slots": (
        draft_inputs._draft_step_slots_kernel,
        {"slots_ptr": "*i64", "seq_lens_ptr": "*i32", "positions_out_ptr": "*i64",
         "positions_ptr": "*i64", "valid_ptr": "*u8", "block_table_ptr": "*i32"},
        dict(BLOCK_SIZE=16, BLOCK_Q=2, WRITES_KV=True, HAS_VALID=True),
    ),
    "draft_steps": (
        draft_inputs._draft_step_slots_kernel,
        {"slots_ptr": "*i64", "seq_lens_ptr": "*i32", "positions_out_ptr": "*i64",
         "positions_ptr": "*i64", "valid_ptr": "*i64", "block_table_ptr": "*i32"},
        dict(BLOCK_SIZE=16, BLOCK_Q=1, WRITES_KV=True, HAS_VALID=False),
    ),
    "draft_steps_target_kv": (
        draft_inputs._draft_step_slots_kernel,
        {"slots_ptr": "*i64", "seq_lens_ptr": "*i32", "positions_out_ptr": "*i64",
         "positions_ptr": "*i64", "valid_ptr": "*i64", "block_table_ptr": "*i32"},
        dict(BLOCK_SIZE=16, BLOCK_Q=1, WRITES_KV=False, HAS_VALID=False),
    ),
    # Tensor parallelism's fused sum at Llama-3.1-8B's hidden size over two ranks.
    "all_reduce_add_rms_norm": (
        all_reduce._all_reduce_add_rms_norm_kernel,
        {"out_ptr": "*bf16", "residual_out_ptr": "*bf16", "x_ptr": "*bf16",
         "residual_ptr": "*bf16", "weight_ptr": "*bf16", "buffers_ptr": "*i64",
         "launches_ptr": "*i32", "eps": "fp32"},
        dict(HIDDEN=4096, BLOCK=4096, WORLD=2, TIMEOUT_NS=300 * 10**9, PDL=True,
             HAS_RESIDUAL=True),
    ),
}
# An embedding's rows gathered and normed beside a second input (MTP, EAGLE-3); synthetic
# acceptance (benchmarks).
CASES["rms_norm_gather_pair"] = (*CASES["fused_add_rms_norm_gemma"][:2], {
    **CASES["fused_add_rms_norm_gemma"][2], "HAS_RESIDUAL": False, "GEMMA": False, "GATHER": True,
    "PAIR": True})
CASES["rejection_sample_synthetic"] = (*CASES["rejection_sample_random"][:2], {
    **CASES["rejection_sample_random"][2], "ALL_GREEDY": True, "SYNTHETIC": True})
# The greedy draft head's int8 screen, then the rescoring of its candidates.
CASES["gemv_screen"] = (gemv._gemv_kernel, {**CASES["gemv_argmax"][1], "w_ptr": "*i8", "y_ptr": "*fp32",
                                             "part_idx_ptr": "*fp32"},
                        {**CASES["gemv_argmax"][2], "BLOCK_N": 128, "BLOCK_K": 256, "SCREEN": True,
                         "ARGMAX": True})
CASES["screen_rescore"] = (gemv._rescore_kernel, {
    "best_ptr": "*fp32", "idx_ptr": "*i32", "x_ptr": "*bf16", "w_ptr": "*bf16", "centre_ptr": "*fp32",
    "top_ptr": "*fp32", "top_bound_ptr": "*fp32", "aux_ptr": "*fp32"},
    dict(BLOCK_C=1024, BLOCK_K=2048, BLOCK_P=1024, PDL=True))
# What a step keeps of its verification (accepted and verified counts, next tokens).
CASES["accepted_tokens"] = (rs._accepted_tokens_kernel, dict.fromkeys(
    ("staged_ptr", "next_ptr", "committed_ptr", "output_ptr", "raw_ptr", "num_draft_ptr",
     "idx_ptr", "keys_ptr"), "*i64"), dict(HAS_RAW=True, BLOCK_W=8))
CASES["accepted_tokens_target_only"] = (*CASES["accepted_tokens"][:2], dict(HAS_RAW=False, BLOCK_W=1))
# The same without a residual: an embedding's rows summed in layer 0's norm.
CASES["all_reduce_rms_norm"] = (*CASES["all_reduce_add_rms_norm"][:2],
                                {**CASES["all_reduce_add_rms_norm"][2], "HAS_RESIDUAL": False})


NUM_WARPS = {"rejection_sample_random": 8, "fused_add_rms_norm_gemma": 8,
             "all_reduce_add_rms_norm": 8, "all_reduce_rms_norm": 8}


@pytest.mark.parametrize("name", list(CASES))
def test_compiles_for_sm90(name):
    kernel, types, constexprs = CASES[name]
    if not isinstance(kernel, triton.runtime.JITFunction):
        pytest.skip("TRITON_INTERPRET is set in this process: nothing to compile")
    signature = {
        arg: "constexpr" if arg in constexprs else types.get(arg, "i32")
        for arg in kernel.arg_names
    }
    compiled = triton.compile(
        ASTSource(kernel, signature, constexprs), target=HOPPER, options={"num_warps": NUM_WARPS.get(name, 4), "enable_fp_fusion": True}
    )
    assert f".entry {kernel.fn.__name__}" in compiled.asm["ptx"]
    # The variant launched with programmatic dependent launch waits for its predecessor.
    assert ("griddepcontrol.wait" in compiled.asm["ptx"]) == constexprs.get("PDL", False)
    assert ("prefetch.global.L2" in compiled.asm["ptx"]) == constexprs.get("PREFETCH", False)
    assert compiled.asm["cubin"], "ptxas produced no binary"


def test_the_fused_all_reduce_polls_and_vectorises_its_peer_accesses():
    """The peers' rows are awaited with volatile loads (so every poll reaches memory) and
    there is no fence or flag; the rows to and from the peers' buffers, and the free mark
    (two bfloat16 ``-0.0`` a word, 0x80008000), move in 16-byte vectors (the pointers
    built from integer addresses carry the alignment hint), not 2-byte scalars; a peer
    silent past the timeout traps. Pointers and strides are marked 16-divisible, as a
    launch specialises them."""
    kernel, types, constexprs = CASES["all_reduce_add_rms_norm"]
    if not isinstance(kernel, triton.runtime.JITFunction):
        pytest.skip("TRITON_INTERPRET is set in this process: nothing to compile")
    signature = {arg: "constexpr" if arg in constexprs else types.get(arg, "i32")
                 for arg in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(kernel.arg_names)
             if signature[arg].startswith("*") or arg.startswith("stride")}
    ptx = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=HOPPER,
                         options={"num_warps": 8}).asm["ptx"]
    assert "ld.volatile.global.v4.b32" in ptx and "%globaltimer" in ptx and "trap;" in ptx
    assert "membar" not in ptx and "fence" not in ptx and ".release" not in ptx
    assert f"{-2147450880}" in ptx or "0x80008000" in ptx.lower()
    assert "st.global.b16" not in ptx and "ld.global.b16" not in ptx
    assert "st.global.v4.b32" in ptx and "ld.global.v4.b32" in ptx
