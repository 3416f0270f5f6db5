import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny import (COHERE2_MOE, DELTA_NET, DSA, FALCON_H1, GEMMA3N, GEMMA4, GEMMA4_MOE, JETMOE, MINIMAX, RECURRENT_GEMMA, ZAMBA2, JAMBA, LFM3, LLAMA4, MAMBA, MIMO,  # noqa: E402
                  HY4, KIMI_LINEAR, LARA, LING, MOE, NEMOTRON_H, OLMO_HYBRID, make_tiny, noisy_copy)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """Tiny random checkpoints: targets of several architectures, an unrelated 1-layer draft
    and one resembling the llama target."""
    root = tmp_path_factory.mktemp("tiny")
    llama = make_tiny(root / "llama", "llama", seed=0)
    return {
        "llama": llama,
        "noisy": noisy_copy(llama, root / "noisy", 0.1),  # a draft whose q overlaps llama's p
        "qwen2": make_tiny(root / "qwen2", "qwen2", seed=1),
        "qwen3": make_tiny(root / "qwen3", "qwen3", seed=2),
        "mistral": make_tiny(root / "mistral", "mistral", seed=3),
        "windowed": make_tiny(root / "windowed", "mistral", seed=4, sliding_window=6),  # outputs span many windows
        # Gemma 3's layers: a window on the first, a rope per layer type
        "gemma3": make_tiny(root / "gemma3", "gemma3_text", seed=9, head_dim=16, sliding_window=6,
                            query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention"]),
        # mixtures of experts: Qwen2-MoE's shared expert beside 4 routed ones, then a dense
        # layer; Mixtral's window of 6 on every layer
        "qwen2moe": make_tiny(root / "qwen2moe", "qwen2_moe", seed=10, **MOE["qwen2_moe"], mlp_only_layers=[1]),
        "mixtral": make_tiny(root / "mixtral", "mixtral", seed=11, **MOE["mixtral"], sliding_window=6),
        "gptoss": make_tiny(root / "gptoss", "gpt_oss", seed=12, **MOE["gpt_oss"], sliding_window=6),  # sinks
        "glm45": make_tiny(root / "glm45", "glm4_moe", seed=13, **MOE["glm4_moe"]),
        "deepseek": make_tiny(root / "deepseek", "deepseek_v3", seed=14, **MOE["deepseek_v3"]),  # latent attention
        "qwen35": make_tiny(root / "qwen35", "qwen3_5_text", seed=15, **DELTA_NET),  # recurrent states
        "granite4h": make_tiny(root / "granite4h", "granitemoehybrid", seed=16, **MOE["granitemoehybrid"]),  # Mamba-2
        "nemotronh": make_tiny(root / "nemotronh", "nemotron_h", seed=17, **NEMOTRON_H),  # one mixer or MLP a block
        "lfm2": make_tiny(root / "lfm2", "lfm2", seed=18, layers=3, layer_types=["conv", "full_attention", "conv"]),
        "lfm3": make_tiny(root / "lfm3", "lfm3", seed=29, layers=5, **LFM3),  # convolutions, windows of 6, gates
        "olmohybrid": make_tiny(root / "olmohybrid", "olmo_hybrid", seed=30, **OLMO_HYBRID),  # DeltaNet, OLMo 3's
        "kimilinear": make_tiny(root / "kimilinear", "kimi_linear", seed=35, **KIMI_LINEAR),  # Kimi Delta Attention
        "ling": make_tiny(root / "ling", "bailing_hybrid", seed=36, **LING),  # Ling's, bounded decays
        "lara": make_tiny(root / "lara", "lara_mini", seed=38, **LARA),  # DeltaNet beside windowed and full attention
        "zamba2": make_tiny(root / "zamba2", "zamba2", seed=40, **ZAMBA2),  # Mamba-2, shared attention blocks
        # RG-LRU blocks beside windowed attention
        "recurrentgemma": make_tiny(root / "recurrentgemma", "recurrent_gemma", seed=41, **RECURRENT_GEMMA),
        "minimax": make_tiny(root / "minimax", "minimax", seed=42, **MINIMAX),  # lightning attention, experts
        "jetmoe": make_tiny(root / "jetmoe", "jetmoe", seed=43, **JETMOE),  # attention experts, MLP experts
        "cohere2moe": make_tiny(root / "cohere2moe", "cohere2_moe", seed=31, layers=4, **COHERE2_MOE),  # windows, experts
        "mimo": make_tiny(root / "mimo", "mimo_v2_flash", seed=32, layers=4, **MIMO),  # narrower values, sinks
        # sparse attention: each token's best 6 keys (DeepSeek-V3.2's indexer; GLM-5's, its middle layer shared)
        "deepseekv32": make_tiny(root / "deepseekv32", "deepseek_v32", seed=33, **DSA),
        "glm5": make_tiny(root / "glm5", "glm_moe_dsa", seed=34, **DSA, indexer_types=["full", "shared", "full"]),
        "hy4": make_tiny(root / "hy4", "hy_v4", seed=37, **HY4),  # hyper-connections, sparse attention with sinks
        "falconh1": make_tiny(root / "falconh1", "falcon_h1", seed=19, **FALCON_H1),  # attention beside Mamba-2
        "mamba": make_tiny(root / "mamba", "falcon_mamba", seed=20, **MAMBA),  # a selective scan alone a block
        "jamba": make_tiny(root / "jamba", "jamba", seed=21, **JAMBA),  # Mamba and attention, experts
        # OLMo 3: norms after attention and the MLP alone, q/k norms over all heads, windows on 3 layers of 4
        "olmo3": make_tiny(root / "olmo3", "olmo3", seed=22, layers=4, sliding_window=6),
        # Command R7B: layer norms, attention and the MLP side by side, windows on 3 layers of 4 (no rope on the 4th)
        "cohere2": make_tiny(root / "cohere2", "cohere2", seed=23, layers=4, sliding_window=6, logit_scale=0.3),
        # Pythia (GPT-NeoX): layer norms, attention beside the MLP, a quarter of each head rotated, its fused projection
        "pythia": make_tiny(root / "pythia", "gpt_neox", seed=24, num_key_value_heads=None),
        # Llama 4: chunks of 8 on its layers with rope, none on the 4th; experts scaled by their inputs
        "llama4": make_tiny(root / "llama4", "llama4_text", seed=25, **LLAMA4),
        # BLOOM: ALiBi's biases (6 heads), no rope
        "bloom": make_tiny(root / "bloom", "bloom", seed=26, num_key_value_heads=None, num_attention_heads=6,
                           hidden_size=48),
        # Gemma 4: heads of two widths, keys shared by its last layers, per-layer inputs (``tiny.GEMMA4``)
        "gemma4": make_tiny(root / "gemma4", "gemma4_text", seed=27, **GEMMA4),
        "gemma4moe": make_tiny(root / "gemma4moe", "gemma4_text", seed=28, **GEMMA4_MOE),  # experts beside the MLP
        # Gemma 3n: 4 streams (alternating updates), LAuReL, sparse gates, shared keys, per-layer inputs (``tiny.GEMMA3N``)
        "gemma3n": make_tiny(root / "gemma3n", "gemma3n_text", seed=39, **GEMMA3N),
        "draft": make_tiny(root / "draft", "llama", seed=7, layers=1),
        "alien": make_tiny(root / "alien", "llama", seed=8, layers=1, swap_tokens=True),  # other vocab
    }


@pytest.fixture(scope="session")
def loaded(tiny_dirs):
    """LoadedModel per tiny checkpoint, loaded once (cpu, fp32; also on a GPU machine, where
    the default device would be cuda)."""
    from specdec.runtime import load_model

    cache = {}

    def get(name, backend="auto"):
        if (name, backend) not in cache:
            cache[name, backend] = load_model(str(tiny_dirs[name]), device="cpu", backend=backend)
        return cache[name, backend]

    return get


@pytest.fixture(scope="session", autouse=True)
def _cache_dir(tmp_path_factory):
    """specdec's cache directory (measured costs, llama.cpp's row limit) in a temporary one, so
    that tests measure afresh and leave the user's cache alone."""
    import os

    old = os.environ.get("SPECDEC_CACHE")
    os.environ["SPECDEC_CACHE"] = str(tmp_path_factory.mktemp("specdec-cache"))
    yield
    if old is None:
        del os.environ["SPECDEC_CACHE"]
    else:
        os.environ["SPECDEC_CACHE"] = old
