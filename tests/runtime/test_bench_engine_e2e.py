"""``bench/engine_e2e.py``'s workload pieces on a tiny CPU model: the k-sweep plan and the
``ngram_copies`` target, whose greedy output must follow the last token alone (else its
copy-heavy prompt's output does not repeat the prompt and the row measures nothing)."""

from __future__ import annotations

import pytest

from bench.engine_e2e import (
    TINY,
    TINY_DRAFT,
    make_engine,
    random_prompts,
    sweep_plan,
    write_checkpoints,
    zero_layer_outputs,
)
from specula.runtime.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.runtime


def test_sweep_plan_gives_a_method_its_own_k_values():
    plan = sweep_plan("eagle3:5+4,mtp,dflash:7", "6,4,4")
    assert plan == {"eagle3": [4, 5], "mtp": [4, 6], "dflash": [7]}


@pytest.mark.parametrize("methods", ["mtp:4+x", "mtp:", "mtp:0", "mtp:4,mtp:5"])
def test_sweep_plan_rejects_bad_k_values_and_repeated_methods(methods):
    with pytest.raises(ValueError, match="--sweep-methods"):
        sweep_plan(methods, "4")


def test_zeroed_layer_outputs_make_the_output_follow_the_last_token(tmp_path):
    dirs = write_checkpoints(tmp_path, TINY, TINY_DRAFT)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    a, b = random_prompts(2, TINY["vocab_size"], 24, seed=3)
    b[-1] = a[-1]  # different contexts, one last token
    engine = make_engine(dirs, None, 0, (1, 2), "cpu", None)  # (two: the CPU KV cache size)
    dense = engine.generate([a, b], params)
    assert dense[0] != dense[1]  # the random target reads the context
    zero_layer_outputs(engine)
    zeroed = engine.generate([a, b], params)
    assert zeroed[0] == zeroed[1]
