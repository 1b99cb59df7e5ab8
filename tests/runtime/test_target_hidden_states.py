"""What the engine hands a speculator each step (``BaseSpeculator.propose`` with
:class:`ProposeInputs`): the target forward's rows, of which the *committed* ones (a
prefill's prompt rows; a running request's last-token row and its accepted drafts' rows)
carry the final hidden state and the auxiliary residual streams that ``transformers``
computes on the request's final sequence; every position of that sequence (but the last
token) is committed in some step; ``next_token_ids``/``next_positions`` are the token
sampled last and its position."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from specula.api.capabilities import IMPLEMENTED_METHODS
from specula.runtime.engine.llm_engine import SamplingParams
from specula.runtime.engine.request import Request
from specula.runtime.spec_decode import registry
from specula.runtime.spec_decode.base import DraftOutput, ProposeInputs
from specula.runtime.spec_decode.draft_model import PlainDraftModelSpeculator

pytestmark = pytest.mark.runtime

PROMPTS = [[5, 9, 14], [3, 8, 21, 30, 7, 2], [11, 4]]
MAX_TOKENS = [6, 10, 8]
AUX_IDS = (0, 1, 2, 3)
"""Every auxiliary id of the 3-layer target: the embeddings, the inputs of layers 1 and
2, and (``num_hidden_layers``) the last layer's output before the final norm."""


@dataclass
class Proposal:
    """One ``propose`` call, copied (the engine reuses its buffers)."""

    requests: list[Request]
    num_decode: int
    input_ids: list[int]
    positions: list[int]
    query_start_loc: list[int]
    hidden_states: torch.Tensor
    aux_hidden_states: torch.Tensor
    cu_num_draft_tokens: list[int]
    num_accepted: list[int]
    next_token_ids: list[int]
    next_positions: list[int]


class RecordingSpeculator(PlainDraftModelSpeculator):
    """The plain draft model, recording every ``propose`` call's inputs."""

    aux_hidden_state_layers = AUX_IDS

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.proposals: list[Proposal] = []

    def propose(self, inputs: ProposeInputs) -> DraftOutput | None:
        assert inputs.aux_hidden_states is not None
        self.proposals.append(
            Proposal(
                requests=[inputs.input_batch._requests[r] for r in inputs.idx_mapping.tolist()],
                num_decode=inputs.num_decode,
                input_ids=inputs.input_ids.tolist(),
                positions=inputs.positions.tolist(),
                query_start_loc=inputs.metadata.query_start_loc.tolist(),
                hidden_states=inputs.hidden_states.clone(),
                aux_hidden_states=inputs.aux_hidden_states.clone(),
                cu_num_draft_tokens=inputs.cu_num_draft_tokens.tolist(),
                num_accepted=inputs.num_accepted.tolist(),
                next_token_ids=inputs.next_token_ids.tolist(),
                next_positions=inputs.next_positions.tolist(),
            )
        )
        return super().propose(inputs)


@pytest.fixture
def recording(monkeypatch):
    made: list[RecordingSpeculator] = []

    def factory(ctx: registry.SpeculatorContext) -> RecordingSpeculator:
        spec = RecordingSpeculator(**registry.draft_kwargs(ctx))
        made.append(spec)
        return spec

    monkeypatch.setitem(registry.SPECULATOR_FACTORIES, "draft_model", factory)
    return made


