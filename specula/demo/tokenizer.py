"""Byte-level BPE tokenizer for the demo, trained with the ``tokenizers`` library.

Byte-level BPE (Radford et al. 2019, GPT-2; BPE for subwords: Sennrich et al., arXiv 1508.07909)
covers every byte, so any prompt encodes without unknown tokens, and decoding is lossless —
which the demo relies on when it compares completions with and without speculation as text.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

#: Separates documents in training and serves as EOS; the only special token.
EOS_TOKEN = "<|endoftext|>"


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE tokenizer on ``texts``.

    Args:
        texts: training documents.
        vocab_size: target vocabulary size including the 256 byte tokens and :data:`EOS_TOKEN`
            (id 0). The result can be smaller when the corpus has too few merges.
        min_frequency: a pair must occur at least this often to be merged.

    Raises:
        ValueError: ``vocab_size`` is below 257 (bytes plus EOS).
    """
    if vocab_size < 257:
        raise ValueError(f"vocab_size must be >= 257 (256 bytes + EOS), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    # No prefix space: code is indentation-sensitive and prompts must encode exactly as typed.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def to_transformers(tok: Tokenizer, model_max_length: int):
    """Wrap ``tok`` as a ``transformers.PreTrainedTokenizerFast`` with EOS/BOS/PAD set.

    BOS and PAD reuse :data:`EOS_TOKEN`: the models are trained on EOS-separated documents and
    no BOS is prepended at encode time.
    """
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=None,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(tok: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``."""
    to_transformers(tok, model_max_length).save_pretrained(str(out_dir))
