"""End to end on a real pretrained model: the embedded SmolLM2-135M-Instruct (Llama arch)."""
import pytest
import torch

from specdec import LLM, SamplingParams, SpecConfig

pytestmark = pytest.mark.real

CHATS = [[{"role": "user", "content": c}] for c in (
    "Write a Python function that returns the n-th Fibonacci number.",
    "List the days of the week, then list them again in reverse order.",
    "Explain what a hash map is in two sentences.",
)]
N = 64


@pytest.fixture(scope="module")
def smol():
    from specdec.runtime import load_model

    return load_model(None)


def test_logits_match_transformers(smol):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smol.path, dtype=torch.float32).eval()
    llm = LLM(smol)
    ids = llm.encode(CHATS[0])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]  # [T, vocab]
    ours = smol.runtime.forward(smol.runtime.new_cache(1), [0], [ids])[0]
    diff = (ours - ref).abs().max().item()
    print(f"SmolLM2-135M fp32: max |logit diff| vs transformers = {diff:.2e} over {len(ids)} positions")
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    assert diff < 1e-3


@pytest.fixture(scope="module")
def plain_outputs(smol):
    return LLM(smol).generate(CHATS, SamplingParams(max_tokens=N))


@pytest.mark.parametrize("method", ["ngram", "self"])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_equal_to_plain(smol, plain_outputs, method, batch):
    llm = LLM(smol, speculative=SpecConfig(method=method, num_draft_tokens=4))
    sp = SamplingParams(max_tokens=N)
    outs = llm.generate(CHATS, sp) if batch == 3 else [llm.generate(c, sp)[0] for c in CHATS]
    for o, b in zip(outs, plain_outputs):
        assert o.token_ids == b.token_ids
        assert o.text == b.text
        assert o.finish_reason == b.finish_reason
    assert sum(len(b.token_ids) for b in plain_outputs) >= 2 * N  # really generated at length
    if method == "self":
        assert all(o.metrics["acceptance_rate"] == 1.0 for o in outs)
        assert sum(o.metrics["target_forwards"] for o in outs) < sum(
            b.metrics["target_forwards"] for b in plain_outputs) / 2


def test_demo_command(capsys):
    from specdec.cli import main

    assert main(["demo", "--max-new-tokens", "24"]) == 0
    out = capsys.readouterr().out
    assert "OK: n-gram, self-draft and tree outputs are token-for-token identical" in out
    assert "accepted path (*): rows 0 ->" in out  # a tree with its accepted path and mask grid


@pytest.mark.parametrize("batch", [1, 3])
def test_draft_model_tree_greedy_equal(smol, plain_outputs, batch):
    """A top-2 token tree drafted by an int8 copy of SmolLM2 (it agrees often, not always)."""
    spec = SpecConfig(method="draft", draft_quantization="int8", tree_topk=2, tree_depth=4, tree_nodes=8)
    llm = LLM(smol, draft=str(smol.path), speculative=spec)
    sp = SamplingParams(max_tokens=N)
    outs = llm.generate(CHATS, sp) if batch == 3 else [llm.generate(c, sp)[0] for c in CHATS]
    assert [o.token_ids for o in outs] == [b.token_ids for b in plain_outputs]
    m = [o.metrics for o in outs]
    assert 0 < sum(x["accepted_tokens"] for x in m) < sum(x["drafted_tokens"] for x in m)
    assert max(x["nodes_per_verify_step"] for x in m) > 4  # really a tree, not a chain


def test_structured_json_schema_greedy_equal(smol):
    """SmolLM2 answers under a JSON schema (a batch of three chats): every answer parses and
    follows it, and n-gram and self drafting give plain decoding's tokens."""
    import json

    schema = {"type": "object", "additionalProperties": False, "required": ["title", "steps"],
              "properties": {"title": {"type": "string", "maxLength": 40},
                             "steps": {"type": "array", "items": {"type": "string", "maxLength": 60}, "maxItems": 3}}}
    sp = SamplingParams(max_tokens=120, structured_outputs={"json": schema})
    base = LLM(smol).chat(CHATS, sp)
    for b in base:
        obj = json.loads(b.text)
        assert set(obj) == {"title", "steps"} and len(obj["steps"]) <= 3, b.text
    for method in ("ngram", "self"):
        outs = LLM(smol, speculative=SpecConfig(method=method, num_draft_tokens=4)).chat(CHATS, sp)
        assert [o.token_ids for o in outs] == [b.token_ids for b in base], method
