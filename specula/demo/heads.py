"""Trainable EAGLE-3 and MTP draft heads for the demo target, saved in the ``speculators``
checkpoint format.

Both heads sit on a frozen target and condition on its hidden states:

- EAGLE-3 (Li et al., arXiv 2503.01840): ``fc`` maps the concatenated auxiliary hidden states of
  three target layers (``3H``) to ``H``; one decoder layer attends over
  ``cat(input_layernorm(embed(token)), hidden_norm(hidden))`` (width ``2H``, so q/k/v take ``2H``
  inputs) with ``hidden`` as the residual; then ``norm`` and ``lm_head`` over a draft vocabulary
  whose ids map to target ids through ``d2t`` (offsets: ``target = draft + d2t[draft]``). Later
  draft steps feed the layer's own output back as ``hidden``.
- MTP (DeepSeek-V3, arXiv 2412.19437, one module): ``input_proj`` maps
  ``cat(token_layernorm(embed(token)), hidden_layernorm(hidden))`` to ``H``, a Qwen3-style
  decoder block (per-head q/k RMSNorm, which is the block ``speculators`` supports for MTP)
  runs on it, ``final_layernorm`` closes it, and the target's own LM head gives the logits.

Weight names and configs follow the ``speculators`` package (0.9.0, ``speculators_model_type``
``eagle3`` / ``mtp``): its ``Eagle3DraftModel`` / ``MTPDraftModel`` load the saved directories and
give the same logits (``tests/unit/test_demo_heads.py``); the modules here are plain torch.

Draft steps are unrolled as in EAGLE-3's training-time test: step ``s`` at sequence index ``j``
attends to the step-0 keys of indices ``<= j`` (the context the draft prefill caches) plus its own
and earlier steps' keys at index ``j`` (the draft tokens it proposed before), which is what the
draft sees at inference after a prefill and ``s`` one-token draft steps.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from specula.runtime.models.layers import RMSNorm, RotaryEmbedding

#: ``speculators`` release whose checkpoint format the saved heads follow.
SPECULATORS_FORMAT_VERSION = "0.9.0"


def _cos_sin(
    rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [num_tokens, head_dim]`` of ``positions [num_tokens]`` (training only:
    the runtime's kernels read a cos/sin table instead)."""
    freqs = positions.float()[:, None] * rotary.inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [num_tokens, num_heads, head_dim]`` ("rotate half", RoFormer arXiv
    2104.09864) by ``cos, sin [num_tokens, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


@dataclass(frozen=True)
class TargetShape:
    """What a head takes from the target's ``config.json`` (Hugging Face field names)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    architectures: tuple[str, ...]

    @classmethod
    def from_hf_config(cls, config) -> TargetShape:
        """From a ``transformers`` Llama/Qwen3 config object."""
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        return cls(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_hidden_layers,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads, head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps, rope_theta=float(theta),
            max_position_embeddings=config.max_position_embeddings,
            architectures=tuple(config.architectures or ("LlamaForCausalLM",)),
        )

    def layer_config(self, model_type: str, num_hidden_layers: int) -> dict:
        """The ``transformer_layer_config`` dict of a ``speculators`` checkpoint."""
        cfg = {
            "model_type": model_type, "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "attention_bias": False, "tie_word_embeddings": False,
        }
        if model_type == "llama":
            cfg["mlp_bias"] = False
        return cfg


class SelfAttention(nn.Module):
    """q/k/v/o projections (no bias), optional per-head q/k RMSNorm (Qwen3), RoPE."""

    def __init__(self, in_features: int, shape: TargetShape, qk_norm: bool) -> None:
        super().__init__()
        self.num_heads = shape.num_attention_heads
        self.num_kv_heads = shape.num_key_value_heads
        self.head_dim = shape.head_dim
        self.q_proj = nn.Linear(in_features, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, shape.hidden_size, bias=False)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, shape.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, shape.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [B, T, in]``, ``cos/sin [B * T, head_dim]`` -> rotated ``q [B, T, nh, d]`` and
        ``k, v [B, T, nh, d]`` (KV heads repeated to the query heads)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q.flatten(0, 1), cos, sin).view_as(q)
        k = apply_rotary(k.flatten(0, 1), cos, sin).view_as(k)
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=2)
            v = v.repeat_interleave(groups, dim=2)
        return q, k, v


def unrolled_attention(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]
) -> torch.Tensor:
    """Attention of draft step ``s = len(keys) - 1``.

    Query index ``j`` attends causally to ``keys[0]`` (step 0, indices ``<= j``) and to
    ``keys[1..s]`` at index ``j`` only (the diagonal): EAGLE-3's training-time test mask.

    Args:
        q: [B, T, nh, d]; keys, values: each [B, T, nh, d].

    Returns:
        [B, T, nh * d].
    """
    b, t, nh, d = q.shape
    scale = 1.0 / math.sqrt(d)
    qh = q.transpose(1, 2)  # [B, nh, T, d]
    k0, v0 = keys[0].transpose(1, 2), values[0].transpose(1, 2)
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    scores = (qh @ k0.transpose(-1, -2)) * scale  # [B, nh, T, T]
    scores = scores.masked_fill(~causal, float("-inf"))
    diag = [((q * k).sum(-1) * scale).transpose(1, 2)[..., None] for k in keys[1:]]
    probs = torch.cat([scores, *diag], dim=-1).float().softmax(-1).to(q.dtype)
    out = probs[..., :t] @ v0  # [B, nh, T, d]
    for i, v in enumerate(values[1:]):
        out = out + probs[..., t + i, None] * v.transpose(1, 2)
    return out.transpose(1, 2).reshape(b, t, nh * d)


class MLP(nn.Module):
    """SwiGLU feed-forward (``down(silu(gate(x)) * up(x))``), as in Llama."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """One decoder layer of a head; subclasses say how (hidden, token embedding) enter it.

    Parameter names are those of ``speculators``' layer classes (Hugging Face's
    ``LlamaDecoderLayer`` / ``Qwen3DecoderLayer`` plus the head's own norms/projections).
    """

    def __init__(self, attn_in: int, shape: TargetShape, qk_norm: bool) -> None:
        super().__init__()
        self.self_attn = SelfAttention(attn_in, shape, qk_norm)
        self.mlp = MLP(shape.hidden_size, shape.intermediate_size)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)

    def attention_input(
        self, hidden: torch.Tensor, embeds: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(attention input [B, T, attn_in], residual [B, T, H])``."""
        raise NotImplementedError

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Output projection, residual, MLP block. ``attn [B, T, nh*d]`` -> ``[B, T, H]``."""
        h = residual + self.self_attn.o_proj(attn)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Layer(DraftLayer):
    """EAGLE-3's first (here: only) layer: attention over ``2H`` inputs, ``hidden`` as the
    residual (``norm_before_residual=False`` in ``speculators``)."""

    def __init__(self, shape: TargetShape) -> None:
        super().__init__(2 * shape.hidden_size, shape, qk_norm=False)
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.hidden_norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)

    def attention_input(self, hidden, embeds):
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], -1), hidden


class MTPLayer(DraftLayer):
    """DeepSeek-style MTP module on a Qwen3 decoder block; its output is ``final_layernorm``-ed
    (that output is both the LM head's input and the next step's ``hidden``)."""

    def __init__(self, shape: TargetShape) -> None:
        super().__init__(shape.hidden_size, shape, qk_norm=True)
        h, eps = shape.hidden_size, shape.rms_norm_eps
        self.hidden_layernorm = RMSNorm(h, eps)
        self.token_layernorm = RMSNorm(h, eps)
        self.input_proj = nn.Linear(2 * h, h, bias=False)
        self.input_layernorm = RMSNorm(h, eps)
        self.final_layernorm = RMSNorm(h, eps)

    def attention_input(self, hidden, embeds):
        x = self.input_proj(
            torch.cat([self.token_layernorm(embeds), self.hidden_layernorm(hidden)], -1)
        )
        return self.input_layernorm(x), x

    def finish(self, attn, residual):
        return self.final_layernorm(super().finish(attn, residual))


class DraftHead(nn.Module):
    """Shared parts of both heads: frozen target embeddings and LM head, RoPE, the unrolled
    draft-step forward. Subclasses define ``layer``, ``input_hidden`` and ``logits``."""

    layer: DraftLayer

    def __init__(self, shape: TargetShape, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
        super().__init__()
        self.shape = shape
        self.embed_tokens = nn.Embedding.from_pretrained(embed.detach().clone(), freeze=True)
        self.lm_head = nn.Linear(shape.hidden_size, lm_head.shape[0], bias=False)
        self.lm_head.weight = nn.Parameter(lm_head.detach().clone(), requires_grad=False)
        self.rotary = RotaryEmbedding(shape.head_dim, shape.rope_theta, None, torch.device("cpu"))
        # A buffer follows the module across devices; unroll() hands it to the rotary.
        self.register_buffer("inv_freq", self.rotary.inv_freq, persistent=False)

    def input_hidden(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """The step-0 ``hidden`` [B, T, H] from the target features the head consumes."""
        raise NotImplementedError

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Layer output ``[..., H]`` -> logits ``[..., draft_vocab_size]``."""
        raise NotImplementedError

    def next_hidden(self, out: torch.Tensor) -> torch.Tensor:
        """Layer output -> the ``hidden`` the next draft step reads (both ``[B, T, H]``)."""
        return out

    def unroll(
        self,
        target_hidden: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        num_steps: int,
    ) -> list[torch.Tensor]:
        """Unrolled draft steps with teacher forcing; returns each step's layer output
        ``[B, T, H]`` (:meth:`logits` turns it into logits).

        Index ``j`` pairs the target's features at sequence position ``p_j - 1`` with the token
        at ``p_j = positions[:, j]`` (``input_ids[:, j]``); step ``s`` reads the token
        ``input_ids[:, j + s]`` (zero past the end), sits at position ``p_j + s`` and predicts the
        token after it, so entries ``j >= T - s`` of step ``s`` read padding.

        Args:
            target_hidden: [B, T, F] what :meth:`input_hidden` consumes.
            input_ids: [B, T] int64 target token ids.
            positions: [B, T] int64 positions of ``input_ids``.
            num_steps: unrolled steps (>= 1).
        """
        self.rotary.inv_freq = self.inv_freq
        hidden = self.input_hidden(target_hidden)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outs: list[torch.Tensor] = []
        for s in range(num_steps):
            ids = F.pad(input_ids[:, s:], (0, s))  # [B, T]
            cos, sin = _cos_sin(self.rotary, (positions + s).flatten(), hidden.dtype)
            x, residual = self.layer.attention_input(hidden, self.embed_tokens(ids))
            q, k, v = self.layer.self_attn.project(x, cos, sin)
            keys.append(k)
            values.append(v)
            outs.append(self.layer.finish(unrolled_attention(q, keys, values), residual))
            hidden = self.next_hidden(outs[-1])
        return outs

    def forward(
        self,
        target_hidden: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        num_steps: int,
    ) -> list[torch.Tensor]:
        """:meth:`unroll`, returning each step's logits ``[B, T, draft_vocab_size]``."""
        return [self.logits(o) for o in self.unroll(target_hidden, input_ids, positions,
                                                    num_steps)]

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def _init_weights(self) -> None:
        # Hugging Face's default for these families: N(0, 0.02) linears, unit norm gains.
        for m in self.layer.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)


