"""A random target/assistant pair of Llamas whose greedy tokens agree at a controlled
rate, for ``transformers``' assisted generation in ``bench/engine_hf.py``.

- assistant ``A``: a Llama of the target's width and vocabulary with few layers, random
  weights;
- target ``T``: ``A``'s embeddings, first layers, final norm and ``lm_head`` (copied),
  followed by random layers whose output projections (``o_proj``, ``down_proj``) are
  scaled by ``eps`` (:func:`set_perturbation`). ``T``'s residual stream is ``A``'s plus
  a perturbation of size ``eps``, so ``eps`` sets how often ``T``'s greedy token is
  ``A``'s, and ``T`` costs exactly what any Llama of its shape costs (same GEMMs;
  values do not change speed).

Two adjustments keep the pair meaningful (:func:`build_controlled_pair`). The token
embeddings are scaled to the size of ``A``'s residual-stream update
(:data:`EMBEDDING_TO_UPDATE_RMS`): with the default initialisation the layers' outputs
dwarf the embeddings at the 8B width and greedy rollouts collapse into short loops,
where every position repeats the same agreement outcome. And the shared ``lm_head`` is
scaled (a temperature; no argmax changes) so that ``A``'s mean top-1 probability on
its own rollouts equals the target acceptance, as for a calibrated assistant:
``transformers``' default assisted generation stops a draft when that probability
falls below ``assistant_confidence_threshold`` (0.4), which with raw random logits
(top-1 probability ~1e-3) would end every draft after one token.

``eps`` is found at bench time, deterministic seeds (:func:`calibrate_perturbation`):
bisection on ``log eps`` of the teacher-forced agreement between ``T`` and ``A`` on
random-token contexts (the proxy: cheap, ~1000 positions per evaluation), then up to a
few rounds of batched greedy rollouts of ``T`` from random prompts (what assisted
generation emits): each round moves the proxy's target by the mean offset between
proxy and rollout agreement seen so far, and the round closest to the target wins. In
bf16, assisted generation's output leaves a plain rollout's within tens of tokens
(near-tied logits of random weights resolve differently in a (k+1)-token verification
than in a 1-token decode), so the agreement on its output is a fresh sample around the
calibrated rate, not the calibration rollouts' figure.
"""

from __future__ import annotations

import math
import time

EMBEDDING_TO_UPDATE_RMS = 1.0
"""RMS of the token embeddings over the RMS of the assistant's residual-stream update
(its layers' summed outputs) on the prompts. Measured on random Llama rollouts: at 0.25
(256 wide) greedy rollouts fall into loops of a few tokens within 50 (the context
average dominates the next token); at 4 and above the next token is a fixed function of
the last one, which cycles after about sqrt(vocab) tokens; between 0.5 and 2 rollouts of
256 tokens had (almost) no repeated token at widths 256 to 4096."""

CALIBRATION_PROMPTS = 8
"""Random-token prompts rolled out at once in calibration, and random-token sequences
(each ``prompt + new`` tokens long) of the proxy agreement: about 1000 positions each
for ``new = 128``, a binomial standard error near 0.013 at ``a = 0.8``."""

ROLLOUT_TOLERANCE = 0.01
"""A calibration rollout within this of the target agreement ends the calibration."""


def _seeded(device, seed: int):
    import torch

    return torch.Generator(device).manual_seed(seed)


def random_prompts(vocab_size: int, num: int, prompt_len: int, device):
    """``[num, prompt_len]`` uniformly random token ids, seeded (row ``i`` does not depend
    on ``num``)."""
    import torch

    return torch.cat(
        [
            torch.randint(
                0, vocab_size, (1, prompt_len), generator=_seeded(device, i), device=device
            )
            for i in range(num)
        ]
    )


def _random_llama(shape: dict, num_layers: int, dtype, device, seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**dict(shape, num_hidden_layers=num_layers)))
    return model.to(dtype).eval()


def _final_residual(model, input_ids):
    """The residual stream entering ``model``'s final norm: ``[batch, seq, hidden]``."""
    captured = []
    handle = model.model.norm.register_forward_hook(lambda m, args, out: captured.append(args[0]))
    try:
        model(input_ids)
    finally:
        handle.remove()
    return captured[0]


def greedy_generate(model, prompts, new_tokens: int, **gen):
    """Greedy ``generate`` of exactly ``new_tokens`` tokens after ``prompts``
    ``[batch, prompt_len]`` (no padding); returns ``[batch, prompt_len + new_tokens]``."""
    import torch

    return model.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        **gen,
    )


