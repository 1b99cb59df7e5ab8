"""The engine hands speculators the target's hidden states of committed positions only:
after prefill, plain decode and verification rounds, each committed position arrives
exactly once, with the final hidden state and the auxiliary (per-layer input) states
equal to ``transformers``' ``output_hidden_states`` on the final sequence."""

from __future__ import annotations

import pytest
import torch

from specula.api.capabilities import IMPLEMENTED_METHODS
from specula.runtime.engine.llm_engine import SamplingParams
from specula.runtime.spec_decode import registry
from specula.runtime.spec_decode.base import TargetHiddenStates
from specula.runtime.spec_decode.draft_model import PlainDraftModelSpeculator

pytestmark = pytest.mark.runtime

PROMPTS = [[5, 9, 14], [3, 8, 21, 30, 7, 2], [11, 4]]


class RecordingSpeculator(PlainDraftModelSpeculator):
    """The plain draft model, recording every target hidden state it is handed."""

    uses_target_hidden_states = True
    aux_hidden_state_layers = (0, 1, 2)

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.seen: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.slot_owner_generation: dict[int, int] = {}

    def observe_target(self, states: TargetHiddenStates) -> None:
        assert states.hidden_states.shape[0] == sum(states.num_rows)
        assert states.aux_hidden_states is not None
        hidden_size = self.target_config.hidden_size
        assert states.aux_hidden_states.shape == (sum(states.num_rows), 3 * hidden_size)
        row = 0
        for slot, start, n in zip(
            states.slot_ids, states.start_positions, states.num_rows, strict=True
        ):
            for pos in range(start, start + n):
                key = (slot, pos)
                assert key not in self.seen, f"position {pos} of slot {slot} handed twice"
                self.seen[key] = (states.hidden_states[row], states.aux_hidden_states[row])
                row += 1


@pytest.fixture
def recording(monkeypatch):
    made: list[RecordingSpeculator] = []

    def factory(ctx: registry.SpeculatorContext) -> RecordingSpeculator:
        spec = RecordingSpeculator(
            draft_dir=ctx.draft_dir(),
            target_config=ctx.target_config,
            num_speculative_tokens=ctx.config.max_k,
            max_num_seqs=ctx.max_num_seqs,
            max_model_len=ctx.max_model_len,
            dtype=ctx.dtype,
            device=ctx.device,
        )
        made.append(spec)
        return spec

    monkeypatch.setitem(registry.SPECULATOR_FACTORIES, "draft_model", factory)
    return made


@pytest.mark.parametrize("k", [0, 3])
def test_committed_positions_arrive_once_and_match_hf(
    k, recording, make_engine, tiny_llama_target, tiny_llama_draft, hf_model
):
    engine = make_engine(tiny_llama_target, tiny_llama_draft, k=max(k, 1), max_num_seqs=4)
    engine.set_num_speculative_tokens(k)
    outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=10))
    (spec,) = recording
    hf = hf_model(tiny_llama_target)
    # Slots are handed out in order to the requests admitted together.
    for slot, (prompt, out) in enumerate(zip(PROMPTS, outputs, strict=True)):
        seq = prompt + out
        with torch.no_grad():
            ref = hf.model(torch.tensor([seq]), output_hidden_states=True)
        # Every position whose token was fed to the target: all but the last token. A
        # round that ends the request (max_tokens) may commit accepted tokens past the
        # truncated output; those rows follow contiguously and are never used.
        positions = sorted(p for s, p in spec.seen if s == slot)
        assert positions == list(range(len(positions)))
        assert len(positions) >= len(seq) - 1
        for pos in positions[: len(seq) - 1]:
            hidden, aux = spec.seen[(slot, pos)]
            torch.testing.assert_close(hidden, ref.last_hidden_state[0, pos], atol=1e-4, rtol=1e-4)
            expected_aux = torch.cat([ref.hidden_states[i][0, pos] for i in (0, 1, 2)])
            torch.testing.assert_close(aux, expected_aux, atol=1e-4, rtol=1e-4)


def test_aux_layer_out_of_range_names_field_and_values(
    monkeypatch, make_engine, tiny_llama_target, tiny_llama_draft
):
    monkeypatch.setattr(RecordingSpeculator, "aux_hidden_state_layers", (0, 99))

    def factory(ctx):
        return RecordingSpeculator(
            draft_dir=ctx.draft_dir(), target_config=ctx.target_config,
            num_speculative_tokens=ctx.config.max_k, max_num_seqs=ctx.max_num_seqs,
            max_model_len=ctx.max_model_len, dtype=ctx.dtype, device=ctx.device,
        )

    monkeypatch.setitem(registry.SPECULATOR_FACTORIES, "draft_model", factory)
    with pytest.raises(ValueError, match=r"aux_hidden_state_layer_ids contains 99.*num_hidden_layers"):
        make_engine(tiny_llama_target, tiny_llama_draft, k=2)


def test_registry_matches_the_api_capabilities():
    assert set(registry.supported_methods()) == set(IMPLEMENTED_METHODS)
