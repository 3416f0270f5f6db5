"""The llama.cpp runtime on the embedded SmolLM2-135M-Instruct GGUF: logits against
llama-cpp-python's own evaluation and the torch runtime on the same file, rewind, ragged
batches, trees through sequence ids, and greedy speculation equal to llama.cpp's own plain
decoding.

llama.cpp's batched evaluation is not bit-identical to one-token evaluation in general
(other kernels from 64 tokens per forward, other rounding when a sequence's cells are out of
order), so greedy outputs may part at a near-tie: a divergence passes only where the
target's top-1 / top-2 logit gap there is below ``NEAR_TIE`` (and it is printed); anywhere
else it fails. On this model and these prompts none happens: every output is identical.
"""
import pytest
import torch

pytest.importorskip("llama_cpp")

from specdec import LLM, SamplingParams, SpecConfig  # noqa: E402
from specdec.runtime import load_model  # noqa: E402
from specdec.tree import DraftTree  # noqa: E402

pytestmark = pytest.mark.real

NEAR_TIE = 1e-2  # logits; a flip at a larger gap is a bug
TEXTS = (
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. Monday, Tuesday,",
    "A hash map is a data structure that",
)
N = 24


@pytest.fixture(scope="module")
def lc():
    return load_model(None, backend="llamacpp")


@pytest.fixture(scope="module")
def tt():
    """The same GGUF, dequantized, on the torch runtime (fp32)."""
    return load_model(None, quantize="none")


@pytest.fixture(scope="module")
def prompts(lc):
    return [LLM(lc, max_batch_size=1).encode(t) for t in TEXTS]


def close(a: torch.Tensor, b: torch.Tensor, what: str, tol: float = 1e-3) -> None:
    """Two llama.cpp evaluations of the same rows: the same logits (in fact bit-identical here,
    as long as no forward has 64 tokens or more, see ``LlamaCppCache``)."""
    diff = (a - b).abs().max().item()
    print(f"{what}: max |logit diff| {diff:.2e}")
    assert diff < tol, (what, diff)
    assert torch.equal(a.argmax(-1), b.argmax(-1)), what


def fresh(lc, ids: list[int]) -> torch.Tensor:
    """Logits ``[vocab]`` after ``ids``, from a new cache."""
    return lc.runtime.forward(lc.runtime.new_cache(1), [0], [ids], last_only=True)[0]


def test_logits_match_llama_cpp_python_and_torch(lc, tt, prompts):
    import numpy as np
    from llama_cpp import Llama

    from specdec.runtime.loading import default_model_path

    ids = prompts[0]
    ours = lc.runtime.forward(lc.runtime.new_cache(1), [0], [ids])[0]  # [T, vocab]
    assert ours.shape == (len(ids), lc.runtime.vocab_size) and ours.dtype == torch.float32
    ll = Llama(default_model_path(), n_ctx=256, n_threads=1, flash_attn=True, logits_all=True, verbose=False,
               type_k=8, type_v=1)  # GGML_TYPE_Q8_0 K, F16 V: the KV cache of an exact runtime
    ll.eval(ids)
    close(ours, torch.from_numpy(np.array(ll.scores[: len(ids)])), "vs llama-cpp-python's Llama.eval")
    ref = tt.runtime.forward(tt.runtime.new_cache(1), [0], [ids])[0]
    diff = (ours - ref).abs()
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"llama.cpp vs torch (SmolLM2 Q4_1 dequantized, fp32): max |logit diff| {diff.max():.2f}, "
          f"mean {diff.mean():.3f}, argmax agreement {agree:.1%} over {len(ids)} positions")
    assert agree >= 0.9 and diff.mean() < 0.5  # llama.cpp quantizes activations to 8 bits


def test_rewind_then_continue_equals_fresh(lc, prompts):
    rt, ids = lc.runtime, prompts[0]
    cache = rt.new_cache(2)
    rt.forward(cache, [1], [ids])
    cache.rewind(1, 10)
    assert cache.lengths[1] == 10
    out = rt.forward(cache, [1], [ids[10:20]])[0]  # [10, vocab]
    ref_cache = rt.new_cache(1)
    rt.forward(ref_cache, [0], [ids[:10]])
    close(out, rt.forward(ref_cache, [0], [ids[10:20]])[0], "rewind then continue")
    cache.rewind(1, 0)
    close(rt.forward(cache, [1], [ids[:5]], last_only=True)[0], fresh(lc, ids[:5]), "rewind to 0")


def test_ragged_batch_equals_single(lc, prompts):
    rt = lc.runtime
    prompts = [p[-20:] for p in prompts][:2] + [prompts[2][-9:]]  # < 64 tokens: the same kernels
    cache = rt.new_cache(3)
    last = rt.forward(cache, [2, 0, 1], prompts, last_only=True)  # [3, vocab]
    for b, ids in enumerate(prompts):
        close(last[b], fresh(lc, ids), f"ragged prefill, sequence {b}")
    steps = [[11, 12, 13], [21], [31, 32]]
    out = rt.forward(cache, [2, 0, 1], steps)  # [3, 3, vocab]
    assert out.shape == (3, 3, rt.vocab_size) and cache.lengths == [len(prompts[1]) + 1,
                                                                      len(prompts[2]) + 2, len(prompts[0]) + 3]
    for b, (ids, step) in enumerate(zip(prompts, steps)):
        single = rt.new_cache(1)
        rt.forward(single, [0], [ids])
        close(out[b, : len(step)], rt.forward(single, [0], [step])[0], f"ragged step, sequence {b}")


