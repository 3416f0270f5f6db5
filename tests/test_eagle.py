"""EAGLE and EAGLE-3 heads: the target's hidden states, the head's drafts against a plain
reimplementation of SGLang's and vLLM's, and lossless decoding with them."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from specdec import LLM, SamplingParams, SpecConfig
from specdec.drafters import EagleDrafter
from specdec.runtime.eagle import EagleHead
from specdec.runtime.loading import Weights
from tiny import make_tiny, make_tiny_eagle

PROMPTS = ["hello world", "abc", "the cat sat on the mat"]
# the head against the reference: float32 rounding (the positions are shifted by one, the
# products run through oneDNN), grown over a chain's steps; a feature routed to the wrong row
# is off by whole units
CLOSE = dict(atol=5e-3, rtol=1e-3)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    target = make_tiny(root / "target", "llama", seed=0, layers=8)
    return {"target": target,
            "eagle3": make_tiny_eagle(root / "eagle3", target, "eagle3", seed=1, draft_vocab=120),
            "eagle3-ids": make_tiny_eagle(root / "eagle3-ids", target, "eagle3", seed=2, norm_before_residual=True,
                                          eagle_aux_hidden_state_layer_ids=[0, 3, 6]),
            "eagle": make_tiny_eagle(root / "eagle", target, "eagle", seed=3)}


def test_tapped_hidden_states_are_transformers(dirs):
    """``TorchLlama.capture``'s taps are transformers' ``hidden_states`` (the last after the
    final norm), side by side, for every row of the forward, with ``last_only`` logits too."""
    from transformers import AutoModelForCausalLM

    from specdec.runtime import load_model

    rt = load_model(str(dirs["target"]), device="cpu").runtime
    rt.capture([8, 0, 3])
    ids = list(b"tapped states")
    logits = rt.forward(rt.new_cache(1), [0], [ids], last_only=True)
    ref = AutoModelForCausalLM.from_pretrained(dirs["target"]).eval()(torch.tensor([ids]), output_hidden_states=True)
    want = torch.cat([ref.hidden_states[t][0] for t in (0, 3, 8)], dim=-1)
    assert rt.features.shape == (1, len(ids), 3 * 64)
    torch.testing.assert_close(rt.features[0], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[0], ref.logits[0, -1], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="0 to 8"):
        rt.capture([9])


def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_drafts(head_dir, target_dir, ids: list[int], chain: list[int]) -> torch.Tensor:
    """The head's logits over the target's vocab after the committed ``ids`` and after each
    token of ``chain`` drafted on them, computed from scratch as SGLang and vLLM lay out an
    EAGLE draft: row j pairs the target's feature at position j (EAGLE-3: its taps through
    ``fc``) with token j + 1, at position j; a drafted token's row takes the feature the row
    before it output."""
    from transformers import AutoModelForCausalLM

    cfg = json.loads((head_dir / "config.json").read_text())
    eagle3 = "LlamaForCausalLMEagle3" in cfg["architectures"]
    w = {k.replace("midlayer.", "").replace("layers.0.", ""): v.float() for k, v in Weights(head_dir).items()}
    w = {k.removeprefix("model."): v for k, v in w.items()}
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    states = target(torch.tensor([ids]), output_hidden_states=True).hidden_states
    L = len(states) - 1
    if eagle3:
        taps = [i + 1 for i in cfg["eagle_aux_hidden_state_layer_ids"]] if "eagle_aux_hidden_state_layer_ids" in cfg \
            else [2, L // 2, L - 3]
        feats = F.linear(torch.cat([states[t][0] for t in taps], -1), w["fc.weight"])
    else:
        feats = states[L][0]
    embed = target.model.embed_tokens.weight
    H, KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = cfg["hidden_size"] // H
    inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, D, 2).float() / D))
    rows_h, rows_t = list(feats[:-1]), ids[1:]  # pairs (feature j, token j + 1)
    out = []
    for step in range(len(chain) + 1):
        hid, e = torch.stack(rows_h), embed[torch.tensor(rows_t)]  # [R, hidden]
        if eagle3:
            normed = rms(hid, w["hidden_norm.weight"])
            residual = normed if cfg.get("norm_before_residual") else hid
            a = torch.cat([rms(e, w["input_layernorm.weight"]), normed], -1)
        else:
            residual = a = F.linear(torch.cat([e, hid], -1), w["fc.weight"], w["fc.bias"])
        R = a.shape[0]
        q = F.linear(a, w["self_attn.q_proj.weight"]).view(R, H, D).transpose(0, 1)
        k = F.linear(a, w["self_attn.k_proj.weight"]).view(R, KV, D).transpose(0, 1).repeat_interleave(H // KV, 0)
        v = F.linear(a, w["self_attn.v_proj.weight"]).view(R, KV, D).transpose(0, 1).repeat_interleave(H // KV, 0)
        ang = torch.arange(R).float()[:, None] * inv
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()

        def rope(x):
            x1, x2 = x.chunk(2, -1)
            return x * cos + torch.cat([-x2, x1], -1) * sin

        o = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True).transpose(0, 1).reshape(R, H * D)
        h = residual + F.linear(o, w["self_attn.o_proj.weight"])
        m = rms(h, w["post_attention_layernorm.weight"])
        h = h + F.linear(F.silu(F.linear(m, w["mlp.gate_proj.weight"])) * F.linear(m, w["mlp.up_proj.weight"]),
                         w["mlp.down_proj.weight"])
        if eagle3:
            logits = F.linear(rms(h[-1], w["norm.weight"]), w["lm_head.weight"])
            full = torch.full((embed.shape[0],), float("-inf"))
            to_target = torch.arange(logits.shape[0]) + w["d2t"].long() if "d2t" in w else torch.arange(logits.shape[0])
            logits = full.index_copy(0, to_target, logits)
        else:
            logits = F.linear(h[-1], target.lm_head.weight)
        out.append(logits)
        if step < len(chain):
            rows_h.append(h[-1])
            rows_t.append(chain[step])
    return torch.stack(out)


def assert_drafts_as(reference, head, target, trees: bool = True) -> None:
    """``head``'s logits after a prompt and the first token the target chose after it (the
    target's features handed over per prefill chunk, as the engine does; the prompt fed to the
    head in two chunks) and after each draft of a chain equal ``reference(ids, chain)``'s (its
    logits after ``ids`` and after each token of ``chain``); with ``trees``, a tree's depth fed
    as one chunk under its mask gives each node the logits its own chain would (the first
    node's child too)."""
    ids = list(b"the quick brown fox")
    tcache, cache = target.new_cache(1), head.new_cache(1)
    if hasattr(cache, "target"):  # (a Gemma 4 assistant's: the target's rows, as the engine attaches them)
        cache.target = tcache
    for chunk in (ids[:7], ids[7:-1]):  # the target's prefill of the prompt, chunk by chunk
        start = tcache.lengths[0]
        target.forward(tcache, [0], [chunk])
        cache.store(0, start, head.fuse(target.features[0]))
    chain = [5, 77, 31]
    ref = reference(ids, chain)
    got = [head.forward(cache, [0], [ids[:10]], last_only=True)[0], head.forward(cache, [0], [ids[10:]], last_only=True)[0]]
    for t in chain:
        got.append(head.forward(cache, [0], [[t]], last_only=True)[0])
    torch.testing.assert_close(torch.stack(got[1:]), ref, **CLOSE)
    if not trees:
        return
    cache.rewind(0, len(ids))  # a tree's first two depths: (5, 9) under the root, (77, 12) under 5
    depth1 = head.forward(cache, [0], [[5, 9]], chunk_masks=[torch.eye(2, dtype=torch.bool)],
                          positions=[[len(ids)] * 2])[0]
    torch.testing.assert_close(depth1[0], ref[1], **CLOSE)
    torch.testing.assert_close(depth1[1], reference(ids, [9])[1], **CLOSE)
    depth2 = head.forward(cache, [0], [[77, 12]], chunk_masks=[torch.tensor([[1, 0, 1, 0], [1, 0, 0, 1]]).bool()],
                          positions=[[len(ids) + 1] * 2])[0]
    torch.testing.assert_close(depth2[0], ref[2], **CLOSE)
    torch.testing.assert_close(depth2[1], reference(ids, [5, 12])[2], **CLOSE)


@pytest.mark.parametrize("name", ["eagle3", "eagle3-ids", "eagle"])
@torch.inference_mode()
def test_head_drafts_as_sglang_and_vllm_lay_them_out(dirs, name):
    """The head's drafts, chains and trees, equal the reference's (``assert_drafts_as``)."""
    llm = LLM(str(dirs["target"]), draft=str(dirs[name]), device="cpu",
              speculative=SpecConfig(method="draft", draft_quantization="none"))
    head, target = llm.draft.runtime, llm.target.runtime
    assert isinstance(head, EagleHead) and llm.spec.method == name.split("-")[0]
    assert_drafts_as(lambda ids, chain: reference_drafts(dirs[name], dirs["target"], ids, chain), head, target)


@pytest.mark.parametrize("name,topk", [("eagle3", 1), ("eagle3", 3), ("eagle", 1), ("eagle", 2)])
def test_greedy_with_an_eagle_head_equals_the_target_alone(dirs, name, topk):
    """Greedy decoding drafting with an EAGLE head (chains and trees, three requests in one
    batch, prompts prefilled in chunks) gives the target's own tokens."""
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(dirs["target"]), device="cpu").generate(PROMPTS, sp)]
    llm = LLM(str(dirs["target"]), draft=str(dirs[name]), device="cpu", chunked_prefill_size=8,
              speculative=SpecConfig(method=name, num_draft_tokens=4, tree_topk=topk))
    assert isinstance(llm.engine.drafters["draft"], EagleDrafter)
    outs = llm.generate(PROMPTS, sp)
    assert [o.token_ids for o in outs] == want
    assert all(o.metrics["drafted_tokens"] > 0 for o in outs)


