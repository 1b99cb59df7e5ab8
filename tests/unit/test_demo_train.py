"""Demo tokenizer and training pipeline on a tiny corpus: lossless BPE, HF layout, reloadable."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from specula.demo.corpus import CorpusSpec, select_corpus
from specula.demo.recipe import ModelShape, Recipe
from specula.demo.tokenizer import EOS_TOKEN, to_transformers, train_bpe

CODE = [
    "import os\n\n\ndef walk(root):\n    for name in os.listdir(root):\n        yield name\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"
    "        self.items.append(x)\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
] * 4


def test_bpe_is_lossless_on_code_and_reserves_eos() -> None:
    tok = train_bpe(CODE, vocab_size=300)
    assert tok.token_to_id(EOS_TOKEN) == 0
    assert 257 <= tok.get_vocab_size() <= 300
    for text in [*CODE, "\tx = 'ünïcode' # never seen\n", "    " * 5 + "return\n"]:
        assert tok.decode(tok.encode(text).ids) == text
    assert train_bpe(CODE, vocab_size=300).to_str() == tok.to_str()


def test_bpe_rejects_a_vocabulary_without_room_for_bytes() -> None:
    with pytest.raises(ValueError, match="257"):
        train_bpe(CODE, vocab_size=256)


def test_transformers_wrapper_round_trips(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = train_bpe(CODE, vocab_size=300)
    to_transformers(tok, model_max_length=64).save_pretrained(str(tmp_path))
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    assert loaded.eos_token == EOS_TOKEN and loaded.eos_token_id == 0
    ids = loaded(CODE[0])["input_ids"]
    assert ids == tok.encode(CODE[0]).ids  # no BOS added
    assert loaded.decode(ids) == CODE[0]


def test_schedule_and_batches() -> None:
    import torch

    from specula.demo.train import cosine_lr, sample_batch

    assert cosine_lr(0, 100, 10, 0.1) == pytest.approx(0.1)
    assert cosine_lr(9, 100, 10, 0.1) == pytest.approx(1.0)
    assert cosine_lr(10, 100, 10, 0.1) == pytest.approx(1.0)
    assert cosine_lr(100, 100, 10, 0.1) == pytest.approx(0.1)
    stream = torch.arange(1000)
    x, y = sample_batch(stream, 4, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 16)
    assert torch.equal(y, x + 1)
    x2, _ = sample_batch(stream, 4, 16, torch.Generator().manual_seed(0))
    assert torch.equal(x, x2)


def test_tiny_training_run_saves_reloadable_hf_checkpoints(tmp_path: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from specula.demo.train import train_models

    root = tmp_path / "lib"
    for i, text in enumerate(CODE[:3]):
        (root / f"m{i}.py").parent.mkdir(parents=True, exist_ok=True)
        (root / f"m{i}.py").write_text(text * 20)
    recipe = Recipe(
        corpus=CorpusSpec(val_fraction=0.34), vocab_size=320, seq_len=32,
        max_position_embeddings=64, batch_size=4,
        target=ModelShape(2, 32, 64, 2, 1), draft=ModelShape(1, 32, 64, 2, 1),
        target_steps=4, draft_steps=2, warmup_steps=1, eval_batches=1,
    )
    report = train_models(tmp_path / "out", recipe, select_corpus(recipe.corpus, root),
                          progress=False)
    json.dumps(report)  # the report is written as JSON by the cache
    assert report["params"]["draft"] < report["params"]["target"]
    assert 0.0 <= report["greedy_agreement"] <= 1.0
    for name, layers in (("target", 2), ("draft", 1)):
        d = tmp_path / "out" / name
        assert {"config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json"} <= {p.name for p in d.iterdir()}
        model = LlamaForCausalLM.from_pretrained(str(d))
        assert model.config.num_hidden_layers == layers
        tok = AutoTokenizer.from_pretrained(str(d))
        ids = torch.tensor([tok(CODE[0])["input_ids"]])
        assert model(input_ids=ids).logits.shape == (1, ids.shape[1], model.config.vocab_size)


def test_draft_initialisation_copies_the_target_prefix() -> None:
    import torch
    from transformers import LlamaForCausalLM

    from specula.demo.train import init_draft_from_target, llama_config

    recipe = Recipe()
    target = LlamaForCausalLM(llama_config(ModelShape(2, 32, 64, 2, 1), recipe, 300, 0))
    draft = LlamaForCausalLM(llama_config(ModelShape(1, 32, 64, 2, 1), recipe, 300, 0))
    init_draft_from_target(draft, target)
    for key, value in draft.state_dict().items():
        assert torch.equal(value, target.state_dict()[key]), key
    narrow = LlamaForCausalLM(llama_config(ModelShape(1, 16, 32, 2, 1), recipe, 300, 0))
    with pytest.raises(ValueError, match="hidden sizes"):
        init_draft_from_target(narrow, target)
    assert dataclasses.asdict(recipe) == recipe.to_json()


def test_cache_trains_once_and_retrains_after_an_interrupted_run(
    tmp_path: Path, demo_cache
) -> None:
    from specula.demo import train
    from specula.demo.recipe import recipe_hash

    recipe = demo_cache(target_layers=2)
    out, report, trained = train.ensure_models(recipe, progress=False)
    digest = select_corpus(recipe.corpus).digest
    assert trained and out == tmp_path / "demo" / recipe_hash(recipe, digest)
    assert json.loads((out / train.COMPLETE_MARKER).read_text()) == report
    again, cached_report, trained = train.ensure_models(recipe, progress=False)
    assert (again, cached_report, trained) == (out, report, False)
    (out / train.COMPLETE_MARKER).unlink()  # as if killed before the marker was written
    (out / "draft" / "stale").write_text("left by the interrupted run")
    _, _, trained = train.ensure_models(recipe, progress=False)
    assert trained and not (out / "draft" / "stale").exists()
    _, _, trained = train.ensure_models(recipe, retrain=True, progress=False)
    assert trained