def chain_logits(lc, prefix: list[int], chain: list[int]) -> torch.Tensor:
    cache = lc.runtime.new_cache(1)
    lc.runtime.forward(cache, [0], [prefix])
    return lc.runtime.forward(cache, [0], [chain])[0]  # [len(chain), vocab]


def test_tree_equals_chains_and_keep(lc, prompts):
    """Target verification: root + two branches of two in one chunk (siblings share positions)."""
    rt, ids = lc.runtime, prompts[1]
    prefix, root = ids[:-1], ids[-1]
    a, b, a1, b1 = 330, 1127, 2745, 28
    tree = DraftTree([root, a, b, a1, b1], [-1, 0, 0, 1, 2])
    cache = rt.new_cache(2)
    rt.forward(cache, [1], [prefix])
    out = rt.forward(cache, [1], [tree.tokens], positions=[tree.positions(len(prefix))],
                     chunk_masks=[tree.mask()])[0]  # [5, vocab]
    close(out[[0, 1, 3]], chain_logits(lc, prefix, [root, a, a1]), "tree path a")
    close(out[[0, 2, 4]], chain_logits(lc, prefix, [root, b, b1]), "tree path b")
    cache.keep(1, len(prefix), [0, 2, 4])
    assert cache.lengths[1] == len(ids) + 2 and not cache.tail[1]
    close(rt.forward(cache, [1], [[42, 43]])[0], chain_logits(lc, ids + [b, b1], [42, 43]), "keep then continue")


def test_tree_fed_by_depth_and_keep(lc, prompts):
    """The draft-model tree drafter's feed: one depth per forward, masked over the cached depths."""
    rt, ids = lc.runtime, prompts[2]
    a, b, a1, b1 = 330, 1127, 2745, 28
    L = len(ids)
    cache = rt.new_cache(1)
    rt.forward(cache, [0], [ids])
    d1 = rt.forward(cache, [0], [[a, b]], positions=[[L, L]], chunk_masks=[torch.eye(2, dtype=torch.bool)])[0]
    mask = torch.tensor([[1, 0, 1, 0], [0, 1, 0, 1]], dtype=torch.bool)  # [2 new, 2 cached + 2 new]
    d2 = rt.forward(cache, [0], [[a1, b1]], positions=[[L + 1, L + 1]], chunk_masks=[mask])[0]
    close(torch.stack([d1[0], d2[0]]), chain_logits(lc, ids, [a, a1]), "fed tree path a")
    close(torch.stack([d1[1], d2[1]]), chain_logits(lc, ids, [b, b1]), "fed tree path b")
    cache.keep(0, L, [1, 3])
    close(rt.forward(cache, [0], [[42]])[0], chain_logits(lc, ids + [b, b1], [42]), "fed keep then continue")
    cache.rewind(0, L)  # and a rewind drops a partly kept tree
    rt.forward(cache, [0], [[a]], positions=[[L]], chunk_masks=[torch.ones(1, 1, dtype=torch.bool)])
    cache.rewind(0, L)
    close(rt.forward(cache, [0], [[b]])[0, 0], fresh(lc, ids + [b]), "tree rows rewound")


def test_gguf_end_of_generation_tokens(lc, tt):
    """A GGUF's generation ends where llama.cpp's does, on either runtime: its eos and the
    end-of-text, end-of-turn and fill-in-the-middle markers (SmolLM2: <|endoftext|>,
    <|im_end|>, <reponame>), not only the one eos id its own generation config names."""
    vocab = lc.runtime.lib.llama_model_get_vocab(lc.runtime.model)
    eog = {i for i in range(lc.runtime.vocab_size) if lc.runtime.lib.llama_vocab_is_eog(vocab, i)}
    assert lc.eos_ids == tt.eos_ids == eog == {0, 2, 4}
    for model in (lc, tt):  # <|endoftext|> ends a completion
        o = LLM(model).generate("def add(a, b):", SamplingParams(max_tokens=8, logit_bias={0: 100}))[0]
        assert o.token_ids == [0] and o.finish_reason == "stop"


def test_tree_too_big_for_the_batch_refused_at_load(lc):
    """llama.cpp's sequence ids bound the tree rows per slot (32 alone, 30 each with 8 slots):
    a tree that only fits a smaller batch is refused when the LLM is made, not when the batch
    fills (the verify forward needs its root and nodes; a draft tree its fed frontiers)."""
    for depth, nodes, batch, fits in ((4, 29, 8, True), (4, 30, 8, False), (4, 31, 1, True), (4, 32, 1, False),
                                      (12, 8, 1, False)):  # 11 fed depths of 4 nodes
        spec = SpecConfig(method="self", num_draft_tokens=depth, tree_topk=4, tree_nodes=nodes)
        if fits:
            LLM(lc, max_batch_size=batch, speculative=spec)
        else:
            with pytest.raises(ValueError, match="tree rows per slot"):
                LLM(lc, max_batch_size=batch, speculative=spec)


def decode_sizes(rt, monkeypatch) -> list[int]:
    """Record the row count of each ``llama_decode`` the runtime makes (in this test)."""
    sizes, decode = [], rt._decode

    def counted(cache, tokens, *args):
        sizes.append(len(tokens))
        return decode(cache, tokens, *args)

    monkeypatch.setattr(rt, "_decode", counted)
    return sizes