def recording(llm):
    """Wrap the head's ``forward``: the calls over committed tokens alone (every row's feature
    the target's), as ``(ids of the slot's rows after the call, last row's logits)``."""
    head, drafter = llm.draft.runtime, llm.engine.drafters["draft"]
    calls, forward = [], head.forward

    def recorded(cache, slots, tokens, **kw):
        rows = [drafter.cached_ids[s] + list(t) for s, t in zip(slots, tokens)]
        known = [int(cache.known[s]) for s in slots]
        logits = forward(cache, slots, tokens, **kw)
        if kw.get("last_only") and kw.get("chunk_masks") is None:
            calls.extend((ids, row.clone()) for ids, k, row in zip(rows, known, logits) if len(ids) - 1 <= k)
        return logits

    head.forward = recorded
    return calls


def test_prefix_reuse_with_an_eagle_head(dirs):
    """With prefix reuse a head keeps a prompt's rows, and the target's features stay beside
    them (copied with the rows the target shares between running requests): a later prompt
    that starts the same, and two such prompts at once, reuse rows, the greedy tokens equal
    the target alone's, and every head forward over committed tokens gives SGLang's layout's
    first draft after them."""
    prefix = "the quick brown fox jumps over the lazy dog "
    prompts = [prefix + "and runs", prefix + "but sleeps", prefix + "or not", prefix + "as ever"]
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(dirs["target"]), device="cpu").generate(prompts, sp)]
    llm = LLM(str(dirs["target"]), draft=str(dirs["eagle3"]), device="cpu", chunked_prefill_size=8,
              max_batch_size=2, speculative=SpecConfig(method="eagle3", num_draft_tokens=3, draft_quantization="none"))
    assert llm.engine.reuses_prefixes and llm.engine.drafters["draft"].reuses_prefixes
    calls = recording(llm)
    outs = [llm.generate([p], sp)[0] for p in prompts[:2]]  # the second reuses the first's rows
    outs += llm.generate(prompts[2:], sp)  # two at once: one copies the rows the other computes
    assert [o.token_ids for o in outs] == want
    assert all(o.metrics["cached_prompt_tokens"] >= 40 for o in outs[1:])
    for ids, row in calls:
        torch.testing.assert_close(row, reference_drafts(dirs["eagle3"], dirs["target"], ids, [])[0], **CLOSE)
    assert len(calls) > 8


