"""A random model of the bundled model's family at a larger size, for the weight benchmarks.

    python benchmarks/random_model.py /tmp/m100 [--hidden 1024] [--layers 8] [--seed 0]
    python benchmarks/random_model.py /tmp/a3b --a3b [--layers 4] [--experts 64]

``--a3b``: Qwen3.6-35B-A3B's shapes (shared/FACTS.md: hidden 2048, gated attention 16/2 x 256,
DeltaNet 16/32 heads of 128, experts of 512 top-8 plus a shared one, every 4th layer attention)
with fewer layers and experts, so that a token reads what one of its layers reads (the routed
experts' share does not depend on how many there are), at a size this machine converts;
``python benchmarks/vs_llama_cpp.py -m /tmp/a3b --gguf-type q4_k`` then times it beside
llama.cpp as a Q4_K_M file.

The bundled model (9.5M parameters) is too small for its matrices to leave the caches, so
quantized-weight figures (``benchmarks/weights.py -m /tmp/m100``) are taken on this one:
the bundled config with every width scaled from ``--hidden`` (heads of 128, a 3x feed-forward),
random weights from transformers' own initialiser, the bundled tokenizer, saved in bf16 as
the bundled model is. Nothing is downloaded; the same seed gives the same file.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvslim.loading import default_model  # noqa: E402


def config_for(base: dict, hidden: int, layers: int) -> dict:
    heads = hidden // 128
    config = dict(base, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                  linear_num_key_heads=max(1, heads // 2), linear_num_value_heads=heads,
                  linear_key_head_dim=128, linear_value_head_dim=128)
    config["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    return config


def a3b_config(base: dict, layers: int, experts: int) -> dict:
    config = dict(base, model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=layers,
                  num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                  linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                  num_experts=experts, num_experts_per_tok=8, moe_intermediate_size=512,
                  shared_expert_intermediate_size=512)
    config["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    return config


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--a3b", action="store_true", help="Qwen3.6-35B-A3B's shapes (a mixture), fewer layers")
    ap.add_argument("--experts", type=int, default=64, help="routed experts per layer with --a3b (the real: 256)")
    args = ap.parse_args()
    import transformers
    base_dir = Path(default_model())
    base = json.loads((base_dir / "config.json").read_text())
    torch.manual_seed(args.seed)
    if args.a3b:
        config = a3b_config(base, args.layers, args.experts)
        model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**config)).to(torch.bfloat16)
    else:
        config = config_for(base, args.hidden, args.layers)
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**config)).to(torch.bfloat16)
    model.save_pretrained(args.out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(base_dir / name, args.out / name)
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.out}: {params / 1e6:.1f}M parameters, hidden {config['hidden_size']}, {args.layers} layers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