@pytest.fixture(scope="module")
def pieces(lc):
    """The same GGUF on a second runtime that feeds continuations in pieces of at most 2 rows
    (its checked limit is larger, so pieces of 2 are exact as well)."""
    model = load_model(None, backend="llamacpp")
    assert model.runtime.exact and lc.runtime.max_rows >= 2
    model.runtime.max_rows = 2
    return model


def test_continuations_go_in_exact_pieces(lc, pieces, prompts, monkeypatch):
    """Verification's shape: a prompt goes whole and alone (two prompts: two decodes, each
    with the logits of the prompt alone), a continuation of 5 or of 3 + 2 (a batch) goes in
    balanced pieces of at most ``max_rows``, with one-row decoding's logits, and a tree of 5
    in pieces still sees exactly its ancestors."""
    from specdec.runtime.llamacpp import ROW_CHECKS

    assert lc.runtime.max_rows in (1,) + ROW_CHECKS  # found at load (this machine: see the README)
    rt, ids = pieces.runtime, prompts[1]
    sizes = decode_sizes(rt, monkeypatch)
    cache = rt.new_cache(2)
    first = rt.forward(cache, [0, 1], [ids, ids[:-3]], last_only=True)  # [2, vocab]
    assert sizes == [len(ids), len(ids) - 3]  # prompts: one llama_decode each
    assert torch.equal(first[0], fresh(lc, ids)) and torch.equal(first[1], fresh(lc, ids[:-3]))
    chain = [330, 1127, 2745, 28, 42]
    out = rt.forward(cache, [0], [chain])[0]  # [5, vocab] in pieces 1 + 2 + 2
    assert sizes[2:] == [1, 2, 2]
    ref = lc.runtime.new_cache(1)
    lc.runtime.forward(ref, [0], [ids])
    one = torch.cat([lc.runtime.forward(ref, [0], [[t]])[0] for t in chain])  # [5, vocab]
    assert torch.equal(out, one)
    batch = rt.forward(cache, [1, 0], [ids[-3:], [7, 8]])  # [2, 3, vocab]: 5 rows, 3 pieces
    assert sizes[5:] == [1, 2, 2]
    close(batch[0], chain_logits(lc, ids[:-3], ids[-3:]), "batched pieces, sequence 1")
    close(batch[1, :2], chain_logits(lc, ids + chain, [7, 8]), "batched pieces, sequence 0")
    root, a, b, a1, b1 = ids[-1], 330, 1127, 2745, 28
    tree = DraftTree([root, a, b, a1, b1], [-1, 0, 0, 1, 2])
    cache.rewind(0, len(ids) - 1)
    out = rt.forward(cache, [0], [tree.tokens], positions=[tree.positions(len(ids) - 1)],
                     chunk_masks=[tree.mask()])[0]  # [5, vocab]
    close(out[[0, 1, 3]], chain_logits(lc, ids[:-1], [root, a, a1]), "tree in pieces, path a")
    close(out[[0, 2, 4]], chain_logits(lc, ids[:-1], [root, b, b1]), "tree in pieces, path b")


def test_greedy_speculation_in_pieces_equals_plain(pieces, lc, prompts, plain):
    """n-gram chains of 6 rows per sequence, three sequences at once, fed 2 rows at a time."""
    llm = LLM(pieces, speculative=SpecConfig(method="ngram", num_draft_tokens=5), max_batch_size=3)
    for i, (p, out, ref) in enumerate(zip(prompts, generate(llm, prompts, 3), plain[3])):
        assert_same_greedy(lc, p, out, ref, f"ngram in pieces, prompt {i}")


def test_row_limit_is_cached_and_drafts_are_exact_too(monkeypatch, tmp_path, lc):
    """``max_rows`` is checked once per file, threads and machine, then read back; a draft
    model is loaded exact as well (its proposals then do not depend on the batch)."""
    import json

    from specdec.cost import cost_key
    from specdec.runtime import llamacpp

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(llamacpp, "exact_rows", lambda rt: calls.append(rt) or 5)
    first, second = (load_model(None, backend="llamacpp") for _ in range(2))
    assert first.runtime.max_rows == 5 and second.runtime.max_rows == 5 and len(calls) == 1
    (entry,) = json.loads((tmp_path / "llamacpp_rows.json").read_text()).items()
    assert "threads=" in entry[0] and entry[1] == 5
    assert "max-rows=5" in cost_key(first)
    llm = LLM(lc, draft=str(lc.runtime.gguf), speculative=SpecConfig(method="draft"), backend="llamacpp")
    assert lc.runtime.exact and llm.draft.runtime.exact
    # --no-repack reaches both models' runtimes and keys its own row check and cost curve
    from specdec.cli import build_parser, make_llm

    args = build_parser().parse_args(["generate", "--backend", "llamacpp", "--no-repack", "--method", "draft",
                                      "--draft", str(lc.runtime.gguf), "--prompt", "hi"])
    llm = make_llm(args)
    assert first.runtime.repack and not llm.target.runtime.repack and not llm.draft.runtime.repack
    assert llm.target.runtime.max_rows == 5 and len(calls) == 2 and cost_key(llm.target) != cost_key(first)


def test_row_check_sees_long_context_kernels():
    """With llama.cpp's F16 KV cache, one row's attention is split over the threads from 512
    cached cells on (several rows take all keys at once): a check after a short context alone
    misses that; the check after the long one finds it. The exact runtime's Q8_0 K cache has
    no such switch."""
    from specdec.runtime.llamacpp import ROW_CONTEXTS, LlamaCppRuntime, exact_rows
    from specdec.runtime.loading import gguf_file

    f16 = LlamaCppRuntime(gguf_file(None), threads=2, exact=False)
    assert max(ROW_CONTEXTS) > 256 and exact_rows(f16, (min(ROW_CONTEXTS),)) >= 2
    assert exact_rows(f16) == 1
    assert exact_rows(LlamaCppRuntime(gguf_file(None), threads=2)) >= 2