def test_sampled_with_an_eagle3_head_repeats_with_its_seed(dirs):
    """Sampled requests drafting with an EAGLE-3 head (q over its draft vocabulary, zero on the
    target ids it never drafts) run, accept drafts, and repeat with a seed."""
    llm = LLM(str(dirs["target"]), draft=str(dirs["eagle3"]), device="cpu",
              speculative=SpecConfig(method="eagle3", num_draft_tokens=3))
    sp = SamplingParams(max_tokens=20, temperature=1.0, seed=7, ignore_eos=True, n=2)
    first, again = llm.generate(PROMPTS[:2], sp), llm.generate(PROMPTS[:2], sp)
    assert [[c.token_ids for c in o.outputs] for o in first] == [[c.token_ids for c in o.outputs] for o in again]
    assert sum(o.metrics["accepted_tokens"] for o in first) > 0


def test_eagle_methods_and_their_checkpoints(dirs, tmp_path):
    """``eagle`` / ``eagle3`` need that head (``draft`` with one becomes its kind, as vLLM
    infers; vLLM's ``speculative_config`` names them too); a head needs the target on the
    torch runtime; ``hybrid`` drafts with n-gram matches and the head."""
    target, e3 = str(dirs["target"]), str(dirs["eagle3"])
    with pytest.raises(ValueError, match="an EAGLE3 head: use method 'eagle3'"):
        LLM(target, draft=e3, device="cpu", speculative="eagle")
    with pytest.raises(ValueError, match="needs an EAGLE3 head as the draft"):
        LLM(target, draft=target, device="cpu", speculative="eagle3")
    with pytest.raises(ValueError, match="only specdec's torch runtime"):
        LLM(target, draft=e3, device="cpu", backend="hf", speculative="eagle3")
    llm = LLM(target, device="cpu", speculative_config={"method": "eagle3", "model": e3, "num_speculative_tokens": 2})
    assert llm.spec.method == "eagle3" and llm.spec.num_draft_tokens == 2
    with pytest.raises(ValueError, match="loaded for another target"):
        LLM(target, draft=llm.draft, device="cpu", speculative="eagle3")
    hybrid = LLM(target, draft=e3, device="cpu", speculative="hybrid")
    assert isinstance(hybrid.engine.drafters["draft"], EagleDrafter) and "ngram" in hybrid.engine.drafters
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = ["abcabcabcabc", "hello hello hello"]
    want = [o.token_ids for o in LLM(target, device="cpu").generate(prompts, sp)]
    assert [o.token_ids for o in hybrid.generate(prompts, sp)] == want


