"""The core checks again on a CUDA device; skipped where there is none (CI has none).

On a GPU machine: ``python3 -m pytest -q tests/test_cuda.py`` (``scripts/gpu/run.sh`` does).
The torch runtime against transformers in float32, CUDA graphs against eager forwards, greedy speculation (self, random draft
model, n-gram, trees; batch 1 and 3) equal to plain decoding in float32 and bfloat16 (and
with chunked prefill and penalties), the
sampling verifier's distribution with a CUDA generator, seeded sampling through the engine,
and the cost model's timing; a packed BitNet's ternary products; LoRA adapters against PEFT.

A verify forward of k+1 rows runs other matrix kernels than a one-row decoding step, so
their logits differ by rounding, and a greedy output may part from plain decoding where the
target's top two logits are tied at the dtype's precision. In bfloat16 that happens on these
tiny models (a tree run on the CPU parted at logits 4.15625 and 4.15625, 0.04 apart in
float32). So a divergence passes only where the plain output's top-2 gap there, from a
fresh forward, is within ``NEAR_TIE`` of its dtype (two bfloat16 steps); anywhere else it
fails.
"""
import numpy as np
import pytest
import torch

from specdec import LLM, SamplingParams, SpecConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = ["Hello world, this is a test of speculative decoding", "abc",
           "The quick brown fox jumps over the lazy dog. The quick brown"]
GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)
NEAR_TIE = {"float32": 1e-4, "bfloat16": 2 ** -6}  # top-2 gap, relative to the top logit


def assert_same_greedy(llm, outs, base, dtype: str, adapters: list[int] | None = None) -> None:
    """Each output equals plain decoding's, or parts from it at a near-tie (see above);
    ``adapters``: each prompt's LoRA adapter's id (held by the runtime), whose logits those are."""
    rt = llm.target.runtime
    for i, (p, o, b) in enumerate(zip(PROMPTS, outs, base)):
        j = next((i for i, (x, y) in enumerate(zip(o.token_ids, b.token_ids)) if x != y), None)
        if j is None:
            assert len(o.token_ids) == len(b.token_ids)
            continue
        cache = rt.new_cache(1)
        if adapters:
            cache.adapters[0] = adapters[i]
        top = rt.forward(cache, [0], [llm.encode(p) + b.token_ids[:j]])[0, -1].topk(2).values
        gap, tol = (top[0] - top[1]).item(), NEAR_TIE[dtype] * max(1.0, top[0].abs().item())
        print(f"{dtype}: near-tie flip at output token {j}, logit gap {gap:.2e}")
        assert gap <= tol, f"{p!r}: parts from plain decoding at token {j}, logit gap {gap:.3g} > {tol:.3g}"


@pytest.fixture(scope="module")
def on_cuda(tiny_dirs):
    """LoadedModel per (tiny checkpoint, dtype) on cuda, loaded once."""
    from specdec.runtime import load_model

    cache = {}

    def get(name, dtype="float32"):
        if (name, dtype) not in cache:
            cache[name, dtype] = load_model(str(tiny_dirs[name]), device="cuda", dtype=dtype)
        return cache[name, dtype]

    return get


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "qwen2moe", "deepseek"])
def test_logits_match_transformers_on_cuda(tiny_dirs, on_cuda, arch):
    from transformers import AutoModelForCausalLM

    rt = on_cuda(arch).runtime
    assert rt.device.type == "cuda" and rt.layers[0]["qkv"].kind == "dense"
    hf = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch]).to("cuda").eval()
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids.cuda()).logits[0]  # [20, vocab]
    cache = rt.new_cache(2)
    ours = torch.cat([rt.forward(cache, [1], [ids[0, :13].tolist()])[0],
                      rt.forward(cache, [1], [ids[0, 13:].tolist()])[0]])
    assert ours.device.type == "cuda"
    assert (ours - ref).abs().max().item() < 1e-3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("method, shape", [("self", None), ("draft", None), ("ngram", None),
                                           ("draft", (2, 3, 5))])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_speculation_equals_plain_on_cuda(on_cuda, dtype, method, shape, batch):
    base = LLM(on_cuda("llama", dtype)).generate(PROMPTS, GREEDY)
    topk, depth, nodes = shape or (1, None, None)
    spec = SpecConfig(method=method, num_draft_tokens=4, tree_topk=topk, tree_depth=depth, tree_nodes=nodes)
    llm = LLM(on_cuda("llama", dtype), draft=on_cuda("draft", dtype) if method == "draft" else None,
              speculative=spec)
    outs = llm.generate(PROMPTS, GREEDY) if batch == 3 else [llm.generate(p, GREEDY)[0] for p in PROMPTS]
    assert_same_greedy(llm, outs, base, dtype)
    if method == "self" and shape is None:
        assert all(o.metrics["acceptance_rate"] == 1.0 for o in outs)