def test_bad_inputs(lc, prompts, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="gguf"):
        load_model(str(tmp_path), backend="llamacpp")
    with pytest.raises(ValueError, match="cpu"):
        load_model(None, device="cuda", backend="llamacpp")
    rt = lc.runtime
    cache = rt.new_cache(1)
    rt.forward(cache, [0], [prompts[0][:4]])
    free = len(cache.free_seqs)
    future = torch.tensor([[True, True], [False, True]])  # row 0 sees a later row
    with pytest.raises(ValueError, match="tree-shaped"):
        rt.forward(cache, [0], [[5, 6]], positions=[[4, 5]], chunk_masks=[future])
    assert cache.lengths == [4] and len(cache.free_seqs) == free  # nothing leaked


def test_max_model_len_sets_the_slot_size():
    """``max_model_len`` is llama.cpp's context per slot (default 4096); its KV buffer holds
    ``max_batch_size`` of them; beyond the model's training context it is refused."""
    llm = LLM(None, backend="llamacpp", max_model_len=6000, max_batch_size=2, speculative=SpecConfig(method="ngram"))
    assert llm.target.runtime.max_context == llm.context_window == 6000
    assert llm.engine.cache.size >= 2 * 6000
    prompt = {"prompt_token_ids": [1] * 4100}  # longer than the default slot
    assert len(llm.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids) == 4
    with pytest.raises(ValueError, match="exceeds the model's context of 8192 tokens$"):
        LLM(None, backend="llamacpp", max_model_len=9000)
    with pytest.raises(ValueError, match=r"of 6000 tokens \(llama.cpp slots .* with up to 8192\)"):
        LLM(llm.target, max_model_len=7000)  # a loaded model keeps its slot size
    with pytest.raises(ValueError, match="does not exist"):
        LLM("/no/such/model.gguf", backend="llamacpp")


def assert_same_greedy(lc, prompt: list[int], out: list[int], ref: list[int], what: str) -> int:
    """``out == ref``, or they part where the target's top-2 logit gap is a near-tie (then only
    the common prefix is compared). Returns the number of such flips (0 or 1)."""
    j = next((i for i, (x, y) in enumerate(zip(out, ref)) if x != y), None)
    if j is None:
        assert len(out) == len(ref), what
        return 0
    top = fresh(lc, prompt + ref[:j]).topk(2).values
    gap = (top[0] - top[1]).item()
    print(f"{what}: near-tie flip at output token {j}, logit gap {gap:.2e}")
    assert gap < NEAR_TIE, f"{what}: outputs part at token {j} with logit gap {gap:.3f}"
    return 1


def generate(llm, prompts, batch: int) -> list[list[int]]:
    """Greedy outputs, all prompts as one batch or one at a time (so that the prefills, which
    llama.cpp evaluates with other kernels past 64 tokens, are the same as plain decoding's)."""
    sp, reqs = SamplingParams(max_tokens=N), [{"prompt_token_ids": p} for p in prompts]
    outs = llm.generate(reqs, sp) if batch == 3 else [llm.generate(r, sp)[0] for r in reqs]
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def plain(lc, prompts):
    llm = LLM(lc, max_batch_size=3)
    return {batch: generate(llm, prompts, batch) for batch in (1, 3)}


SPECS = {
    "ngram": SpecConfig(method="ngram", num_draft_tokens=4),
    "self": SpecConfig(method="self", num_draft_tokens=3),
    "draft": SpecConfig(method="draft", num_draft_tokens=4),
    "ngram-tree": SpecConfig(method="ngram", num_draft_tokens=4, tree_topk=2),
    "self-tree": SpecConfig(method="self", num_draft_tokens=3, tree_topk=2),  # fed depth by depth
}


@pytest.mark.parametrize("name,batch", [("ngram", 1), ("ngram", 3), ("self", 1), ("self", 3), ("draft", 1),
                                        ("draft", 3), ("ngram-tree", 3), ("self-tree", 1)])
def test_greedy_speculation_equals_plain(lc, prompts, plain, name, batch):
    spec = SPECS[name]
    llm = LLM(lc, draft=lc if spec.method == "draft" else None, speculative=spec, max_batch_size=3)
    outs = generate(llm, prompts, batch)
    flips = sum(assert_same_greedy(lc, p, out, ref, f"{name} batch {batch} prompt {i}")
                for i, (p, out, ref) in enumerate(zip(prompts, outs, plain[batch])))
    assert flips <= 1
    if spec.method == "self" and spec.tree_topk == 1:  # drafts by the same llama.cpp model
        assert llm.last_run_metrics.to_dict()["acceptance_rate"] > 0.9


def test_torch_draft_for_llamacpp_target(lc, tt, prompts, plain):
    """Per-model backends: a llama.cpp target with the torch runtime drafting."""
    llm = LLM(lc, draft=tt, speculative=SpecConfig(method="draft", num_draft_tokens=4), max_batch_size=3)
    for i, (p, out, ref) in enumerate(zip(prompts, generate(llm, prompts, 3), plain[3])):
        assert_same_greedy(lc, p, out, ref, f"torch draft prompt {i}")
    assert llm.last_run_metrics.to_dict()["acceptance_rate"] > 0.5


