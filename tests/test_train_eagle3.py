"""scripts/train_eagle3.py: the head it trains computes what SGLang's and vLLM's layout (and
so specdec's EagleHead) computes, its loss falls, and specdec drafts with what it writes."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from specdec import LLM, SamplingParams, SpecConfig
from specdec.drafters import EagleDrafter
from test_eagle import CLOSE, reference_drafts
from tiny import make_tiny

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import train_eagle3  # noqa: E402

SOURCE = '''
def clamp(x, low, high):
    """Limit x to the range from low to high."""
    if x < low:
        return low
    if x > high:
        return high
    return x


def mean(values):
    """The arithmetic mean of values."""
    total = 0
    for v in values:
        total += v
    return total / len(values)
'''


def test_trained_head_is_the_layout_specdec_drafts_with(tmp_path, capsys):
    """Train a head on a tiny target (two chat answers by the target, then text, three
    training-time-test steps): the loss falls; the trainer's step j at row t gives the
    logits SGLang's layout gives draft j after the committed ids up to t + 1; and greedy
    decoding drafting with the written head equals the target alone."""
    target = make_tiny(tmp_path / "target", "llama", seed=0, layers=8)
    (tmp_path / "code").mkdir()
    for i in range(3):
        (tmp_path / "code" / f"m{i}.py").write_text(SOURCE * 2)
    out = tmp_path / "head"
    train_eagle3.main(["--target", str(target), "--out", str(out), "--text", str(tmp_path / "code"),
                       "--chat", "2", "--answer-tokens", "16", "--seq-len", "96", "--tokens", "2000",
                       "--draft-vocab", "100", "--epochs", "12", "--batch", "4", "--lr", "3e-3"])
    log = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    losses = [float(line.split("loss ")[1].split()[0]) for line in log]
    assert losses[-1] < 0.7 * losses[0], log

    from safetensors.torch import load_file

    w = load_file(str(out / "model.safetensors"))
    assert "LlamaForCausalLMEagle3" in (out / "config.json").read_text() and w["lm_head.weight"].shape[0] == 100
    from specdec.runtime.loading import Weights

    head = train_eagle3.Head.load(out, Weights(target)["model.embed_tokens.weight"].float())
    assert sorted(head.named()) == sorted(k for k in w if k not in ("d2t", "t2d"))

    ids = list(b"def mean(values):\n    total = 0")
    T = len(ids)
    llm = LLM(str(target), device="cpu")
    rt = llm.target.runtime
    rt.capture(train_eagle3.feature_taps_of(rt))
    with torch.no_grad():
        rt.forward(rt.new_cache(1), [0], [ids])
        steps = head(torch.tensor([ids]), rt.features, 3)  # 3 x [1, T - 1, draft vocab]
    to_target = torch.arange(100) + w["d2t"]
    ref = reference_drafts(out, target, ids[: T - 2], ids[T - 2:])  # [3, vocab]: drafts 0-2 after ids[:T-2]
    for j in range(3):
        got = torch.full((ref.shape[1],), float("-inf")).index_copy(0, to_target, steps[j][0, T - 4])
        torch.testing.assert_close(got, ref[j], **CLOSE)

    # greedy decoding drafting with the written head equals the target alone; each head forward
    # over committed tokens alone (the rows the target's features reach) gives the layout's
    # first draft after them: accepted drafts' rows, fed the head's own features, were fed again
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = ["def clamp(x", "total = 0"]
    want = [o.token_ids for o in llm.generate(prompts, sp)]
    spec = LLM(str(target), draft=str(out), device="cpu",
               speculative=SpecConfig(method="eagle3", num_draft_tokens=3, draft_quantization="none"))
    assert isinstance(spec.engine.drafters["draft"], EagleDrafter)
    rt = spec.draft.runtime
    calls, forward = [], rt.forward

    def recorded(cache, slots, tokens, **kw):
        ends = [cache.lengths[s] + len(t) for s, t in zip(slots, tokens)]
        known = [int(cache.known[s]) for s in slots]
        logits = forward(cache, slots, tokens, **kw)
        calls.extend((end, row.clone()) for end, k, row in zip(ends, known, logits)
                     if end - 1 <= k and kw.get("last_only") and kw.get("chunk_masks") is None)
        return logits

    rt.forward = recorded
    accepted = 0
    for prompt, ids in zip(prompts, want):  # one at a time: the calls are the request's
        calls.clear()
        got = spec.generate([prompt], sp)[0]
        assert got.token_ids == ids and len(calls) > 2
        accepted += got.metrics["accepted_tokens"]
        seq = list(got.prompt_token_ids) + ids
        for end, row in calls:
            torch.testing.assert_close(row, reference_drafts(out, target, seq[:end], [])[0], **CLOSE)
    assert accepted > 0