class Eagle3Head(DraftHead):
    """EAGLE-3 draft head (see the module docstring).

    ``draft_token_ids`` lists, ascending, the target ids of the draft vocabulary; the LM head
    holds those rows of the target's LM head, frozen (as ``speculators`` trains it).
    """

    def __init__(
        self,
        shape: TargetShape,
        embed: torch.Tensor,
        target_lm_head: torch.Tensor,
        aux_hidden_state_layer_ids: tuple[int, ...],
        draft_token_ids: torch.Tensor,
        norm_output: bool = False,
    ) -> None:
        """``norm_output``: later draft steps read the normed state instead of the layer's raw
        output (``speculators``' EAGLE 3.1 option, against magnitude drift over steps).

        Raises:
            ValueError: an aux id outside ``[0, num_hidden_layers]`` or repeated; draft ids not
                ascending and unique within the target vocabulary.
        """
        ids = tuple(aux_hidden_state_layer_ids)
        num_layers = shape.num_hidden_layers
        if len(set(ids)) != len(ids) or not all(0 <= i <= num_layers for i in ids):
            raise ValueError(
                f"eagle_aux_hidden_state_layer_ids {ids} must be distinct and within "
                f"[0, {num_layers}] (num_hidden_layers={num_layers})"
            )
        draft_ids = draft_token_ids.to(torch.long)
        if not (torch.all(draft_ids[1:] > draft_ids[:-1]) and 0 <= int(draft_ids[0])
                and int(draft_ids[-1]) < shape.vocab_size):
            raise ValueError("draft_token_ids must be ascending unique target token ids")
        super().__init__(shape, embed, target_lm_head[draft_ids])
        self.aux_hidden_state_layer_ids = ids
        self.fc = nn.Linear(len(ids) * shape.hidden_size, shape.hidden_size, bias=False)
        self.layer = Eagle3Layer(shape)
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.norm_output = norm_output
        self.register_buffer("draft_token_ids", draft_ids, persistent=False)
        self._init_weights()
        nn.init.normal_(self.fc.weight, std=0.02)

    @property
    def draft_vocab_size(self) -> int:
        return int(self.draft_token_ids.numel())

    def input_hidden(self, target_hidden):
        return self.fc(target_hidden)  # [B, T, 3H] -> [B, T, H]

    def logits(self, out):
        return self.lm_head(self.norm(out))

    def next_hidden(self, out):
        return self.norm(out) if self.norm_output else out

    def state_dict_for_save(self) -> dict[str, torch.Tensor]:
        """Tensors under ``speculators``' names, with ``d2t`` (offsets) and ``t2d`` (mask) when
        the draft vocabulary is smaller than the target's."""
        sd = {"fc.weight": self.fc.weight, "norm.weight": self.norm.weight,
              "embed_tokens.weight": self.embed_tokens.weight,
              "lm_head.weight": self.lm_head.weight}
        sd |= {f"layers.0.{k}": v for k, v in self.layer.state_dict().items()}
        if self.draft_vocab_size != self.shape.vocab_size:
            ids = self.draft_token_ids.cpu()
            sd["d2t"] = ids - torch.arange(ids.numel())
            t2d = torch.zeros(self.shape.vocab_size, dtype=torch.bool)
            t2d[ids] = True
            sd["t2d"] = t2d
        return sd

    def speculators_config(self, num_speculative_tokens: int, verifier: str | None) -> dict:
        layer = self.shape.layer_config("llama", num_hidden_layers=1)
        return {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_FORMAT_VERSION,
            "speculators_config": _speculators_config(
                "eagle3", num_speculative_tokens, verifier, self.shape),
            "transformer_layer_config": layer,
            "draft_vocab_size": self.draft_vocab_size,
            "norm_before_residual": False,
            "target_hidden_size": None,
            "eagle_aux_hidden_state_layer_ids": list(self.aux_hidden_state_layer_ids),
            "norm_before_fc": False,
            "fc_norm": False,
            "norm_output": self.norm_output,
            "embed_requires_grad": False,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
        }