def test_seeded_draws_with_a_llamacpp_draft_do_not_depend_on_the_batch(lc):
    """A seeded sampled request drafting with a llama.cpp draft model draws the same tokens
    alone, beside another request, and after other requests (the draft is exact, so its q
    does not depend on the batch or on where its cache's cells lie)."""
    llm = LLM(lc, draft=str(lc.runtime.gguf), speculative=SpecConfig(method="draft", num_draft_tokens=3),
              backend="llamacpp", max_batch_size=2)
    sp = SamplingParams(max_tokens=24, temperature=0.9, seed=1234)
    other = SamplingParams(max_tokens=30, temperature=0.7)
    prompt, second = TEXTS[2], TEXTS[0]
    runs = [llm.generate(batch, [sp, other][: len(batch)])[0].token_ids
            for batch in ([prompt], [prompt, second], [prompt], [prompt], [prompt, second], [prompt])]
    assert all(r == runs[0] for r in runs)


def test_bench_on_llamacpp(tmp_path, monkeypatch):
    """``specdec bench --backend llamacpp``: specdec on llama.cpp side by side with
    llama-cpp-python's own plain decoding and prompt lookup; each checked against its own
    family's plain decoding."""
    import json

    from specdec.cli import main
    from specdec.runtime.llamacpp import LlamaCppRuntime
    from specdec.runtime.loading import default_model_path

    monkeypatch.setenv("SPECDEC_COST_CACHE", str(tmp_path / "costs.json"))
    # llama.cpp ends generation at more tokens than the model's config names (Qwen2.5's vocabulary
    # has a "</s>", 128247): the bench's llama.cpp family stops at them too
    eog_ids = LlamaCppRuntime.eog_ids
    monkeypatch.setattr(LlamaCppRuntime, "eog_ids", lambda self: eog_ids(self) | {self.vocab_size - 1})
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "edit-a", "kind": "completion", "prompt": TEXTS[1]}) + "\n"
                       + json.dumps({"id": "comp-b", "kind": "completion", "prompt": TEXTS[0]}) + "\n")
    gguf, out = default_model_path(), tmp_path / "out"
    methods = "specdec-plain,specdec-ngram+cost,specdec-draft,llamacpp-plain,llamacpp-lookup"
    code = main(["bench", "--backend", "llamacpp", "--model", gguf, "--draft", gguf, "--threads", "1",
                 "--prompts-file", str(prompts), "--methods", methods, "--max-new-tokens", "12",
                 "--out", str(out)])
    assert code == 0
    report = json.loads((out / "bench.json").read_text())
    s = report["summary"]
    assert report["config"]["references"] == {
        "specdec-plain": "specdec-plain", "specdec-ngram+cost": "specdec-plain", "specdec-draft": "specdec-plain",
        "llamacpp-plain": "llamacpp-plain", "llamacpp-lookup": "llamacpp-plain"}
    assert all(x["diverged"] == 0 for x in s.values())
    assert s["llamacpp-plain"]["target_forwards"] == 24  # one prefill + 11 decode forwards per prompt
    assert s["llamacpp-lookup"]["target_forwards"] < 24 and s["llamacpp-lookup"]["acceptance_rate"] > 0
    # the same file drafting for itself (loaded again as a draft)
    assert s["specdec-draft"]["acceptance_rate"] > 0.7
    assert s["specdec-ngram+cost"]["vs_llamacpp_plain_median"] > 0
    for m in ("llamacpp-plain", "llamacpp-lookup"):  # time to the first token llama-cpp-python yields
        for rec in report["per_prompt"][m]:
            assert all(0 < t < max(rec["seconds"]) for t in rec["ttft_s"]) and rec["decode_tokens_per_s"] > 0
    md = (out / "bench.md").read_text()
    assert "speed relative to llamacpp-plain" in md and "llama-cpp-python" in md
    # sampled: llama-cpp-python draws with the seed (its top_k 40 / min_p 0.05 defaults off)
    code = main(["bench", "--backend", "llamacpp", "--model", gguf, "--threads", "1", "--prompts-file", str(prompts),
                 "--methods", "specdec-plain,llamacpp-plain", "--max-new-tokens", "12", "--temperature", "2",
                 "--repeats", "2", "--limit", "1", "--out", str(tmp_path / "sampled")])
    assert code == 0
    sampled = json.loads((tmp_path / "sampled" / "bench.json").read_text())["per_prompt"]
    for m in ("specdec-plain", "llamacpp-plain"):
        assert sampled[m][0]["token_ids"] != report["per_prompt"][m][0]["token_ids"], m  # not greedy


def test_a_new_prompt_frees_only_the_parked_cells_it_refills(lc, prompts):
    """A request starting beside running ones frees at most its prompt's length of parked
    cells (its slot's first, then other slots'): the prompt refills them all, so no free cell
    is left below the running sequences' newest cells for their next tokens (which would then
    be attended out of order: on Qwen2.5-Coder-1.5B, 6 of 24 requests of a churn run parted
    from their alone output before). With no other slot running, every parked cell goes."""
    rt, ids = lc.runtime, prompts[0]
    n, cache = len(ids), rt.new_cache(3)

    def parked():
        return [len(p) for p in cache.parked]

    def finish(slot):  # a whole request: the prompt, one more token, then the end (cells parked)
        rt.forward(cache, [slot], [ids])
        rt.forward(cache, [slot], [[5]])
        cache.rewind(slot, 0)

    finish(1)
    assert parked() == [0, n + 1, 0]
    finish(2)  # nothing else running: all of slot 1's parked cells go
    assert parked() == [0, 0, n + 1]
    rt.forward(cache, [0], [ids[:4]])
    assert parked() == [0, 0, 0]
    finish(1)  # beside slot 0, nothing parked to refill
    assert parked() == [0, n + 1, 0]
    rt.forward(cache, [2], [ids[:3]])  # a 3-token prompt beside slot 0: 3 of slot 1's cells
    assert parked() == [0, n - 2, 0]
    rt.forward(cache, [1], [ids + ids[:4]])  # slot 1's own n - 2, and no more: none are left
    assert parked() == [0, 0, 0]
    close(rt.forward(cache, [0], [[7]])[0], chain_logits(lc, ids[:4], [7]), "slot 0 after others came and went")


