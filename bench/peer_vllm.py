"""vLLM on the same GPU and workload as ``bench/engine_e2e.py``: the performance peer.

vLLM 0.26.0 (from the kit of ``../shared/peer/README.md``, on ``PYTHONPATH``) with its
defaults (Model Runner V2, CUDA graphs, prefix caching, 1024 sequences), a
Llama-3.1-8B-shaped target with random weights (``load_format="dummy"``), bfloat16,
``max_model_len`` 2048, no tokenizer (prompts are token ids). The workload and the
decode tokens/s are ``engine_e2e.py``'s: ``batch`` requests of 128 random tokens, 256
greedy tokens each (``ignore_eos``), one warm-up run then a timed one, decode tokens of
all requests over the window from the first request's first token to the last
request's last token, timestamps taken when ``LLMEngine.step`` returns them.

- ``target``: batch 1, 8, 32 and 128;
- ``eagle3``: a 1-layer EAGLE-3 head in the ``speculators`` format (draft vocabulary
  32000), k = 4, ``rejection_sample_method="synthetic"`` with unconditional rates
  ``0.8 ** i`` (a conditional 0.8 per position), batch 1 and 32.

Each configuration runs in its own process (``--config``; the driver starts them in
turn) so the GPU is free between them. Run on the GPU machine::

    PYTHONPATH=$PEER_SITE:. python3 bench/peer_vllm.py --output vllm.json

The JSON (``target_only``/``eagle3`` rows, startup seconds, versions) is what
``engine_e2e.py --peer`` reads to report ``vs_vllm``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench.engine_e2e import LLAMA_8B, random_prompts  # noqa: E402

K = 4
RATES = [0.8 ** (i + 1) for i in range(K)]


def write_dirs(root: Path) -> tuple[Path, Path]:
    target = root / "target"
    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps(LLAMA_8B))
    layer = {k: v for k, v in LLAMA_8B.items() if k not in ("architectures", "torch_dtype")}
    layer["num_hidden_layers"] = 1
    layer["architectures"] = ["LlamaForCausalLM"]
    n = LLAMA_8B["num_hidden_layers"]
    head = root / "eagle3"
    head.mkdir(parents=True, exist_ok=True)
    (head / "config.json").write_text(json.dumps({
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": 32000,
        "eagle_aux_hidden_state_layer_ids": [2, n // 2, n - 3],
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": K}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": str(target), "architectures": ["LlamaForCausalLM"]},
        },
    }))
    return target, head


def timed_run(engine, prompts: list[list[int]], max_tokens: int) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            detokenize=False)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    count: dict[str, int] = {}
    tag = f"t{time.perf_counter_ns()}"
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, params)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            n = len(out.outputs[0].token_ids)  # cumulative
            if n and n != count.get(out.request_id, 0):
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
                count[out.request_id] = n
    elapsed = time.perf_counter() - start
    decode = sum(n - 1 for n in count.values())
    return {
        "decode_tokens_per_s": round(decode / (max(last.values()) - min(first.values())), 1),
        "end_to_end_s": round(elapsed, 3),
    }


def run_config(name: str, root: Path) -> dict:
    import vllm
    from vllm import LLM

    target, head = write_dirs(root)
    kwargs = dict(
        model=str(target), load_format="dummy", dtype="bfloat16", max_model_len=2048,
        skip_tokenizer_init=True, gpu_memory_utilization=0.9,
    )
    batches = (1, 8, 32, 128)
    if name == "eagle3":
        kwargs["speculative_config"] = {
            "method": "eagle3", "model": str(head), "num_speculative_tokens": K,
            "rejection_sample_method": "synthetic", "synthetic_acceptance_rates": RATES,
        }
        batches = (1, 32)
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    startup = time.perf_counter() - t0
    engine = llm.llm_engine
    rows = {}
    for b in batches:
        prompts = random_prompts(b, LLAMA_8B["vocab_size"], 128, seed=b)
        timed_run(engine, prompts, 256)
        rows[f"bs{b}"] = timed_run(engine, prompts, 256)
        print(f"vllm {name} bs{b}: {rows[f'bs{b}']}", flush=True)
    return {"rows": rows, "startup_s": round(startup, 1), "vllm": vllm.__version__}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", choices=("target", "eagle3"), default=None)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.config is not None:
        result = run_config(args.config, Path(tempfile.mkdtemp()))
        args.output.write_text(json.dumps(result))
        return 0
    merged: dict = {}
    for name, key in (("target", "target_only"), ("eagle3", "eagle3")):
        part = args.output.with_suffix(f".{name}.json")
        proc = subprocess.run(
            [sys.executable, __file__, "--config", name, "--output", str(part)], check=False
        )
        if proc.returncode == 0 and part.is_file():
            result = json.loads(part.read_text())
            merged[key] = result["rows"]
            merged[f"{key}_startup_s"] = result["startup_s"]
            merged["version"] = result["vllm"]
        else:
            merged[f"{key}_error"] = f"exit status {proc.returncode}"
    args.output.write_text(json.dumps(merged, indent=1))
    print(json.dumps(merged, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
