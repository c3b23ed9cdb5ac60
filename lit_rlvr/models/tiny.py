"""The built-in tiny policy: a small Qwen3-architecture causal LM with a character-level tokenizer, both built
in code and saved with `save_pretrained`, so they reload like any HF model (no hub access)."""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from lit_rlvr.config.bounds import TINY_CONTEXT

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARACTERS = [c for c in string.printable if c not in "\x0b\x0c\r"]  # printable ASCII, tab and newline


def build_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character of printable ASCII; anything else maps to <unk>."""
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *CHARACTERS])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r".|\n"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )


def tiny_config(vocab_size: int, *, hidden_size: int = 64, layers: int = 2, heads: int = 4) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=3 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=hidden_size // heads,
        max_position_embeddings=TINY_CONTEXT,  # train.py checks rollout bounds against it before the warm-up
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def build_tiny(seed: int = 0, **config_kwargs) -> tuple[Qwen3ForCausalLM, PreTrainedTokenizerFast]:
    """A freshly initialised tiny model (fp32) and its tokenizer."""
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(tiny_config(len(tokenizer), **config_kwargs))
    return model, tokenizer


def save(model, tokenizer, path: str | Path) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