def test_rejected_chain_rows_are_freed_only_when_alone(lc, prompts):
    """Rejected drafts of a chain are the slot's newest cells: with no other slot running they
    are freed (the next forward refills them in order, so long requests never reach the
    parking limit, whose freeing would leave holes: at batch 1, n-gram k=8 over 400 tokens of
    Qwen2.5-Coder-1.5B parted from plain decoding at token 345 before); beside a running slot
    they are parked. Either way, continuing gives one-row decoding's logits."""
    rt, ids = lc.runtime, prompts[1]
    cache = rt.new_cache(2)
    rt.forward(cache, [0], [ids])
    rt.forward(cache, [0], [[5, 6, 7]])  # drafts, rejected
    cache.rewind(0, len(ids))
    assert [len(p) for p in cache.parked] == [0, 0]
    close(rt.forward(cache, [0], [[8]])[0], chain_logits(lc, ids, [8]), "after freed drafts")
    rt.forward(cache, [1], [ids[:5]])  # slot 1 runs now
    rt.forward(cache, [0], [[5, 6, 7]])
    cache.rewind(0, len(ids) + 1)
    assert [len(p) for p in cache.parked] == [3, 0]
    close(rt.forward(cache, [0], [[9]])[0], chain_logits(lc, ids, [8, 9])[1:], "after parked drafts")


def test_parked_rows_stay_until_the_buffer_is_full_then_sequences_are_recomputed(lc, prompts):
    """Parked rows are not freed mid-request while the KV buffer has room: freed, they would
    leave holes below running sequences' newest cells (before, a slot parking more than 512
    rows beside another, or with trees, freed them mid-request). When the buffer is full, the
    running sequences' KV is recomputed from their tokens in a cleared buffer, and decoding
    goes on with one-row decoding's logits: beside another slot, and alone after a tree."""
    rt, ids, other = lc.runtime, prompts[0], prompts[1]
    cache = rt.new_cache(2)
    rt.forward(cache, [0], [ids])
    rt.forward(cache, [1], [other])
    gen = list(range(100, 175))
    for t in gen:  # a verify step beside slot 1: t kept, 7 drafts rejected
        n = cache.lengths[0]
        rt.forward(cache, [0], [[t] + [5] * 7])
        cache.rewind(0, n + 1)
    assert len(cache.parked[0]) == 7 * len(gen) > 512 and cache.recomputes == 0
    assert cache.used == len(ids) + 8 * len(gen) + len(other)
    cache.size = cache.used + 1  # the next two rows do not fit
    out = rt.forward(cache, [0, 1], [[9], [8]])  # [2, 1, vocab]
    assert cache.recomputes == 1 and cache.parked == [[], []] and cache.tokens[0] == ids + gen + [9]
    assert cache.used == len(ids) + len(gen) + 1 + len(other) + 1
    close(out[0, 0], chain_logits(lc, ids, gen + [9])[-1], "beside slot 1, recomputed")
    close(out[1, 0], chain_logits(lc, other, [8])[-1], "slot 1, recomputed")

    cache.rewind(1, 0)  # slot 1's request ends (its cells park); slot 0 goes on alone
    L, (r, a, b, a1, b1) = cache.lengths[0], (11, 330, 1127, 2745, 28)
    tree = DraftTree([r, a, b, a1, b1], [-1, 0, 0, 1, 2])
    rt.forward(cache, [0], [tree.tokens], positions=[tree.positions(L)], chunk_masks=[tree.mask()])
    cache.keep(0, L, [0, 2, 4])  # branch a dropped: parked, even alone
    assert [len(p) for p in cache.parked] == [2, len(other) + 1]
    cache.size = cache.used
    out = rt.forward(cache, [0], [[42]])[0, 0]
    assert cache.recomputes == 2 and cache.parked == [[], []]
    close(out, chain_logits(lc, ids, gen + [9, r, b, b1, 42])[-1], "alone after a tree, recomputed")


def test_room_for_trees_is_made_before_a_tree_opens(lc, prompts):
    """A tree's rows cannot be recomputed mid-tree (a draft model feeds a tree a depth a
    forward, and a buffer full then frees parked cells under running sequences), so a forward
    with no tree open recomputes once the buffer lacks room for the tree rows every slot may
    hold beside it."""
    from specdec.runtime.llamacpp import tree_rows

    rt, ids, other = lc.runtime, prompts[0], prompts[1]
    cache = rt.new_cache(2)
    rt.forward(cache, [0], [ids])
    rt.forward(cache, [1], [other])
    n = cache.lengths[0]
    rt.forward(cache, [0], [[7] + [5] * 7])  # beside slot 1: the rejected rows park
    cache.rewind(0, n + 1)
    assert len(cache.parked[0]) == 7 and cache.recomputes == 0
    cache.size = cache.used + 1 + 2 * tree_rows(2) - 1  # the next row fits, the trees beside it do not
    out = rt.forward(cache, [0], [[9]])[0, 0]
    assert cache.recomputes == 1 and cache.parked == [[], []]
    close(out, chain_logits(lc, ids, [7, 9])[-1], "recomputed")