def test_bench_drafts_with_an_eagle_head(dirs, tmp_path, monkeypatch, capsys):
    """``specdec bench --eagle HEAD``: specdec-eagle and specdec-eagle-tree (one per tree
    shape) draft with the head beside the plain target, greedy outputs equal; they need
    ``--eagle``."""
    from specdec.cli import main

    monkeypatch.setenv("SPECDEC_COST_CACHE", str(tmp_path / "costs.json"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "comp-a", "kind": "completion", "prompt": "the cat sat on the mat"}\n')
    out = tmp_path / "out"
    common = ["bench", "--model", str(dirs["target"]), "--prompts-file", str(prompts), "--max-new-tokens", "12",
              "--methods", "specdec-plain,specdec-eagle,specdec-eagle-tree", "--tree-shapes", "2x3x5", "--out", str(out)]
    assert main(common + ["--eagle", str(dirs["eagle3"])]) == 0
    report = json.loads((out / "bench.json").read_text())
    summary = report["summary"]
    assert set(summary) == {"specdec-plain", "specdec-eagle", "specdec-eagle-tree:2x3x5"}
    assert all(s["diverged"] == 0 for s in summary.values())
    assert all(summary[m]["acceptance_rate"] is not None for m in ("specdec-eagle", "specdec-eagle-tree:2x3x5"))
    assert report["config"]["eagle"] == str(dirs["eagle3"]) and len(report["cost_curve_s"]["eagle"]) > 1
    assert "EAGLE head" in (out / "bench.md").read_text()
    assert main(common) == 2
    assert "need --eagle" in capsys.readouterr().err


def test_two_heads_on_one_target(dirs):
    """Two LLMs sharing one loaded target, with heads that read different hidden states: the
    target keeps the union, and each head gets its own taps' columns. Every head forward over
    committed tokens of each, before and after the other was made, gives SGLang's layout's
    first draft (the first head used to read the second's taps), and both decode greedily as
    the target alone."""
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    first = LLM(str(dirs["target"]), draft=str(dirs["eagle3"]), device="cpu",
                speculative=SpecConfig(method="eagle3", num_draft_tokens=3, draft_quantization="none"))
    want = [o.token_ids for o in LLM(first.target).generate(PROMPTS[:2], sp)]
    calls = {"eagle3": recording(first)}
    assert [o.token_ids for o in first.generate(PROMPTS[:2], sp)] == want
    second = LLM(first.target, draft=str(dirs["eagle3-ids"]),
                 speculative=SpecConfig(method="eagle3", num_draft_tokens=3, draft_quantization="none"))
    assert first.draft.runtime.reads != second.draft.runtime.reads
    assert set(first.target.runtime.taps) == set(first.draft.runtime.reads) | set(second.draft.runtime.reads)
    calls["eagle3-ids"] = recording(second)
    for llm in (first, second, first):
        assert [o.token_ids for o in llm.generate(PROMPTS[:2], sp)] == want
    for name, recorded in calls.items():
        assert len(recorded) > 4
        for ids, row in recorded:
            torch.testing.assert_close(row, reference_drafts(dirs[name], dirs["target"], ids, [])[0], **CLOSE)


@pytest.fixture(scope="module")
def mtp_dirs(tmp_path_factory):
    """Tiny checkpoints with a multi-token prediction layer: DeepSeek-V3's (latent attention,
    experts) sharing the model's embedding and head, GLM-4.5's (grouped-query attention, half
    of each head rotated, experts) with a head of its own; Qwen3.5's (DeltaNet target, a
    gated attention layer) and Qwen3-Next's (experts); MiMo-V2-Flash's three (windowed, with
    sinks and values narrower than keys); and a DeepSeek-V3 and a MiMo-V2-Flash without."""
    from tiny import DELTA_NET, DSA, MIMO, MOE, add_mtp

    root = tmp_path_factory.mktemp("mtp")
    return {"deepseek": add_mtp(make_tiny(root / "deepseek", "deepseek_v3", seed=4, **MOE["deepseek_v3"]), seed=5),
            "glm45": add_mtp(make_tiny(root / "glm45", "glm4_moe", seed=6, **MOE["glm4_moe"]), seed=7, own_head=True),
            "qwen35": add_mtp(make_tiny(root / "qwen35", "qwen3_5_text", seed=8, **DELTA_NET), seed=9),
            "qwen3next": add_mtp(make_tiny(root / "qwen3next", "qwen3_next", seed=10, **MOE["qwen3_next"]), seed=11),
            "mimo": add_mtp(make_tiny(root / "mimo", "mimo_v2_flash", seed=12, layers=4, **MIMO), seed=13),
            "deepseekv32": add_mtp(make_tiny(root / "deepseekv32", "deepseek_v32", seed=14, **DSA), seed=15),
            "glm5": add_mtp(make_tiny(root / "glm5", "glm_moe_dsa", seed=16, **DSA,
                                      indexer_types=["full", "shared", "full"]), seed=17),
            "none": make_tiny(root / "none", "deepseek_v3", seed=4, **MOE["deepseek_v3"]),
            "mimo-none": make_tiny(root / "mimo-none", "mimo_v2_flash", seed=12, layers=4, **MIMO)}


def reference_mtp(path, ids: list[int], chain: list[int]) -> torch.Tensor:
    """The MTP layer's logits after the committed ``ids`` and after each token of ``chain``,
    from scratch as vLLM lays them out: row j is ``eh_proj([enorm(embedding of token j + 1);
    hnorm(the target's last hidden state at j)])`` at position j, through transformers' own
    decoder layer (a model one layer deeper holds the MTP block as its last), then
    ``shared_head``; a drafted token's row takes the layer's output of the row before it.
    Qwen's: ``fc([pre_fc_norm_embedding(e); pre_fc_norm_hidden(h)])``, norms of 1 + weight,
    and the layer's output after ``mtp.norm`` is both the head's input and the next row's.
    MiMo-V2-Flash's: its first MTP layer (``model.mtp.layers.0.``) as a windowed layer of the
    model's (its window's mask, sinks, the windowed layers' rope), ``final_layernorm`` as Qwen's
    ``mtp.norm``, the model's head."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    L, eps = config.num_hidden_layers, config.rms_norm_eps
    tensors = load_file(path / "model.safetensors")
    w = {k.removeprefix(f"model.layers.{L}."): v for k, v in tensors.items()}
    qwen, mimo = "mtp.fc.weight" in tensors, config.model_type == "mimo_v2_flash"
    dsa_shared = getattr(config, "indexer_types", None)  # (GLM-5's)
    own = "mtp.layers.0." if qwen else "model.mtp.layers.0." if mimo else None  # the layer transformers does not read
    if qwen:  # Qwen's names, as DeepSeek's; the model's head; norms of 1 + weight
        w = {k.removeprefix("mtp.layers.0."): v for k, v in tensors.items()}
        w.update({"enorm.weight": 1 + tensors["mtp.pre_fc_norm_embedding.weight"],
                  "hnorm.weight": 1 + tensors["mtp.pre_fc_norm_hidden.weight"], "eh_proj.weight": tensors["mtp.fc.weight"],
                  "shared_head.norm.weight": 1 + tensors["mtp.norm.weight"], "shared_head.head.weight": tensors["lm_head.weight"]})
    if mimo:
        w = {k.removeprefix(own): v for k, v in tensors.items()}
        w.update({"shared_head.norm.weight": w["final_layernorm.weight"], "shared_head.head.weight": tensors["lm_head.weight"]})
    more = dict(layer_types=config.layer_types + ["full_attention"]) if qwen else \
        dict(layer_types=config.layer_types + ["sliding_attention"], mlp_layer_types=config.mlp_layer_types + ["dense"]) \
        if mimo else dict(layer_types=config.layer_types + ["indexed_attention"],
                          mlp_layer_types=config.mlp_layer_types + ["sparse"],
                          **({"indexer_types": config.indexer_types + ["full"]} if dsa_shared else {})) \
        if config.model_type in ("deepseek_v32", "glm_moe_dsa") else {}
    target = AutoModelForCausalLM.from_pretrained(path).eval()
    sinks = dict(attn_implementation="eager") if mimo else {}  # (its sinks)
    deeper = AutoModelForCausalLM.from_pretrained(path, num_hidden_layers=L + 1, **sinks, **more).eval()
    layer, rotary = deeper.model.layers[L], deeper.model.rotary_emb
    if own:
        layer.load_state_dict({k.removeprefix(own).replace("pre_mlp_layernorm", "post_attention_layernorm"): v
                               for k, v in tensors.items() if k.startswith(own) and
                               k.removeprefix(own).split(".")[0] not in ("enorm", "hnorm", "eh_proj", "final_layernorm")})
    feats = target.model(torch.tensor([ids])).last_hidden_state[0]  # after the final norm
    rows_h, rows_t, out = list(feats[:-1]), ids[1:], []
    for step in range(len(chain) + 1):
        e = target.model.embed_tokens.weight[torch.tensor(rows_t)]
        x = F.linear(torch.cat([rms(e, w["enorm.weight"], eps), rms(torch.stack(rows_h), w["hnorm.weight"], eps)], -1),
                     w["eh_proj.weight"])[None]  # [1, R, hidden]
        R, pos = x.shape[1], torch.arange(x.shape[1])[None]
        i = torch.arange(R)
        if mimo:  # the window: a query sees itself and the sliding_window - 1 keys before it
            seen = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - config.sliding_window)
            mask = torch.zeros(R, R).masked_fill(~seen, float("-inf"))[None, None]
            y = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=rotary(x, pos, "sliding_attention"))[0]
        elif config.model_type in ("deepseek_v32", "glm_moe_dsa"):  # (its indexer scores against a causal mask)
            mask = torch.zeros(R, R).masked_fill(i[None, :] > i[:, None], float("-inf"))[None, None]
            y = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=rotary(x, pos))
            y = (y[0] if isinstance(y, tuple) else y)[0]  # (GLM-5's layer returns its choice of keys too)
        else:
            y = layer(x, attention_mask=None, position_ids=pos, position_embeddings=rotary(x, pos))[0]  # causal
        normed = rms(y[-1], w["shared_head.norm.weight"], eps)
        out.append(F.linear(normed, w["shared_head.head.weight"]))
        if step < len(chain):
            rows_h.append(normed if qwen or mimo else y[-1])
            rows_t.append(chain[step])
    return torch.stack(out)


@pytest.mark.parametrize("name", ["deepseek", "glm45", "qwen35", "qwen3next", "mimo", "deepseekv32", "glm5"])
@torch.inference_mode()
def test_mtp_drafts_as_vllm_lays_them_out(mtp_dirs, name):
    """The MTP layer's chains equal the reference's (``assert_drafts_as``; MiMo-V2-Flash's
    windowed layer's trees too, the prompt longer than its window; DeepSeek-V3.2's and GLM-5's under its own
    indexer's sparse attention, the prompt longer than its 6 keys, trees too); the head shares the model's
    embedding and head where the checkpoint's copies equal them."""
    from specdec.runtime.eagle import MtpHead

    llm = LLM(str(mtp_dirs[name]), device="cpu", speculative=SpecConfig(method="mtp", draft_quantization="none"))
    head, target = llm.draft.runtime, llm.target.runtime
    assert isinstance(head, MtpHead) and head.reads == (target.num_layers,)
    assert (head.embed is target.embed) and ((head.lm_head is target.lm_head) == (name != "glm45"))
    assert_drafts_as(lambda ids, chain: reference_mtp(mtp_dirs[name], ids, chain), head, target,
                     trees=name in ("mimo", "deepseekv32", "glm5"))


@pytest.mark.parametrize("name,topk", [("deepseek", 1), ("deepseek", 2), ("glm45", 1), ("qwen35", 1), ("qwen35", 2),
                                       ("qwen3next", 1), ("mimo", 2), ("deepseekv32", 2)])
def test_greedy_with_mtp_equals_the_target_alone(mtp_dirs, name, topk):
    """Greedy decoding drafting with the checkpoint's MTP layer (chains and trees, Qwen3.5's through its DeltaNet
    layers too; three
    requests in one batch, prompts prefilled in chunks, int8 on the CPU) gives the target's
    own tokens; vLLM's names for the method are read."""
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(mtp_dirs[name]), device="cpu").generate(PROMPTS, sp)]
    method = {"deepseek": "deepseek_mtp", "glm45": "glm4_moe_mtp", "qwen35": "qwen3_5_mtp", "mimo": "mimo_mtp",
              "deepseekv32": "deepseek_mtp"}.get(name, "qwen3_next_mtp")
    spec, _ = SpecConfig.from_vllm({"method": method, "num_speculative_tokens": 3}, tree_topk=topk)
    llm = LLM(str(mtp_dirs[name]), device="cpu", chunked_prefill_size=8, speculative=spec)
    assert spec.method == "mtp" and isinstance(llm.engine.drafters["draft"], EagleDrafter)
    outs = llm.generate(PROMPTS, sp)
    assert [o.token_ids for o in outs] == want
    assert all(o.metrics["drafted_tokens"] > 0 for o in outs)


