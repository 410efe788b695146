"""Shared fixtures: stores on real files (io_uring with O_DIRECT where the file system
allows it), a tiny seeded Llama, and SmolLM2-135M-Instruct from its GGUF."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture
def store_path(tmp_path):
    return str(tmp_path / "store.ctxfs")


@pytest.fixture(scope="session")
def tiny_model():
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        rope_theta=10000.0,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="session")
def smollm2():
    pytest.importorskip("torch")
    import ctxfs.hf

    return ctxfs.hf.load_smollm2()
