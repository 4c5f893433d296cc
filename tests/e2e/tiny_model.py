"""Build a tiny random-weight Llama model and a locally trained tokenizer.

Why: end-to-end tests must start real vLLM engines without any hub access, and
must start them fast on 2 CPU cores.  The model is a genuine Llama architecture
(so vLLM's real CPU attention kernels, paged KV cache and sampler run), but tiny:

* hidden 128, 2 layers, 2 attention heads of head_dim 64 (CPU attention needs
  head_dim 64 and a block size that is a multiple of 32),
* a ~1000-entry BPE vocabulary trained in well under a second from a generated
  corpus.

The weights are random but drawn with a large standard deviation (0.3): with the
default 0.02 every logit is nearly equal and greedy decoding flips on rounding
noise, which would make "disaggregated output == single-engine output" a test of
luck instead of a test of the KV bytes.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HIDDEN_SIZE = 128
NUM_LAYERS = 2
NUM_HEADS = 2
HEAD_DIM = 64
VOCAB_SIZE = 1000
MAX_POSITIONS = 2048
INIT_STD = 0.3
SEED = 1234

_WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
    "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu the a an of "
    "to in on at by for with from cache block page layer token prefill decode remote local "
    "engine transfer read write lease notify peer memory region segment fast slow red green "
    "blue river mountain ocean forest city street house garden window door table chair"
).split()


def _corpus(n_lines: int = 4000, seed: int = SEED) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        n = rng.randint(4, 24)
        words = []
        for _ in range(n):
            w = rng.choice(_WORDS)
            if rng.random() < 0.15:
                w = w + str(rng.randint(0, 99))
            words.append(w)
        lines.append(" ".join(words) + rng.choice([".", "!", "?", ",", ";"]))
    return lines


def _build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        model_max_length=MAX_POSITIONS,
    )
    fast.save_pretrained(str(out))


def _build_model(out: Path, vocab_size: int, num_layers: int, num_heads: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=2 * HIDDEN_SIZE,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=INIT_STD,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                continue  # keep RMSNorm weights at 1.0
            p.normal_(0.0, INIT_STD)
    model.to(torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)


def kv_bytes_per_token(num_layers: int = NUM_LAYERS, num_heads: int = NUM_HEADS) -> int:
    """KV-cache bytes one token takes (K and V, every layer, float32)."""
    return num_layers * 2 * num_heads * HEAD_DIM * 4


def build_tiny_model(out_dir: str | Path, *, num_layers: int = NUM_LAYERS, num_heads: int = NUM_HEADS) -> Path:
    """Write a tiny Llama model + tokenizer to ``out_dir`` and return its path.

    Deterministic: the same seed gives the same weights and vocabulary, so two
    engines (or two test sessions) loading it agree bit for bit. ``num_layers`` and
    ``num_heads`` (KV heads too, head_dim stays 64, hidden stays 128) size the KV cache
    without adding much compute: 16 and 16 give 128 KiB per token, what Llama-3-8B's
    KV takes in bf16, against 2 KiB for the default.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        cfg = json.loads((out / "config.json").read_text())
        if (cfg.get("num_hidden_layers"), cfg.get("num_attention_heads")) == (num_layers, num_heads):
            return out
    _build_tokenizer(out)
    vocab = len(json.loads((out / "tokenizer.json").read_text())["model"]["vocab"])
    _build_model(out, vocab_size=max(vocab, 8), num_layers=num_layers, num_heads=num_heads)
    return out


if __name__ == "__main__":  # pragma: no cover - manual helper
    import sys

    print(build_tiny_model(sys.argv[1] if len(sys.argv) > 1 else "/tmp/kvt-tiny-llama"))