def test_mtp_from_an_fp8_checkpoint(mtp_dirs, tmp_path):
    """MiMo-V2-Flash as released: its layers and MTP layers in FP8 blocks (``tiny.fp8_copy``),
    dequantized at load. The MTP layer's logits over a prompt are bit for bit those of the same
    checkpoint holding the dequantized weights, and greedy decoding drafting with it gives the
    FP8 target's own tokens."""
    from tiny import fp8_copy

    quantized, dequantized = fp8_copy(mtp_dirs["mimo"], tmp_path / "fp8", block=(24, 16))
    ids, logits = list(b"the quick brown fox"), []
    spec = SpecConfig(method="mtp", num_draft_tokens=3, draft_quantization="none")
    for path in (quantized, dequantized):
        llm = LLM(str(path), device="cpu", speculative=spec)
        head, target = llm.draft.runtime, llm.target.runtime
        tcache, cache = target.new_cache(1), head.new_cache(1)
        target.forward(tcache, [0], [ids])
        cache.store(0, 0, head.fuse(target.features[0]))
        logits.append(head.forward(cache, [0], [ids])[0])
    assert torch.equal(*logits)
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(quantized), device="cpu").generate(PROMPTS, sp)]
    outs = LLM(str(quantized), device="cpu", speculative=spec).generate(PROMPTS, sp)
    assert [o.token_ids for o in outs] == want and all(o.metrics["drafted_tokens"] > 0 for o in outs)