def test_chunked_prefill_goes_whole_and_is_recomputed_alike(pieces, prompts, monkeypatch):
    """Chunks of a chunked prefill (``last_only`` forwards) are whole decodes, each slot alone,
    not continuation pieces; the cache records where they end, a recompute replays them, and
    decoding then goes on with the logits of the same prefill never recomputed. Greedy n-gram
    speculation with a chunked prefill equals plain decoding with the same one."""
    rt, (ids, other) = pieces.runtime, prompts[:2]
    sizes = decode_sizes(rt, monkeypatch)
    cache = rt.new_cache(2)
    for a in (0, 5, 10):
        rt.forward(cache, [0, 1], [ids[a:a + 5], other[a:a + 5]], last_only=True)
    assert sizes == [5] * 6 and cache.prefill_ends == [[5, 10, 15], [5, 10, 15]]
    gen = [100, 101, 102]
    for t in gen:  # verify steps of 4 rows beside slot 1 (pieces of 2), 3 drafts rejected
        n = cache.lengths[0]
        rt.forward(cache, [0], [[t, 5, 5, 5]])
        cache.rewind(0, n + 1)
    assert sizes[6:] == [2, 2] * 3 and cache.prefill_ends[0] == [5, 10, 15]
    del sizes[:]
    cache.size = cache.used + 1  # the next two rows do not fit: recompute
    out = rt.forward(cache, [0, 1], [[9], [8]])  # [2, 1, vocab]
    assert cache.recomputes == 1 and sizes == [5, 5, 5, 1, 2, 5, 5, 5, 2]
    ref = rt.new_cache(2)
    for a in (0, 5, 10):
        rt.forward(ref, [0], [ids[a:a + 5]], last_only=True)
        rt.forward(ref, [1], [other[a:a + 5]], last_only=True)
    one = [rt.forward(ref, [0], [[t]])[0, 0] for t in gen + [9]]
    close(out[0, 0], one[-1], "slot 0 recomputed after a chunked prefill")
    close(out[1, 0], rt.forward(ref, [1], [[8]])[0, 0], "slot 1 recomputed after a chunked prefill")
    cache.rewind(0, 7)  # into the prompt: its recorded ends go too
    assert cache.prefill_ends[0] == [5]

    monkeypatch.undo()
    sp, reqs = SamplingParams(max_tokens=N), [{"prompt_token_ids": p} for p in prompts]
    base = LLM(pieces, max_batch_size=2, chunked_prefill_size=5).generate(reqs, sp)
    llm = LLM(pieces, speculative=SpecConfig(method="ngram", num_draft_tokens=4), max_batch_size=2,
              chunked_prefill_size=5)
    for i, (p, out, ref) in enumerate(zip(prompts, llm.generate(reqs, sp), base)):
        assert_same_greedy(pieces, p, out.token_ids, ref.token_ids, f"chunked prefill, prompt {i}")


