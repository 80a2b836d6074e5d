"""A tiny Llama-shaped model directory for vLLM-CPU tests and calibration.

Config only (weights come from vLLM's ``load_format="dummy"``, i.e. random), plus a
real byte-level BPE tokenizer trained here on a small in-memory corpus so that text
prompts, detokenized deltas and chat templates all work. The model's output is
random text; tests check plumbing, never content.

The tokenizer deliberately declares no EOS token (and config.json sets
``eos_token_id: null``): with random weights an EOS could be sampled at any step,
which would make "generate exactly N tokens" tests flaky.
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB_SIZE = 512

# head_dim = hidden_size / num_attention_heads must be one vLLM-CPU supports (64 is;
# 16 is not).
LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_hidden_layers": 2,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world this is a tiny tokenizer for fairlane tests",
    "fair scheduling across tenants keeps every queue moving",
    "a worker pulls work from the dispatcher when it has room",
    "tokens stream back to the client in small chunks",
    "prefix caching is salted per tenant so nothing leaks",
    "system user assistant tool developer",
    "0 1 2 3 4 5 6 7 8 9 10 100 1000",
]


def _build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    # The model samples from all VOCAB_SIZE ids; every one must decode, so fill the
    # vocabulary up with plain added tokens.
    missing = VOCAB_SIZE - tok.get_vocab_size()
    tok.add_tokens([f"<x{i}>" for i in range(missing)])
    assert tok.get_vocab_size() == VOCAB_SIZE
    return tok


def write_tiny_model(path: str | Path, *, with_tokenizer: bool = True) -> Path:
    """Write config.json (and a tokenizer) to `path`; return the path."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(LLAMA_CONFIG, indent=2))
    if with_tokenizer:
        tok = _build_tokenizer()
        tok.save(str(path / "tokenizer.json"))
        tokenizer_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": 4096,
            "pad_token": "<pad>",
            "add_bos_token": False,
            "add_eos_token": False,
            "chat_template": CHAT_TEMPLATE,
        }
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return path


if __name__ == "__main__":
    # python -m tests.vllm.tiny_model DIR: a model dir to try the vLLM path without a GPU
    # (random weights: run vLLM with load_format=dummy).
    import sys

    print(write_tiny_model(sys.argv[1] if len(sys.argv) > 1 else "tiny-llama"))