def test_mtp_refusals(mtp_dirs, dirs):
    """Method mtp needs a checkpoint with an MTP layer (a config without one is refused before
    loading; one whose weights lack it, after), on the torch runtime, and no draft model but a
    Gemma 4 assistant."""
    for name in ("none", "mimo-none"):  # (MiMo-V2-Flash's config declares none: its weights say)
        with pytest.raises(ValueError, match="no multi-token prediction layer"):
            LLM(str(mtp_dirs[name]), device="cpu", speculative=SpecConfig(method="mtp"))
    with pytest.raises(ValueError, match="config gives no num_nextn_predict_layers or mtp_num_hidden_layers"):  # before loading
        LLM(str(dirs["target"]), device="cpu", speculative=SpecConfig(method="mtp"))
    with pytest.raises(ValueError, match="needs a Gemma 4 assistant"):
        LLM(str(mtp_dirs["deepseek"]), draft=str(dirs["target"]), device="cpu", speculative=SpecConfig(method="mtp"))
    for backend in ("hf", "llamacpp"):  # refused before the model loads
        with pytest.raises(ValueError, match="not on backend 'hf' or 'llamacpp', nor from a GGUF"):
            LLM(str(mtp_dirs["deepseek"]), device="cpu", backend=backend, speculative=SpecConfig(method="mtp"))
    assert SpecConfig.from_vllm({"method": "deepseek_mtp"})[0].num_draft_tokens == 1  # vLLM's default: its layers