def test_prompt_logprobs_chunks_go_whole(pieces, prompts, monkeypatch):
    """A prefill that returns every row (``prefill=True``, for ``prompt_logprobs``) decodes
    each slot's chunk whole and alone and records its end, like a ``last_only`` one; its last
    row is that forward's logits. End to end: the prompt's log-probabilities from chunks of 5
    equal one whole forward's, and the greedy output equals plain decoding's."""
    rt, (ids, other) = pieces.runtime, prompts[:2]
    sizes = decode_sizes(rt, monkeypatch)
    cache, ref = rt.new_cache(2), rt.new_cache(2)
    for a in (0, 5):
        rows = rt.forward(cache, [0, 1], [ids[a:a + 5], other[a:a + 5]], prefill=True)  # [2, 5, vocab]
        last = rt.forward(ref, [0, 1], [ids[a:a + 5], other[a:a + 5]], last_only=True)  # [2, vocab]
        close(rows[:, -1], last, f"every row vs last only, chunk at {a}")
    assert sizes == [5] * 8 and cache.prefill_ends == [[5, 10], [5, 10]]
    monkeypatch.undo()
    whole = torch.log_softmax(rt.forward(rt.new_cache(1), [0], [ids], prefill=True)[0].float(), -1)
    expected = whole[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    sp = SamplingParams(max_tokens=N, prompt_logprobs=0)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    base = LLM(pieces, max_batch_size=2, chunked_prefill_size=5).generate(reqs, SamplingParams(max_tokens=N))
    outs = LLM(pieces, speculative=SpecConfig(method="ngram", num_draft_tokens=4), max_batch_size=2,
               chunked_prefill_size=5).generate(reqs, sp)
    got = torch.tensor([e[t].logprob for t, e in zip(ids[1:], outs[0].prompt_logprobs[1:])])
    close(got, expected, "prompt logprobs in chunks of 5 vs whole")
    for i, (p, out, b) in enumerate(zip(prompts, outs, base)):
        assert_same_greedy(pieces, p, out.token_ids, b.token_ids, f"prompt logprobs, prompt {i}")


def test_prefix_reuse_is_exact(lc):
    """A finished prompt's rows stay in its slot (whole chunks) and a prompt that starts the
    same prefills only the rest: every output token's logprob is bit-identical to a fresh
    engine's, alone, beside another running request, and after a recompute (buffer full)."""
    a = "The quick brown fox jumps over the lazy dog. " * 3
    b = a + "Then it ran far away into the forest and"
    sp = SamplingParams(max_tokens=16, logprobs=0)

    def logprobs(out):
        return [e[t].logprob for t, e in zip(out.token_ids, out.outputs[0].logprobs)]

    fresh = LLM(lc, chunked_prefill_size=5).generate(b, sp)[0]
    beside_ref = LLM(lc, chunked_prefill_size=5).generate("hello there, how are you", sp)[0]
    for method in ("none", "ngram"):
        for case in ("alone", "beside", "recompute"):
            llm = LLM(lc, chunked_prefill_size=5, max_batch_size=2, speculative=SpecConfig(method=method))
            llm.generate([a, "hello there, how are you"] if case == "recompute" else a, sp)
            if case == "recompute":  # rows parked beside the other request fill the buffer
                assert any(llm.engine.cache.parked)
                llm.engine.cache.size = llm.engine.cache.used + 8  # full during the next prefill
            prompts = [b, "hello there, how are you"] if case == "beside" else [b]
            outs = llm.generate(prompts, sp)
            assert outs[0].metrics["cached_prompt_tokens"] == len(llm.encode(a)) // 5 * 5, (method, case)
            assert outs[0].token_ids == fresh.token_ids and logprobs(outs[0]) == logprobs(fresh), (method, case)
            if case == "beside":
                assert outs[1].token_ids == beside_ref.token_ids and logprobs(outs[1]) == logprobs(beside_ref)
            if case == "recompute":
                assert llm.engine.cache.recomputes >= 1


def test_an_idle_slot_lets_a_lone_request_free_its_rejected_rows(lc):
    """A slot that keeps a finished prompt adds no rows until a prompt that starts the same
    comes, so a request running alone beside it still frees its rejected drafts instead of
    parking them (else they would fill the buffer and force recomputes); outputs unchanged."""
    sp = SamplingParams(max_tokens=24, logprobs=0)
    llm = LLM(lc, chunked_prefill_size=5, max_batch_size=2, speculative=SpecConfig(method="ngram"))
    llm.generate("hello there, how are you doing today", sp)
    assert llm.engine.retained and llm.engine.cache.idle == set(llm.engine.retained)
    prompt = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n"
    out = llm.generate(prompt, sp)[0]
    assert out.metrics["drafted_tokens"] > out.metrics["accepted_tokens"]  # some drafts were rejected
    assert not any(llm.engine.cache.parked) and llm.engine.cache.recomputes == 0
    fresh = LLM(lc, chunked_prefill_size=5, speculative=SpecConfig(method="ngram")).generate(prompt, sp)[0]
    assert out.token_ids == fresh.token_ids
    assert [e[t].logprob for t, e in zip(out.token_ids, out.outputs[0].logprobs)] == \
        [e[t].logprob for t, e in zip(fresh.token_ids, fresh.outputs[0].logprobs)]


def test_structured_outputs_on_llamacpp(lc):
    """A JSON schema on the llama.cpp backend: the chat answer parses and follows it, and
    n-gram and self drafting give plain decoding's tokens (the self-draft, under the same
    grammar, has its drafts accepted)."""
    import json

    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}}}
    messages = [{"role": "user", "content": "Describe a fictional cat as a JSON object with name and age."}]
    sp = SamplingParams(max_tokens=48, structured_outputs={"json": schema})
    ref = LLM(lc, max_batch_size=1).chat(messages, sp)[0]
    obj = json.loads(ref.text)
    assert set(obj) == {"name", "age"} and isinstance(obj["age"], int) and ref.finish_reason == "stop"
    for name in ("ngram", "self"):
        out = LLM(lc, speculative=SPECS[name], max_batch_size=1).chat(messages, sp)[0]
        assert out.token_ids == ref.token_ids, name
        if name == "self":
            assert out.metrics["acceptance_rate"] > 0.9


def test_prefix_reuse_after_interleaved_prefills_is_exact(lc):
    """A request decoding while another's prompt prefills in chunks beside it writes cells
    between that prompt's; when it ends alone, its rows sit below the idle slot's kept
    prompt, so they are parked, not freed (freed, a later prompt reusing the kept rows would
    fill those holes below them and attend out of order): the reusing request's logprobs
    equal a fresh engine's bit for bit."""
    system = "You are a helpful assistant. " + "Write a long story about a dragon who learns to code. " * 8
    first, second = system + "\nQuestion: Name three planets.\nAnswer:", system + "\nQuestion: What is a map?\nAnswer:"
    code = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n' * 2
    kw = dict(max_batch_size=2, chunked_prefill_size=32)
    sp = SamplingParams(max_tokens=16, logprobs=0, ignore_eos=True)
    llm = LLM(lc, **kw)
    llm.generate([code, first], [SamplingParams(max_tokens=60, ignore_eos=True), SamplingParams(max_tokens=1)])
    got = llm.generate(second, sp)[0]
    want = LLM(lc, **kw).generate(second, sp)[0]
    assert got.metrics["cached_prompt_tokens"] > 0 and got.token_ids == want.token_ids
    assert [e[t].logprob for t, e in zip(got.token_ids, got.outputs[0].logprobs)] == \
        [e[t].logprob for t, e in zip(want.token_ids, want.outputs[0].logprobs)]
