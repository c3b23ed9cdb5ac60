"""Architectures of the hub models the configs name, for counting from parameter shapes without their weights
(a model built on the meta device holds no memory): e.g. the LoRA push budget of conf/model/qwen3_4b.yaml."""

from __future__ import annotations


def qwen3_4b_config():
    """Qwen3-4B-Instruct-2507's architecture (its config.json on the hub): 36 layers, width 2560, 32 query and
    8 key/value heads of 128, MLP 9728, vocabulary 151936, tied embeddings; ~4.0B parameters."""
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
                       tie_word_embeddings=True, rope_theta=5000000.0, rms_norm_eps=1e-6)
