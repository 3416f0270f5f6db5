"""DraftTree structure (mask, positions, retrieve paths) and tree verification."""
import math

import pytest
import torch
from scipy.stats import chisquare

from specdec.config import SamplingParams
from specdec.tree import DraftTree, verify_tree
from specdec.verify import Verdict

GREEDY = SamplingParams()
ALPHA = 1e-3


def rows(*argmax, vocab=8):
    out = torch.full((len(argmax), vocab), -5.0)
    out[torch.arange(len(argmax)), torch.tensor(argmax)] = 5.0
    return out


def test_chain_structure():
    t = DraftTree.from_paths(9, [[1, 2, 3]])
    assert t.depths == [0, 1, 2, 3]
    assert t.positions(10) == [10, 11, 12, 13]
    assert torch.equal(t.mask(), torch.ones(4, 4, dtype=torch.bool).tril())
    assert t.parents == [-1, 0, 1, 2] and t.children == [[1], [2], [3], []]


def test_star_structure():
    t = DraftTree([9, 1, 2, 3], [-1, 0, 0, 0])
    assert t.depths == [0, 1, 1, 1]
    assert t.positions(5) == [5, 6, 6, 6]
    expected = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(t.mask(), expected)
    assert t.children == [[1, 2, 3], [], [], []]


def test_unbalanced_tree_from_paths():
    #   root - 1 - 2 - 3
    #        \     \
    #         4     5
    t = DraftTree.from_paths(9, [[1, 2, 3], [1, 5], [4]])
    assert t.tokens == [9, 1, 2, 3, 5, 4]
    assert t.parents == [-1, 0, 1, 2, 1, 0]
    assert t.depths == [0, 1, 2, 3, 2, 1]
    m = t.mask()
    assert m[3].tolist() == [True, True, True, True, False, False]
    assert m[4].tolist() == [True, True, False, False, True, False]
    assert m[5].tolist() == [True, False, False, False, False, True]
    assert t.children == [[1, 5], [2, 4], [3], [], [], []]


@pytest.mark.parametrize("tokens, parents", [([], []), ([1, 2], [0, -1]), ([1, 2, 3], [-1, 2, 0]),
                                             ([1, 2, 2], [-1, 0, 0])])
def test_invalid_trees(tokens, parents):
    with pytest.raises(ValueError):
        DraftTree(tokens, parents)


def test_greedy_non_first_branch():
    t = DraftTree.from_paths(9, [[1, 2], [3, 4]])  # rows: 9, 1, 2, 3, 4
    # target: after root 3, after 3 -> 4, after 4 -> 6 (bonus)
    v = verify_tree(t, rows(3, 0, 0, 4, 6), GREEDY)
    assert v.tokens == [3, 4, 6] and v.rows == [0, 3, 4] and v.num_accepted == 2


def test_greedy_all_first_children_wrong():
    t = DraftTree.from_paths(9, [[1, 2], [3, 4]])
    v = verify_tree(t, rows(5, 0, 0, 0, 0), GREEDY)
    assert v.tokens == [5] and v.rows == [0] and v.num_accepted == 0


def test_greedy_chain_matches_chain_verifier():
    from specdec.verify import verify

    logits = rows(1, 2, 7, 4)
    t = DraftTree.from_paths(9, [[1, 2, 3]])
    assert verify_tree(t, logits, GREEDY).tokens == verify([1, 2, 3], None, logits, GREEDY).tokens == [1, 2, 7]


