"""Exact-distribution checks of sampled outputs: the joint probability of a target's
first tokens under temperature and top-k (by enumeration with ``transformers``), and
Pearson's chi-square test of samples against it. Shared by the CPU and GPU tiers
(``pythonpath`` in the pytest configuration puts this directory on ``sys.path``)."""

from __future__ import annotations

import torch


def exact_joint_probs(
    hf, prompt: list[int], temperature: float, top_k: int, length: int
) -> dict[tuple[int, ...], float]:
    """P(first ``length`` tokens) under ``hf`` after ``prompt``, with temperature and
    top-k applied, by enumerating the top-k tree (``top_k ** length`` forwards)."""
    joint = {(): 1.0}
    for _ in range(length):
        nxt = {}
        for prefix, mass in joint.items():
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + list(prefix)])).logits[0, -1].double()
            values, index = logits.topk(top_k)
            probs = torch.zeros_like(logits)
            probs[index] = torch.softmax(values / temperature, dim=-1)
            for tok in probs.nonzero().flatten().tolist():
                nxt[prefix + (tok,)] = mass * probs[tok].item()
        joint = nxt
    return joint


def target_distribution_pvalue(outputs: list[list[int]], joint: dict) -> float:
    """Chi-square p-value of generated ``outputs`` against the exact ``joint`` of
    :func:`exact_joint_probs`; fails if an output has zero probability there."""
    cells = sorted(joint)
    index = {c: i for i, c in enumerate(cells)}
    counts = torch.zeros(len(cells))
    for out in outputs:
        assert tuple(out) in index, f"{out} has zero probability under the target"
        counts[index[tuple(out)]] += 1
    probs = torch.tensor([joint[c] for c in cells])
    assert abs(probs.sum().item() - 1.0) < 1e-6
    return chi_square_pvalue(counts, probs)


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness-of-fit p-value of ``counts [n]`` against ``probs [n]``.

    Cells with expected count below 5 are pooled into one (the usual validity rule);
    the p-value is the regularised upper incomplete gamma ``Q(df/2, x/2)``.
    """
    counts = counts.double().flatten()
    expected = probs.double().flatten() * counts.sum()
    assert torch.all(counts[expected == 0] == 0), "samples where the target has no mass"
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    assert df >= 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2.0))