class MTPHead(DraftHead):
    """MTP draft head (see the module docstring); embeddings and LM head are the target's."""

    def __init__(self, shape: TargetShape, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
        super().__init__(shape, embed, lm_head)
        self.layer = MTPLayer(shape)
        self._init_weights()

    def input_hidden(self, target_hidden):
        return target_hidden

    def logits(self, out):
        return self.lm_head(out)

    def state_dict_for_save(self) -> dict[str, torch.Tensor]:
        """The MTP layer under ``speculators``' names; like ``speculators`` it leaves out the
        embeddings and LM head, which are the target's."""
        return {f"mtp_layers.0.{k}": v for k, v in self.layer.state_dict().items()}

    def speculators_config(self, num_speculative_tokens: int, verifier: str | None) -> dict:
        # num_hidden_layers is the verifier's: speculators reads the MTP input as the output
        # of that layer.
        layer = self.shape.layer_config("qwen3", self.shape.num_hidden_layers)
        layer |= {"use_sliding_window": False, "sliding_window": None,
                  "layer_types": ["full_attention"] * self.shape.num_hidden_layers}
        return {
            "architectures": ["MTPDraftModel"],
            "speculators_model_type": "mtp",
            "speculators_version": SPECULATORS_FORMAT_VERSION,
            "speculators_config": _speculators_config(
                "mtp", num_speculative_tokens, verifier, self.shape),
            "transformer_layer_config": layer,
            "num_nextn_predict_layers": 1,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
        }


def _speculators_config(
    algorithm: str, num_speculative_tokens: int, verifier: str | None, shape: TargetShape
) -> dict:
    return {
        "algorithm": algorithm,
        "proposal_methods": [{
            "proposal_type": "greedy", "speculative_tokens": num_speculative_tokens,
            "verifier_accept_k": 1, "accept_tolerance": 0.0,
        }],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": verifier, "architectures": list(shape.architectures)},
    }


def save_speculators_checkpoint(
    head: Eagle3Head | MTPHead, out_dir: Path, num_speculative_tokens: int, verifier: str | None
) -> None:
    """Write ``config.json`` and ``model.safetensors`` in the ``speculators`` format.

    ``verifier`` (the target checkpoint's path or Hugging Face id) goes into
    ``speculators_config.verifier.name_or_path``; ``speculators`` loads the MTP head's
    embeddings and LM head from it.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in head.state_dict_for_save().items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = head.speculators_config(num_speculative_tokens, verifier)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