def greedy_agreement(assistant, sequences, prompt_len: int) -> tuple[float, float]:
    """Share of the positions after ``prompt_len`` in ``sequences`` (``[batch, seq]``)
    whose token is the assistant's greedy token given the tokens before it (teacher
    forcing), and the assistant's mean top-1 probability there. With the target's
    greedy output as ``sequences`` the first is the rate at which greedy assisted
    generation accepts a draft token whose prefix was accepted."""
    logits = assistant(sequences).logits[:, prompt_len - 1 : -1]  # [batch, new, vocab]
    agree = (logits.argmax(-1) == sequences[:, prompt_len:]).float().mean().item()
    top1 = logits.float().softmax(-1).amax(-1).mean().item()
    return agree, top1


def distinct_token_fraction(sequences, prompt_len: int) -> float:
    """The smallest share of distinct tokens among the rows' generated tokens (a greedy
    loop shows as a low value)."""
    new = sequences[:, prompt_len:]
    return round(min(len(set(row.tolist())) for row in new) / max(1, new.shape[1]), 4)


def solve_decreasing(fn, target: float, seen: dict, lo: float, hi: float, rel_tol=0.005):
    """``x`` in ``[lo, hi]`` whose ``fn(x)`` is closest to ``target``, for ``fn``
    (roughly) decreasing in ``x``, by bisection on ``log x`` down to ``hi / lo <= 1 +
    rel_tol``. ``seen`` (``x -> fn(x)``) keeps every evaluation; the search starts from
    the tightest bracket the earlier ones give."""
    lo = max([x for x, v in seen.items() if v > target], default=lo)
    hi = min([x for x, v in seen.items() if v <= target and x > lo], default=hi)
    while hi / lo > 1 + rel_tol:
        mid = math.sqrt(lo * hi)
        seen[mid] = fn(mid)
        if seen[mid] > target:
            lo = mid
        else:
            hi = mid
    return min((x for x in seen if lo <= x <= hi), key=lambda x: abs(seen[x] - target), default=lo)


def build_controlled_pair(
    shape: dict, assistant_layers: int, dtype, device, prompts, new_tokens: int, target_top1: float
):
    """The assistant ``A`` and target ``T`` described in the module docstring, with
    ``eps = 0`` (``T`` equals ``A``); see :func:`set_perturbation`.

    ``prompts`` ``[n, prompt_len]`` size the embeddings and calibrate the logit scale:
    ``A``'s greedy rollouts of ``new_tokens`` tokens from them, and the scale, by
    bisection, at which ``A``'s mean top-1 probability there is ``target_top1``.
    Returns ``(target, assistant, info)``. Raises ``ValueError`` if
    ``assistant_layers`` is not below the target's layer count."""
    import torch

    if not 0 < assistant_layers < shape["num_hidden_layers"]:
        raise ValueError(f"assistant_layers={assistant_layers} must be in (0, target layers)")
    assistant = _random_llama(shape, assistant_layers, dtype, device, seed=1)
    embed = assistant.model.embed_tokens.weight
    residual = _final_residual(assistant, prompts).float()
    embedded = assistant.model.embed_tokens(prompts).float()
    update_rms = (residual - embedded).pow(2).mean().sqrt().item()
    embed_scale = EMBEDDING_TO_UPDATE_RMS * update_rms / embedded.pow(2).mean().sqrt().item()
    with torch.no_grad():
        embed.mul_(embed_scale)
    prompt_len = prompts.shape[1]
    rollout = greedy_generate(assistant, prompts, new_tokens)
    logits = assistant(rollout).logits[:, prompt_len - 1 : -1].float()  # [n, new, vocab]

    def minus_mean_top1(scale: float) -> float:  # decreasing in the scale
        return -(logits * scale).softmax(-1).amax(-1).mean().item()

    seen: dict = {}
    logit_scale = solve_decreasing(minus_mean_top1, -target_top1, seen, 1e-2, 1e3)
    with torch.no_grad():
        assistant.lm_head.weight.mul_(logit_scale)

    target = _random_llama(shape, shape["num_hidden_layers"], dtype, device, seed=2)
    with torch.no_grad():
        target.model.embed_tokens.weight.copy_(embed)
        target.model.norm.weight.copy_(assistant.model.norm.weight)
        target.lm_head.weight.copy_(assistant.lm_head.weight)
        for mine, theirs in zip(target.model.layers, assistant.model.layers, strict=False):
            mine.load_state_dict(theirs.state_dict())
    set_perturbation(target, assistant_layers, 0.0)
    info = {
        "embedding_scale": round(embed_scale, 4),
        "logit_scale": round(logit_scale, 4),
        "assistant_mean_top1_prob": round(-seen[logit_scale], 4),
        "assistant_rollout_distinct_token_fraction": distinct_token_fraction(rollout, prompt_len),
    }
    return target, assistant, info