def test_chunked_prefill_and_penalties_on_cuda(on_cuda):
    """Prompts in chunks of 5 and penalised rows (counts on the GPU): self-drafted greedy
    output equals plain decoding of whole prompts with the same penalties."""
    sp = SamplingParams(max_tokens=40, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.3)
    base = LLM(on_cuda("llama"), chunked_prefill_size=0).generate(PROMPTS, sp)
    llm = LLM(on_cuda("llama"), speculative=SpecConfig(method="self", num_draft_tokens=3), chunked_prefill_size=5)
    assert_same_greedy(llm, llm.generate(PROMPTS, sp), base, "float32")


def test_vllm_sampling_fields_on_cuda(on_cuda):
    """min_tokens and stop_token_ids (rows banned on the GPU), logprobs and prompt logprobs
    on cuda (greedy: n is 1, as vLLM's): the self-drafted output equals plain decoding, logprobs and ranks alike; min_p seeded
    sampling accepts every self-drafted token."""
    sp = SamplingParams(max_tokens=30, ignore_eos=True, logprobs=2, min_tokens=10, prompt_logprobs=1)
    out = LLM(on_cuda("llama")).generate(PROMPTS[0], sp)[0].token_ids
    j = next(j for j in range(10, 30) if out[j] not in out[:j])
    sp = SamplingParams(**{**vars(sp), "stop_token_ids": [out[j]]})
    base = LLM(on_cuda("llama")).generate(PROMPTS, sp)
    outs = LLM(on_cuda("llama"), speculative=SpecConfig(method="self", num_draft_tokens=3)).generate(PROMPTS, sp)
    for o, b in zip(outs, base):
        assert [c.token_ids for c in o.outputs] == [c.token_ids for c in b.outputs]
        assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(o.prompt_token_ids)
        assert [list(e) for e in o.prompt_logprobs[1:]] == [list(e) for e in b.prompt_logprobs[1:]]
        for c, r in zip(o.outputs, b.outputs):
            assert [list(e) for e in c.logprobs] == [list(e) for e in r.logprobs]
            assert [e[t].rank for t, e in zip(c.token_ids, c.logprobs)] == [1] * len(c.token_ids)
            assert c.cumulative_logprob == pytest.approx(r.cumulative_logprob, abs=1e-3)
    assert base[0].finish_reason == "stop" and len(base[0].token_ids) == j + 1
    sampled = SamplingParams(max_tokens=20, temperature=1.0, min_p=0.2, seed=2, ignore_eos=True)
    outs = LLM(on_cuda("llama"), speculative=SpecConfig(method="self", num_draft_tokens=3)).generate(PROMPTS, sampled)
    assert all(o.metrics["acceptance_rate"] == 1.0 for o in outs)


def test_prefix_reuse_on_cuda(on_cuda):
    """A finished prompt's KV reused from its slot on the GPU: the same output as from scratch."""
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    llm = LLM(on_cuda("llama"), speculative=SpecConfig(method="self", num_draft_tokens=3), chunked_prefill_size=4)
    llm.generate(PROMPTS[2], sp)
    again = llm.generate(PROMPTS[2] + " and more", sp)[0]
    fresh = LLM(on_cuda("llama"), chunked_prefill_size=4).generate(PROMPTS[2] + " and more", sp)[0]
    assert again.metrics["cached_prompt_tokens"] > 0 and again.token_ids == fresh.token_ids