@pytest.fixture(scope="module")
def gemma4_dirs(tmp_path_factory):
    """A tiny Gemma 4 target (``tiny.GEMMA4``: windows of 6, wider full-attention heads, shared
    keys, per-layer inputs) and two assistants for it: E2B's kind (its head over the tokens of
    the best clusters) and 31B's (a whole head), the latter with two windowed layers; and a
    unified one (12B's kind: no per-layer inputs, no shared keys) with its own assistant."""
    from tiny import GEMMA4, make_tiny_gemma4_assistant

    root = tmp_path_factory.mktemp("gemma4")
    target = make_tiny(root / "target", "gemma4_text", seed=27, **GEMMA4)
    unified = make_tiny(root / "unified-target", "gemma4_unified_text", seed=28, **{
        k: v for k, v in GEMMA4.items() if k not in ("vocab_size_per_layer_input", "hidden_size_per_layer_input",
                                                      "use_double_wide_mlp", "num_kv_shared_layers")})
    return {"target": target, "clustered": make_tiny_gemma4_assistant(root / "clustered", target, seed=1),
            "dense": make_tiny_gemma4_assistant(root / "dense", target, seed=2, ordered=False,
                                                layer_types=("sliding_attention", "sliding_attention",
                                                             "full_attention")),
            "unified-target": unified, "unified": make_tiny_gemma4_assistant(root / "unified", unified, seed=3)}