def _hf_states(hf, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``transformers``' final hidden states ``[len, H]`` and residual streams of
    :data:`AUX_IDS` ``[len, 4H]`` on ``tokens`` (id ``num_hidden_layers``: the input of
    the final norm; ``hidden_states[-1]`` is after it)."""
    pre_norm: list[torch.Tensor] = []
    hook = hf.model.norm.register_forward_hook(lambda mod, inp, out: pre_norm.append(inp[0][0]))
    try:
        with torch.no_grad():
            out = hf.model(torch.tensor([tokens]), output_hidden_states=True)
    finally:
        hook.remove()
    states = [s[0] for s in out.hidden_states[:-1]] + pre_norm
    return out.last_hidden_state[0], torch.cat([states[i] for i in AUX_IDS], dim=-1)


@pytest.mark.parametrize("k", [0, 3])
def test_committed_rows_match_hf_and_cover_every_position(
    k, recording, make_engine, tiny_llama_target, tiny_llama_draft, hf_model
):
    # Two requests at a time: the third is prefilled while another decodes (a mixed step).
    engine = make_engine(tiny_llama_target, tiny_llama_draft, k=max(k, 1), max_num_seqs=2)
    engine.set_num_speculative_tokens(k)
    outputs = engine.generate(PROMPTS, [SamplingParams(max_tokens=n) for n in MAX_TOKENS])
    (spec,) = recording
    hf = hf_model(tiny_llama_target)
    hidden_size = hf.config.hidden_size

    # request -> [(call, position, input token, hidden, aux)] of its committed rows
    committed: dict[Request, list[tuple[int, int, int, torch.Tensor, torch.Tensor]]] = {}
    # request -> [(call, next position, next token)]
    sampled: dict[Request, list[tuple[int, int, int]]] = {}
    last_call: dict[Request, int] = {}
    num_mixed = num_partial = num_accepted_total = 0
    for call, p in enumerate(spec.proposals):
        num_reqs, num_tokens = len(p.requests), len(p.input_ids)
        assert len(p.query_start_loc) == num_reqs + 1 and p.query_start_loc[-1] == num_tokens
        assert p.hidden_states.shape == (num_tokens, hidden_size)
        assert p.aux_hidden_states.shape == (num_tokens, len(AUX_IDS) * hidden_size)
        num_mixed += 0 < p.num_decode < num_reqs
        cu = p.cu_num_draft_tokens
        drafted = [b - a for a, b in zip([0, *cu[:-1]], cu, strict=True)]
        for i, request in enumerate(p.requests):
            start, end = p.query_start_loc[i], p.query_start_loc[i + 1]
            if i < p.num_decode:
                assert end - start == k + 1 and drafted[i] == k
                assert 0 <= p.num_accepted[i] <= k
                num_partial += p.num_accepted[i] < k
                num_accepted_total += p.num_accepted[i]
                rows = range(start, start + p.num_accepted[i] + 1)
            else:  # a prefill: every row is committed
                assert drafted[i] == 0 and p.num_accepted[i] == 0
                assert p.positions[start] == 0
                rows = range(start, end)
            # Committed rows are consecutive positions; the sampled token follows them.
            positions = [p.positions[r] for r in rows]
            assert positions == list(range(positions[0], positions[0] + len(rows)))
            assert p.next_positions[i] == positions[-1] + 1
            for r in rows:
                committed.setdefault(request, []).append(
                    (
                        call,
                        p.positions[r],
                        p.input_ids[r],
                        p.hidden_states[r],
                        p.aux_hidden_states[r],
                    )
                )
            sampled.setdefault(request, []).append((call, p.next_positions[i], p.next_token_ids[i]))
            last_call[request] = call
    assert num_mixed > 0, "no step mixed prefills with running requests"
    if k > 0:  # both verification outcomes happened
        assert num_accepted_total > 0 and num_partial > 0

    assert len(committed) == len(PROMPTS)
    by_prompt = {tuple(r.prompt_token_ids): r for r in committed}
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        request = by_prompt[tuple(prompt)]
        seq = request.token_ids
        assert seq == prompt + output
        ref_hidden, ref_aux = _hf_states(hf, seq)
        covered = set()
        for call, pos, token, hidden, aux in committed[request]:
            if pos >= len(seq):
                # Accepted drafts past a request's end (max_tokens cut the step's tokens):
                # only in the step that finished it.
                assert call == last_call[request]
                continue
            assert token == seq[pos], f"position {pos}"
            torch.testing.assert_close(hidden, ref_hidden[pos], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(aux, ref_aux[pos], atol=1e-4, rtol=1e-4)
            covered.add(pos)
        assert covered >= set(range(len(seq) - 1)), f"positions never committed: {prompt}"
        for call, pos, token in sampled[request]:
            if pos < len(seq):
                assert token == seq[pos], f"next token at position {pos}"
            else:
                assert call == last_call[request]


def test_aux_layer_out_of_range_names_field_and_values(
    monkeypatch, make_engine, tiny_llama_target, tiny_llama_draft
):
    monkeypatch.setattr(RecordingSpeculator, "aux_hidden_state_layers", (0, 99))
    monkeypatch.setitem(
        registry.SPECULATOR_FACTORIES,
        "draft_model",
        lambda ctx: RecordingSpeculator(**registry.draft_kwargs(ctx)),
    )
    with pytest.raises(
        ValueError, match=r"aux_hidden_state_layer_ids contains 99.*num_hidden_layers=3"
    ):
        make_engine(tiny_llama_target, tiny_llama_draft, k=2)


def test_registry_matches_the_api_capabilities():
    assert set(registry.supported_methods()) == set(IMPLEMENTED_METHODS)