def test_structured_outputs_on_cuda(on_cuda):
    """A regex on the GPU (masks built on the CPU, applied to CUDA logits): the text matches,
    and self and n-gram drafting give plain decoding's tokens."""
    import re

    sp = SamplingParams(max_tokens=16, structured_outputs={"regex": "[ab]{3}-[0-9]{2}(x|yz)"})
    base = LLM(on_cuda("llama")).generate(PROMPTS, sp)
    assert all(re.fullmatch("[ab]{3}-[0-9]{2}(x|yz)", o.text) for o in base)
    for method in ("self", "ngram"):
        outs = LLM(on_cuda("llama"), speculative=SpecConfig(method=method, num_draft_tokens=3)).generate(PROMPTS, sp)
        assert [o.token_ids for o in outs] == [b.token_ids for b in base], method


def test_cuda_float32_greedy_equals_cpu(loaded, on_cuda):
    """The same tokens on both devices in float32, up to near-ties (other kernels round
    otherwise)."""
    cpu = LLM(loaded("qwen2")).generate(PROMPTS, GREEDY)
    llm = LLM(on_cuda("qwen2"))
    assert_same_greedy(llm, llm.generate(PROMPTS, GREEDY), cpu, "float32")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_equal_eager(tiny_dirs, on_cuda, dtype):
    """Forwards replayed as CUDA graphs (captured on first use of a shape, then replayed with
    new inputs, across rewinds and cache growth) give eager forwards' logits; greedy output of
    plain decoding, chains and trees through graphs equals eager plain decoding's."""
    from specdec.runtime import load_model

    graphed = on_cuda("llama", dtype).runtime
    eager = load_model(str(tiny_dirs["llama"]), device="cuda", dtype=dtype, enforce_eager=True)
    assert graphed.graphs is not None and eager.runtime.graphs is None
    tol = {"float32": 1e-4, "bfloat16": 0.25}[dtype]  # bf16: a few steps of 1/32 at logits of 4-8; a wrong graph errs by ~1
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    caches = graphed.new_cache(2), eager.runtime.new_cache(2)
    steps = [(0, 10), (10, 13), (13, 16), (16, 17), (17, 18), (18, 260), (260, 263), (263, 264),
             (264, 269), (269, 274)]
    for i, (a, b) in enumerate(steps):  # shapes (1, 3), (1, 1), (1, 6): capture, then replay
        # (5 tokens run as 6, the last row padding)
        if i == 4:  # a rollback: the replay writes over rewound rows
            for c in caches:
                c.rewind(1, 15)
            a = 15
        out = [rt.forward(c, [1], [ids[a:b]]) for rt, c in zip((graphed, eager.runtime), caches)]
        assert (out[0] - out[1]).abs().max().item() < tol, (a, b)  # the cache grew at 260
    assert sorted(graphed.graphs.by_cache[caches[0]][2]) == [(1, 1), (1, 3), (1, 6)]  # after growing
    base = LLM(eager).generate(PROMPTS, GREEDY)
    for spec in (SpecConfig(), SpecConfig(method="self", num_draft_tokens=4),
                 SpecConfig(method="ngram", tree_topk=2, num_draft_tokens=3)):
        llm = LLM(on_cuda("llama", dtype), speculative=spec)
        assert_same_greedy(llm, llm.generate(PROMPTS, GREEDY), base, dtype)
    assert graphed.graphs is not None  # no capture failed