def reference_assistant(path, target_path, ids: list[int], chain: list[int]) -> torch.Tensor:
    """The assistant's logits after the committed ``ids`` and after each token of ``chain``, as
    transformers' Gemma 4 candidate generator drafts after a prefill: the target's keys and
    values of ``ids[:-1]`` and its last hidden state there, the last id at its position, each
    draft fed with the assistant's previous output at that same position."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_path).eval()
    assistant = AutoModelForCausalLM.from_pretrained(path).eval()
    out = target(torch.tensor([ids[:-1]]), output_hidden_states=True, return_shared_kv_states=True)
    hidden, token, logits = out.hidden_states[-1][:, -1:], ids[-1], []
    for step in range(len(chain) + 1):
        embedding = target.get_input_embeddings()(torch.tensor([[token]]))
        o = assistant(inputs_embeds=torch.cat([embedding, hidden], dim=-1), position_ids=torch.tensor([[len(ids) - 1]]),
                      shared_kv_states=out.shared_kv_states)
        logits.append(o.logits[0, -1])
        if step < len(chain):
            hidden, token = o.last_hidden_state, chain[step]
    return torch.stack(logits)


@pytest.mark.parametrize("name", ["clustered", "dense", "unified"])
@torch.inference_mode()
def test_gemma4_assistant_drafts_as_transformers(gemma4_dirs, name):
    """A Gemma 4 assistant's drafts, chains and trees, equal transformers' candidate generator's
    (``assert_drafts_as``: its prompt is past the target's window, where the windowed layers
    attend over the last window + 1 rows)."""
    from specdec.runtime.eagle import Gemma4Assistant

    target_path = gemma4_dirs["unified-target" if name == "unified" else "target"]
    llm = LLM(str(target_path), draft=str(gemma4_dirs[name]), device="cpu",
              speculative=SpecConfig(method="mtp", draft_quantization="none"))
    head, target = llm.draft.runtime, llm.target.runtime
    assert isinstance(head, Gemma4Assistant) and llm.spec.method == "mtp" and head.embed is target.embed
    assert_drafts_as(lambda ids, chain: reference_assistant(gemma4_dirs[name], target_path, ids, chain), head, target)


@pytest.mark.parametrize("name,topk", [("clustered", 1), ("clustered", 2), ("dense", 1), ("unified", 2)])
def test_greedy_with_a_gemma4_assistant_equals_the_target_alone(gemma4_dirs, name, topk):
    """Greedy decoding drafting with a Gemma 4 assistant (method draft with one becomes mtp; vLLM's
    speculative config names it; chains and trees, three requests in one batch, prompts
    prefilled in chunks, int8 on the CPU) gives the target's own tokens, and every assistant
    forward over committed tokens in the engine (its target's rows attached) gives
    transformers' first draft after them; sampled requests repeat with their seed."""
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    target = str(gemma4_dirs["unified-target" if name == "unified" else "target"])
    want = [o.token_ids for o in LLM(target, device="cpu").generate(PROMPTS, sp)]
    spec = SpecConfig(method="draft", num_draft_tokens=3, tree_topk=topk, draft_quantization="none") if topk == 1 \
        else SpecConfig.from_vllm({"method": "mtp", "model": str(gemma4_dirs[name]), "num_speculative_tokens": 3},
                                  tree_topk=topk)[0]
    llm = LLM(target, draft=str(gemma4_dirs[name]), device="cpu", chunked_prefill_size=8, speculative=spec)
    assert llm.spec.method == "mtp" and isinstance(llm.engine.drafters["draft"], EagleDrafter)
    calls = recording(llm)
    outs = llm.generate(PROMPTS, sp)
    assert [o.token_ids for o in outs] == want
    assert all(o.metrics["drafted_tokens"] > 0 for o in outs)
    assert len(calls) > 8
    if spec.draft_quantization == "none":
        for ids, row in calls:
            torch.testing.assert_close(row, reference_assistant(gemma4_dirs[name], target, ids, [])[0], **CLOSE)
    sampled = SamplingParams(max_tokens=16, temperature=1.0, seed=3, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], sampled)] == \
        [o.token_ids for o in llm.generate(PROMPTS[:2], sampled)]


def test_gemma4_assistant_refusals(gemma4_dirs, dirs):
    """A Gemma 4 assistant drafts for a Gemma 4 target on the torch runtime alone."""
    with pytest.raises(ValueError, match="drafts for a Gemma 4 target"):
        LLM(str(dirs["target"]), draft=str(gemma4_dirs["dense"]), device="cpu", speculative=SpecConfig(method="mtp"))
    with pytest.raises(ValueError, match="a Gemma 4 assistant over the target's own keys and values on specdec's "
                                         "torch runtime: not on backend 'hf'"):
        LLM(str(gemma4_dirs["target"]), draft=str(gemma4_dirs["dense"]), device="cpu", backend="hf",
            speculative=SpecConfig(method="mtp"))