def set_perturbation(target, first_layer: int, eps: float, seed: int = 3) -> None:
    """Redraw ``o_proj`` and ``down_proj`` of ``target``'s layers from ``first_layer`` on
    as ``eps`` times N(0, initializer_range^2), from per-layer seeded generators: the same
    perturbation direction for every ``eps``, one rounding to the weights' dtype."""
    import torch

    std = target.config.initializer_range * eps
    device = target.device
    with torch.no_grad():
        for i, layer in enumerate(target.model.layers[first_layer:]):
            gen = _seeded(device, seed * 1000 + i)
            for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                w = proj.weight
                w.copy_(torch.randn(w.shape, generator=gen, device=device) * std)


def calibrate_perturbation(
    target, assistant, first_layer: int, prompts, new_tokens: int, acceptance: float, rollouts: int
) -> dict:
    """Set ``eps`` (:func:`set_perturbation`) so that ``assistant`` agrees with
    ``target``'s greedy rollouts of ``new_tokens`` tokens from ``prompts``
    (``[n, prompt_len]``) on about ``acceptance`` of the positions (module docstring).
    Returns the calibration record: ``eps``, each round's proxy and rollout agreement,
    seconds. Raises ``RuntimeError`` if eps in [1e-4, 1e2] cannot reach ``acceptance``."""
    import torch

    t0 = time.perf_counter()
    prompt_len = prompts.shape[1]
    contexts = torch.randint(
        0,
        target.config.vocab_size,
        (CALIBRATION_PROMPTS, prompt_len + new_tokens),
        generator=_seeded(target.device, 1000),
        device=target.device,
    )
    assistant_argmax = assistant(contexts).logits[:, prompt_len - 1 : -1].argmax(-1)

    def proxy(eps: float) -> float:
        set_perturbation(target, first_layer, eps)
        target_argmax = target(contexts).logits[:, prompt_len - 1 : -1].argmax(-1)
        return (target_argmax == assistant_argmax).float().mean().item()

    lo, hi = 1e-4, 1e2
    seen = {lo: proxy(lo), hi: proxy(hi)}
    if not seen[lo] > acceptance > seen[hi]:
        raise RuntimeError(f"proxy agreement {seen} does not bracket {acceptance}")
    record: dict = {"proxy_positions": assistant_argmax.numel(), "rounds": []}
    proxy_target, offsets = acceptance, []
    best = (math.inf, lo)
    for _ in range(max(1, rollouts)):
        eps = solve_decreasing(proxy, proxy_target, seen, lo, hi)
        set_perturbation(target, first_layer, eps)
        rollout = greedy_generate(target, prompts, new_tokens)
        agree, _ = greedy_agreement(assistant, rollout, prompt_len)
        record["rounds"].append(
            {
                "eps": eps,
                "proxy_target": round(proxy_target, 4),
                "proxy_agreement": round(seen[eps], 4),
                "rollout_agreement": round(agree, 4),
                "rollout_positions": rollout[:, prompt_len:].numel(),
                "rollout_distinct_token_fraction": distinct_token_fraction(rollout, prompt_len),
            }
        )
        best = min(best, (abs(agree - acceptance), eps))
        if abs(agree - acceptance) <= ROLLOUT_TOLERANCE:
            break
        # The proxy reads random contexts, the rollouts the target's own output: aim the
        # proxy where the rollouts would land on ``acceptance``, taking the offset
        # between them as constant and estimating it by the mean over the rounds (each
        # round's rollouts are a fresh sample).
        offsets.append(seen[eps] - agree)
        proxy_target = min(max(acceptance + sum(offsets) / len(offsets), 0.01), 0.99)
    record["eps"] = best[1]
    record["proxy_evaluations"] = len(seen)
    set_perturbation(target, first_layer, best[1])
    record["seconds"] = round(time.perf_counter() - t0, 1)
    return record