@pytest.mark.parametrize("name", ["qwen2moe", "deepseek"])
def test_experts_graphed_in_bfloat16_on_cuda(tiny_dirs, on_cuda, name):
    """A mixture of experts on CUDA (DeepSeek's with latent attention too) runs eagerly in
    float32 (grouped products there sync with the host) and through CUDA graphs in bfloat16
    on Hopper and Blackwell GPUs (none fails to capture); greedy plain decoding, chains and
    trees through the graphs equal eager plain decoding."""
    from specdec.runtime import load_model

    assert on_cuda(name).runtime.graphs is None
    if torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("grouped products sync with the host before Hopper")
    graphed = on_cuda(name, "bfloat16")
    assert graphed.runtime.graphs is not None
    eager = load_model(str(tiny_dirs[name]), device="cuda", dtype="bfloat16", enforce_eager=True)
    base = LLM(eager).generate(PROMPTS, GREEDY)
    for spec in (SpecConfig(), SpecConfig(method="self", num_draft_tokens=4),
                 SpecConfig(method="ngram", tree_topk=2, num_draft_tokens=3)):
        llm = LLM(graphed, speculative=spec)
        assert_same_greedy(llm, llm.generate(PROMPTS, GREEDY), base, "bfloat16")
    assert graphed.runtime.graphs is not None and graphed.runtime.graphs.by_cache  # captured, none failed


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mtp_on_cuda(tmp_path, dtype):
    """A DeepSeek-V3 checkpoint's MTP layer (latent attention, experts) drafts on CUDA, its
    CUDA graphs in bfloat16 on Hopper and Blackwell: greedy chains and trees equal plain
    decoding."""
    from specdec.runtime import load_model

    from tiny import MOE, add_mtp, make_tiny

    path = add_mtp(make_tiny(tmp_path / "deepseek", "deepseek_v3", seed=4, **MOE["deepseek_v3"]), seed=5)
    target = load_model(str(path), device="cuda", dtype=dtype)
    base = LLM(target).generate(PROMPTS, GREEDY)
    for topk in (1, 2):
        llm = LLM(target, speculative=SpecConfig(method="mtp", num_draft_tokens=3, tree_topk=topk))
        assert_same_greedy(llm, llm.generate(PROMPTS, GREEDY), base, dtype)


def test_sampling_verifier_on_cuda_is_lossless():
    """The verifier's tensors and generator on cuda: the first committed token follows p
    (chi-square at the same significance as the CPU tests)."""
    from test_verify_distribution import ALPHA, chi2_pvalue, first_token_counts

    from specdec.sampling import probs_from_logits
    from specdec.verify import verify

    g = torch.Generator().manual_seed(5)
    target_row = torch.randn(12, generator=g) * 2
    q_row = torch.softmax(torch.randn(12, generator=g) * 2, -1)
    sp = SamplingParams(temperature=0.8, top_k=9)
    counts = first_token_counts(verify, target_row, q_row, sp, 10_000, seed=7, device="cuda")
    p = probs_from_logits(target_row[None], sp)[0]
    assert chi2_pvalue(counts, p) > ALPHA, counts / counts.sum()


def test_seeded_sampling_on_cuda(on_cuda):
    sp = SamplingParams(max_tokens=24, temperature=1.0, seed=11, ignore_eos=True)
    a = LLM(on_cuda("llama")).generate(PROMPTS, sp)
    b = LLM(on_cuda("llama"), draft=on_cuda("draft"), speculative=SpecConfig(method="draft")).generate(PROMPTS, sp)
    again = LLM(on_cuda("llama")).generate(PROMPTS, sp)
    assert [o.token_ids for o in a] == [o.token_ids for o in again]  # a seed fixes the draws
    assert all(len(o.token_ids) == 24 for o in a + b)
    tokens = np.array([t for o in a + b for t in o.token_ids])
    assert len(set(tokens.tolist())) > 10  # sampled, not greedy