def first_token_counts(tree, logits, sp, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(logits.shape[-1])
    for _ in range(n):
        counts[verify_tree(tree, logits, sp, g).tokens[0]] += 1
    return counts


def chi2_pvalue(counts, p):
    keep = p > 0
    assert counts[~keep].sum() == 0
    expected = p[keep] * counts.sum()
    return chisquare(counts[keep].numpy(), expected.numpy()).pvalue


@pytest.mark.parametrize("siblings", [2, 3, 4])
def test_sampling_deterministic_siblings_lossless(siblings):
    g = torch.Generator().manual_seed(siblings)
    logits = torch.randn(1, 8, generator=g) * 1.5
    sp = SamplingParams(temperature=1.0)
    p = torch.softmax(logits[0], -1)
    tree = DraftTree.from_paths(0, [[t] for t in range(1, siblings + 1)])
    full = logits.expand(siblings + 1, 8)
    counts = first_token_counts(tree, full, sp, 20000)
    assert chi2_pvalue(counts, p) > ALPHA


def drawn_siblings_counts(siblings: int, seed: int, rule=verify_tree, n: int = 20000):
    """First-token counts over ``n`` stars of ``siblings`` children drawn from q without
    replacement, verified by ``rule``; and p."""
    g = torch.Generator().manual_seed(seed)
    p_logits = torch.randn(8, generator=g)
    q = torch.softmax(torch.randn(8, generator=g) * 1.5, -1)
    sp = SamplingParams(temperature=1.0)
    counts = torch.zeros(8)
    for _ in range(n):
        kids = torch.multinomial(q, siblings, replacement=False, generator=g).tolist()
        tree = DraftTree([0] + kids, [-1] + [0] * siblings, q=q.expand(siblings + 1, 8))
        counts[rule(tree, p_logits.expand(siblings + 1, 8), sp, g).tokens[0]] += 1
    return counts, torch.softmax(p_logits, -1)


@pytest.mark.parametrize("siblings", [2, 3, 5])
def test_sampling_drawn_siblings_lossless(siblings):
    """Siblings drawn from q without replacement (distinct), each checked against the
    residual and q without the earlier ones: the first token follows p (chi-square)."""
    counts, p = drawn_siblings_counts(siblings, 10 + siblings)
    assert chi2_pvalue(counts, p) > ALPHA


def test_negative_control_drawn_siblings_with_the_iid_rule_is_caught():
    """Checking siblings drawn without replacement against the unchanged q (SpecInfer's rule
    for i.i.d. draws) is biased."""

    def iid_rule(tree, logits, sp, g):
        p, q = torch.softmax(logits[0], -1), tree.q[0]
        residual = p
        for x in tree.tokens[1:]:
            if torch.rand((), dtype=torch.float64, generator=g) * q[x] < residual[x]:
                return Verdict(1, [x])
            residual = (residual - q).clamp_min(0)
            residual = residual / residual.sum()
        return Verdict(0, [int(torch.multinomial(residual, 1, generator=g))])

    counts, p = drawn_siblings_counts(3, 13, iid_rule)
    assert chi2_pvalue(counts, p) < ALPHA


def test_negative_control_no_residual_update_is_caught():
    """Resampling from p (not the residual) after the siblings are rejected is biased."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    p = torch.softmax(logits[0], -1)
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    for _ in range(20000):
        token = None
        for x in (0, 1):  # two deterministic siblings
            if torch.rand((), generator=g) < p[x]:
                token = x
                break
        if token is None:
            token = int(torch.multinomial(p, 1, generator=g))  # wrong: should exclude 0 and 1
        counts[token] += 1
    assert chi2_pvalue(counts, p) < ALPHA


# ---------------------------------------------------------------- engine with trees

from specdec import LLM, SpecConfig  # noqa: E402
from specdec.drafters import Draft  # noqa: E402
from specdec.engine import Engine  # noqa: E402
from specdec.sampling import make_generator  # noqa: E402
from specdec.sequence import Sequence  # noqa: E402

PROMPTS = ["Hello world, this is a test of speculative decoding", "abc",
           "The quick brown fox jumps over the lazy dog. The quick brown"]


class TreeScript:
    """Proposes a tree built by ``fn(seq, k) -> list of token paths``."""

    def __init__(self, fn):
        self.fn = fn

    def propose(self, seqs, ks):
        out = []
        for s, k in zip(seqs, ks):
            paths = [p[:k] for p in self.fn(s) if p[:k]]
            tree = DraftTree.from_paths(s.ids[-1], paths) if paths and k else None
            out.append(Draft(tree.tokens[1:], tree=tree) if tree else Draft([]))
        return out

    def observe(self, seq, num_accepted):
        pass

    def release(self, seq):
        pass


def run(loaded, drafter, prompt, max_new=24):
    target = loaded("llama")
    eng = Engine(target, drafter, SpecConfig(method="ngram", num_draft_tokens=4), max_batch_size=1)
    ids = target.tokenizer(prompt)["input_ids"]
    s = Sequence(1, ids, len(ids), SamplingParams(max_tokens=max_new), make_generator(0, "cpu"), frozenset())
    eng.add(s)
    while eng.has_work:
        eng.step()
    return s


def test_engine_tree_only_non_first_branch_correct(loaded):
    ref = run(loaded, None, PROMPTS[0]).output_ids

    def paths(s):
        n = s.num_output
        good = ref[n:n + 4]
        return [[(good[0] + 1) % 256, 5, 6], good] if good else []

    s = run(loaded, TreeScript(paths), PROMPTS[0])
    assert s.output_ids == ref
    # every round accepts the whole good branch plus a bonus: k+1 = 5 tokens per verify step
    assert len(ref) == 24
    assert s.metrics.target_forwards == 1 + math.ceil(23 / 5)
    assert s.metrics.accepted_tokens == 23 - s.metrics.verify_steps


def test_engine_tree_all_first_children_wrong(loaded):
    ref = run(loaded, None, PROMPTS[2]).output_ids

    def paths(s):
        n = s.num_output
        if n >= len(ref):
            return []
        return [[(ref[n] + d) % 256, 7] for d in (1, 2, 3)]

    s = run(loaded, TreeScript(paths), PROMPTS[2])
    assert s.output_ids == ref
    assert s.metrics.accepted_tokens == 0 and s.metrics.drafted_tokens > 0


def test_kv_keep_matches_fresh_forward(loaded):
    """After a tree round the accepted path's KV sits in consecutive slots: continuing
    through the cache equals a fresh forward of the committed ids."""
    rt = loaded("llama").runtime
    prefix = [40 + i % 50 for i in range(300)]  # longer than the initial capacity: buffers regrow
    tree = DraftTree.from_paths(44, [[50, 51], [60, 61, 62]])  # rows: 44, 50, 51, 60, 61, 62
    cache = rt.new_cache(1)
    rt.forward(cache, [0], [prefix])
    rt.forward(cache, [0], [tree.tokens], positions=[tree.positions(len(prefix))], chunk_masks=[tree.mask()])
    cache.keep(0, len(prefix), [0, 3, 4])  # root, 60, 61
    assert cache.lengths[0] == len(prefix) + 3
    cont = rt.forward(cache, [0], [[70]])[0, -1]
    fresh = rt.forward(rt.new_cache(1), [0], [prefix + [44, 60, 61, 70]])[0, -1]
    torch.testing.assert_close(cont, fresh, atol=1e-4, rtol=0)


@pytest.mark.parametrize("batch", [1, 3])
def test_ngram_tree_greedy_equal(loaded, batch):
    sp = SamplingParams(max_tokens=48, ignore_eos=True)
    base = LLM(loaded("llama")).generate(PROMPTS, sp)
    llm = LLM(loaded("llama"), speculative=SpecConfig(method="ngram", num_draft_tokens=4, tree_topk=3))
    outs = llm.generate(PROMPTS, sp) if batch == 3 else [llm.generate(p, sp)[0] for p in PROMPTS]
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]


def test_ngram_tree_drafter_builds_trie():
    from specdec.drafters import NgramDrafter

    ids = [1, 2, 3, 1, 2, 4, 1, 2, 5, 6, 1, 2]
    s = Sequence(1, ids, 1, SamplingParams(), make_generator(0, "cpu"), frozenset())
    d = NgramDrafter(n_max=2, n_min=1, branches=3).propose([s], [2])[0]
    # continuations of [1, 2] at 6, 3, 0 (most recent first): [5, 6], [4, 1], [3, 1]
    assert d.tree.tokens == [2, 5, 6, 4, 1, 3, 1] and d.tree.parents == [-1, 0, 1, 0, 3, 0, 5]
    capped = NgramDrafter(n_max=2, n_min=1, branches=3, max_nodes=3).propose([s], [2])[0]
    assert capped.tree.tokens == [2, 5, 6, 4]
    single = NgramDrafter(n_max=2, n_min=1, branches=1).propose([s], [2])[0]
    assert single.tree is None and single.tokens == [5, 6]


# ---------------------------------------------------------------- draft-model trees


@pytest.mark.parametrize("method", ["self", "draft"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("shape", [(2, 3, None), (3, 4, 6)])
def test_model_tree_greedy_equal(loaded, method, batch, shape):
    topk, depth, nodes = shape
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    base = LLM(loaded("llama")).generate(PROMPTS, sp)
    spec = SpecConfig(method=method, tree_topk=topk, tree_depth=depth, tree_nodes=nodes)
    llm = LLM(loaded("llama"), draft=loaded("draft") if method == "draft" else None, speculative=spec)
    outs = llm.generate(PROMPTS, sp) if batch == 3 else [llm.generate(p, sp)[0] for p in PROMPTS]
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    m = outs[0].metrics
    assert m["draft_forwards"] > 0 and m["nodes_per_verify_step"] > depth  # branches were verified
    if method == "self":  # the draft's best path is the target's greedy path, when the budget keeps it
        assert m["accepted_tokens"] > 0


def test_model_tree_draft_cache_keeps_accepted_path(loaded):
    """After a tree round the drafter keeps the KV of the fed nodes on the committed path
    (gathered to consecutive slots): continuing from its cache equals a fresh forward."""
    from specdec.drafters import ModelDrafter

    rt = loaded("llama").runtime
    drafter = ModelDrafter(rt, 2, rt.vocab_size, topk=2)  # no node budget: every candidate
    prompt = [40 + i % 50 for i in range(300)]  # past the initial cache capacity
    s = Sequence(1, list(prompt), len(prompt), SamplingParams(), make_generator(0, "cpu"), frozenset())
    s.slot = 1
    tree = drafter.propose([s], [3])[0].tree
    assert tree.num_drafts == 2 + 4 + 4 and max(tree.depths) == 3  # 2 best of each depth expanded
    leaf = max(range(len(tree.tokens)), key=lambda r: (tree.depths[r], -r))  # a depth-3 row
    path = [leaf]
    while tree.parents[path[-1]] > 0:
        path.append(tree.parents[path[-1]])
    s.ids += [tree.tokens[r] for r in reversed(path)] + [7]  # the path, then a bonus token
    drafter.observe(s, len(path))
    cached = drafter.cached_ids[1]
    assert cached == s.ids[: len(cached)] and len(cached) == len(prompt) + 2  # depths 1-2 were fed
    assert drafter.cache.lengths[1] == len(cached)
    ours = rt.forward(drafter.cache, [1], [s.ids[len(cached):]], last_only=True)[0]
    fresh = rt.forward(rt.new_cache(1), [0], [s.ids], last_only=True)[0]
    torch.testing.assert_close(ours, fresh, atol=1e-4, rtol=0)


def test_model_tree_sampling_reproducible(loaded):
    spec = SpecConfig(method="draft", tree_topk=2, tree_depth=3)
    llm = LLM(loaded("llama"), draft=loaded("draft"), speculative=spec)
    sp = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    a, b = (llm.generate(PROMPTS, sp) for _ in range(2))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(len(o.token_ids) == 24 for o in a)


def test_model_tree_sampled_children_are_lossless(loaded, tiny_dirs):
    """Sampled requests draw a draft-model tree's children from q without replacement: the
    engine's first four tokens (the last three from a tree of depth 2, pruned to 3 of its 6
    candidates, and a bonus) follow the target's exact joint distribution (chi-square at alpha
    0.001 over 6144 completions; top_k 4 at temperature 1.5, so q and p both spread; a
    draft resembling the target, so that children are accepted at every depth and rejected)."""
    from joint import exact_joint, joint_pvalue
    from transformers import AutoModelForCausalLM

    top_k, temperature, n = 4, 1.5, 6144
    prompt = [40, 41, 42, 43, 44]
    expected = exact_joint(AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"]).eval(), prompt, 4, top_k,
                           temperature)
    spec = SpecConfig(method="draft", num_draft_tokens=2, tree_topk=2, tree_nodes=3)
    llm = LLM(loaded("llama"), draft=loaded("noisy"), speculative=spec, max_batch_size=64)
    sps = [SamplingParams(max_tokens=4, temperature=temperature, top_k=top_k, seed=j * n // 64, n=n // 64, ignore_eos=True)
           for j in range(64)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * 64, sps)
    seen = [tuple(c.token_ids) for o in outs for c in o.outputs]
    assert len(seen) == n and set(seen) <= set(expected)
    m = [o.metrics for o in outs]
    drafted, accepted = sum(x["drafted_tokens"] for x in m), sum(x["accepted_tokens"] for x in m)
    assert 0.2 * drafted < accepted < 0.8 * drafted  # children accepted and rejected
    assert sum(x["acceptance_by_depth"][1] > 0 for x in m) > 32
    assert joint_pvalue(seen, expected) > ALPHA


def test_tree_metrics_by_depth(loaded):
    """Scripted tree (a wrong 3-node branch, then the right 4-token branch): 7 nodes per step,
    every depth accepted."""
    ref = run(loaded, None, PROMPTS[0]).output_ids

    def paths(s):
        good = ref[s.num_output:s.num_output + 4]
        return [[(good[0] + 1) % 256, 5, 6], good] if good else []

    m = run(loaded, TreeScript(paths), PROMPTS[0]).metrics.to_dict()
    # 23 tokens after the prefill: rounds commit 5, 5, 5, 5, then 3 (2 drafts left)
    assert m["drafted_per_position"] == [5, 5, 4, 4]
    assert m["acceptance_by_depth"] == [1.0, 1.0, 1.0, 1.0]
    assert m["nodes_per_verify_step"] == (4 * 7 + 4) / 5


def test_tree_config_errors(loaded):
    with pytest.raises(ValueError, match="need a drafter"):
        SpecConfig(method="none", tree_topk=2)
    with pytest.raises(ValueError, match="transformers fallback runs chains only"):
        LLM(loaded("llama", backend="hf"), speculative=SpecConfig(method="self", tree_topk=2))