def test_cost_model_times_cuda_forwards(on_cuda):
    from specdec.cost import measure

    costs = measure(on_cuda("llama").runtime, 6, context=32, repeats=2)
    assert len(costs.seconds) == 6 and all(0 < s < 1 for s in costs.seconds)
    llm = LLM(on_cuda("llama"), speculative=SpecConfig(method="ngram", cost_model=True))
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in LLM(on_cuda("llama")).generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitnet_ternary_on_cuda(tmp_path, dtype):
    """A packed BitNet on a GPU: its ternary products in the model's dtype (``linear.Ternary``, not the
    CPU's integers) give transformers' ``BitLinear`` model's logits there within the GPU's attention
    kernels' rounding (1e-3 in float32; 0.25, as CUDA graphs' test, in bfloat16), and the CPU
    runtime's in float32; greedy decoding through CUDA graphs and under speculation equals plain."""
    from transformers import AutoConfig

    from specdec.runtime import load_model
    from specdec.runtime.loading import Weights
    from specdec.runtime.torch_llama import TorchLlama

    from tiny import bitnet_copy, bitnet_reference, make_tiny

    path = bitnet_copy(make_tiny(tmp_path / "plain", "bitnet", seed=5), tmp_path / "offline")
    rt = TorchLlama(AutoConfig.from_pretrained(path), Weights(path), torch.device("cuda"), dtype)
    assert not rt.layers[0]["qkv"].integers and rt.layers[0]["qkv"].weight.dtype == dtype
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = bitnet_reference(path, dtype).to("cuda")(ids.cuda()).logits[0].float()
    ours = rt.forward(rt.new_cache(1), [0], [ids[0].tolist()])[0]
    tol = 1e-3 if dtype == torch.float32 else 0.25
    assert (ours - ref).abs().max().item() < tol
    if dtype == torch.float32:
        cpu = TorchLlama(AutoConfig.from_pretrained(path), Weights(path), torch.device("cpu"), dtype)
        assert (cpu.forward(cpu.new_cache(1), [0], [ids[0].tolist()])[0] - ours.cpu()).abs().max().item() < tol
    name = str(dtype).removeprefix("torch.")
    model = load_model(str(path), device="cuda", dtype=name)
    base = LLM(load_model(str(path), device="cuda", dtype=name, enforce_eager=True)).generate(PROMPTS, GREEDY)
    for spec in (SpecConfig(), SpecConfig(method="self", num_draft_tokens=4)):
        llm = LLM(model, speculative=spec)
        assert_same_greedy(llm, llm.generate(PROMPTS, GREEDY), base, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_on_cuda(tmp_path, dtype):
    """LoRA adapters on a GPU: an adapted row's logits are PEFT's model's there and a base row's
    beside it the base's (within the attention kernels' rounding, as BitNet's test); greedy
    decoding with adapters a, none, a (a forward with an adapted row runs eagerly: CUDA graphs
    hold no update) under speculation equals plain decoding with them."""
    pytest.importorskip("peft")
    from specdec import LoRARequest
    from specdec.runtime import load_model

    from tiny import lora_reference, make_lora, make_tiny

    base = make_tiny(tmp_path / "base", "llama", seed=5)
    lora = LoRARequest("a", 1, str(make_lora(base, tmp_path / "lora", seed=6)))
    ref = lora_reference(base, lora.lora_path, dtype=dtype).to("cuda")
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        want = ref(input_ids=ids).logits[0].float()
        with ref.disable_adapter():
            plain = ref(input_ids=ids).logits[0].float()
    name = str(dtype).removeprefix("torch.")
    llm = LLM(str(base), device="cuda", dtype=name, enable_lora=True,
              speculative=SpecConfig(method="self", num_draft_tokens=4))
    rt = llm.target.runtime
    assert rt.graphs is not None and rt.lora.acquire(llm.adapter(lora))
    cache = rt.new_cache(2)
    cache.adapters[0] = lora.lora_int_id
    ours = rt.forward(cache, [0, 1], [ids[0].tolist()] * 2)
    rt.lora.release(lora.lora_int_id)
    tol = 1e-3 if dtype == torch.float32 else 0.25
    assert (ours[0] - want).abs().max().item() < tol and (ours[1] - plain).abs().max().item() < tol
    loras = [lora, None, lora]
    eager = LLM(load_model(str(base), device="cuda", dtype=name, enforce_eager=True), enable_lora=True)
    base_out = eager.generate(PROMPTS, GREEDY, lora_request=loras)
    assert_same_greedy(llm, llm.generate(PROMPTS, GREEDY, lora_request=loras), base_out, name, adapters=[1, 0, 1])
