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


def test_quantization_gguf(smol):
    from specdec import LLM

    assert LLM(smol, quantization="gguf").target is smol  # vLLM's keyword, the checkpoint's own
    with pytest.raises(ValueError, match="this checkpoint is gguf"):
        LLM(smol, quantization="awq")


def test_demo_command(capsys):
    from specdec.cli import main

    assert main(["demo", "--max-new-tokens", "24"]) == 0
    out = capsys.readouterr().out
    assert "OK: n-gram, self-draft and tree outputs are token-for-token identical" in out
    assert "accepted path (*): rows 0 ->" in out  # a tree with its accepted path and mask grid
    assert main(["demo", "--max-new-tokens", "2"]) == 0  # steps that draft nothing (k = remaining - 1 = 0)


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


@__import__("functools").cache
def embedded_fields() -> list:
    """The embedded GGUF's metadata fields: (name, value, type, array item type)."""
    import gguf

    from specdec.runtime.loading import default_model_path

    fields = gguf.GGUFReader(default_model_path()).fields.values()
    return [(f.name, f.contents(), f.types[0], f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
            for f in fields if f.name != gguf.Keys.General.ARCHITECTURE and not f.name.startswith("GGUF.")]


def rewritten_gguf(path, kv=(), tensors=()):
    """The embedded GGUF's metadata (no weights: a config and tokenizer read only) with the
    ``kv`` fields and the f32 ``tensors`` (name, array) added."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch="llama")
    for name, value, kind, item in embedded_fields():
        w.add_key_value(name, value, kind, sub_type=item)
    for key, value, kind in kv:
        w.add_key_value(key, value, kind)
    for name, data in tensors:
        w.add_tensor_info(name, data.shape, data.dtype, data.nbytes, gguf.GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, data in tensors:
        w.write_tensor_data(data)
    w.close()
    return path


def test_gguf_without_the_models_tensors_is_refused(tmp_path, monkeypatch):
    """A GGUF whose tensors transformers' reader does not all map onto its model is refused,
    naming a missing tensor. A Mixtral GGUF (architecture "llama", its experts as
    ``ffn_*_exps``) reads so: every tensor but the MLPs'; it ran with untouched (random)
    MLPs on transformers' runtime and failed in the first forward on the torch runtime. Here
    the embedded GGUF's reading loses its MLPs the same way."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    from specdec.runtime.loading import default_model_path, gguf_to_hf_dir

    read = gguf_utils.load_gguf_checkpoint

    def without_mlps(*args, **kwargs):
        out = read(*args, **kwargs)
        if "tensors" in out:
            out["tensors"] = {k: v for k, v in out["tensors"].items() if ".mlp." not in k}
        return out

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", without_mlps)
    with pytest.raises(ValueError, match=r"finds no value for 90 tensors of a 'llama' model \(e\.g\. 'model\.layers\.0\.mlp\."
                                         r"down_proj\.weight'\); run it with backend='llamacpp'"):
        gguf_to_hf_dir(__import__("pathlib").Path(default_model_path()))


def test_gguf_rope_scaling_reaches_the_config(tmp_path):
    """transformers' GGUF reader drops a GGUF's rope scaling: Llama 3.1-3.3's per-frequency
    factors (``rope_freqs``, llama.cpp's converter's) come back as their ``llama3``
    parameters, ``rope.scaling`` linear and yarn as theirs; one that cannot be said is
    refused for the torch runtime (llama.cpp reads the GGUF itself)."""
    import math

    import gguf
    import numpy as np

    from specdec.runtime.loading import gguf_rope, gguf_to_hf_dir, llama3_rope

    reader = gguf.GGUFReader(str(rewritten_gguf(tmp_path / "plain.gguf")))
    theta = float(reader.get_field("llama.rope.freq_base").contents())
    dim = int(reader.get_field("llama.rope.dimension_count").contents())

    def factors(factor, low, high, orig):  # llama.cpp's converter's rope_freqs for a llama3 config
        out = []
        for w in 2 * math.pi * theta ** (np.arange(0, dim, 2) / dim):
            s = (orig / w - low) / (high - low)
            out.append(1.0 if w < orig / high else factor if w > orig / low else 1 / ((1 - s) / factor + s))
        return np.array(out, dtype=np.float32)

    llama32 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    path = rewritten_gguf(tmp_path / "llama3.gguf", tensors=[("rope_freqs.weight", factors(32.0, 1.0, 4.0, 8192))])
    assert gguf_rope(tmp_path / "plain.gguf") == {} and gguf_rope(path) == llama32
    config = __import__("json").loads((gguf_to_hf_dir(path, weights=False) / "config.json").read_text())
    assert {**config["rope_parameters"], "rope_theta": theta} == {**llama32, "rope_theta": theta}
    fitted = llama3_rope(factors(16.0, 2.0, 6.0, 4096), theta, dim, 4096)  # not Llama 3's own numbers: fitted
    assert fitted["factor"] == 16 and fitted["original_max_position_embeddings"] == 4096
    assert (fitted["low_freq_factor"], fitted["high_freq_factor"]) == pytest.approx((2.0, 6.0), rel=1e-6)
    S, F = gguf.GGUFValueType.STRING, gguf.GGUFValueType.FLOAT32
    linear = rewritten_gguf(tmp_path / "linear.gguf", kv=[("llama.rope.scaling.type", "linear", S),
                                                          ("llama.rope.scaling.factor", 4.0, F)])
    assert gguf_rope(linear) == {"rope_type": "linear", "factor": 4.0}
    yarn = [("llama.rope.scaling.type", "yarn", S), ("llama.rope.scaling.factor", 4.0, F),
            ("llama.rope.scaling.original_context_length", 2048, gguf.GGUFValueType.UINT32)]
    assert gguf_rope(rewritten_gguf(tmp_path / "yarn.gguf", kv=yarn)) == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}
    odd = rewritten_gguf(tmp_path / "odd.gguf", kv=yarn + [("llama.rope.scaling.yarn_log_multiplier", 0.1, F)])
    with pytest.raises(ValueError, match="backend='llamacpp'"):
        gguf_to_hf_dir(odd)
    assert (gguf_to_hf_dir(odd, weights=False) / "config.json").is_file()  # llama.cpp's own
    from transformers import AutoConfig

    from specdec.runtime.loading import scaled_rope

    per_type = scaled_rope(AutoConfig.for_model("gemma3_text"), {"rope_type": "linear", "factor": 8.0}, "g.gguf")
    assert per_type["full_attention"]["factor"] == 8.0 and per_type["sliding_attention"]["rope_type"] == "default"
    other = AutoConfig.for_model("gemma3_text")
    other.model_type = "other"  # another model with rope per layer type: refused, not left out
    with pytest.raises(ValueError, match="per layer type"):
        scaled_rope(other, {"rope_type": "linear", "factor": 8.0}, "o.gguf")
    with pytest.raises(ValueError, match="rope factors .rope_factors_long.weight"):
        gguf_rope(rewritten_gguf(tmp_path / "phi.gguf", tensors=[("rope_factors_long.weight", np.ones(32, np.float32))]))


def test_gguf_tokenizer_is_its_own(tmp_path):
    """A GGUF's tokenizer is the one inside it, though another model's tokenizer.json lies
    beside it (transformers prefers that one)."""
    from transformers import AutoTokenizer

    from specdec.runtime.loading import gguf_to_hf_dir, load_tokenizer

    from tiny import byte_tokenizer

    byte_tokenizer().save_pretrained(tmp_path)
    path = rewritten_gguf(tmp_path / "smol.gguf")
    own = load_tokenizer(None)
    for tok in (load_tokenizer(str(path)), AutoTokenizer.from_pretrained(gguf_to_hf_dir(path, weights=False))):
        assert len(tok) == len(own) > 49000 and tok.encode("Hello, world") == own.encode("Hello, world")


def test_text_offsets_of_characters_split_over_tokens(smol):
    """A character split over several byte-level tokens belongs to the token that completes it,
    in an echoed prompt (the tokenizer's offsets) as in an output (decoding): the two rules give
    the same offsets, and each token's piece ``text[o_i:o_i+1]`` joins into the text. Once a
    4-token context began inside a character: its cut bytes were counted as the next token's
    (`` ok`` after two emoji started at 11 of 12 characters)."""
    import random

    from specdec.config import SamplingParams
    from specdec.server.text import TokenOffsets, prompt_offsets

    tok = smol.tokenizer
    kept = SamplingParams(skip_special_tokens=False)
    text = "Emoji: 🎉🎌 ok"
    ids = tok(text)["input_ids"]
    assert prompt_offsets(tok, text, ids) == TokenOffsets(tok, kept).add(ids) == [0, 2, 5, 6, 7, 7, 8, 8, 8, 9]
    rng = random.Random(0)
    alphabet = ["a", "b", " ", "\n", "é", "ß", "日本", "語", "🎉", "🎌", "👍🏽", "x=1", "<|im_end|>"]
    for _ in range(150):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12)))
        ids = tok(text)["input_ids"]
        if tok.decode(ids) != text:
            continue
        offsets = prompt_offsets(tok, text, ids)
        assert offsets == TokenOffsets(tok, kept).add(ids), text
        assert offsets == sorted(offsets) and offsets[-1] <= len(text), text
        # the output's offsets from a prompt's context: each piece is what the decoded text adds
        cut = rng.randint(0, len(ids) - 1)
        after = TokenOffsets(tok, kept, context=tuple(ids[:cut])).add(ids[cut:])
        assert after == [o - offsets[cut] for o in offsets[cut:]], (text, cut)


def test_lora_adapter_greedy_equals_peft(smol, tmp_path):
    """A LoRA adapter (PEFT's, random, rank 8 on every attention and MLP product) on SmolLM2: with
    n-gram speculation, an adapted chat and a base one in one batch each decode as PEFT's model
    and the base model do greedily (transformers' ``generate``)."""
    from specdec import LoRARequest

    from tiny import lora_reference, make_lora, through

    path = make_lora(smol.path, tmp_path / "lora", seed=0, r=8, std=0.03)
    ref = lora_reference(smol.path, path)
    llm = LLM(str(smol.path), enable_lora=True, speculative=SpecConfig(method="ngram", num_draft_tokens=4))
    lora = LoRARequest("random", 1, str(path))
    outs = llm.generate(CHATS[:2], SamplingParams(max_tokens=32), lora_request=[lora, None])
    for chat, out, adapted in zip(CHATS[:2], outs, (True, False)):
        ids = torch.tensor([llm.encode(chat)])
        with torch.no_grad(), through(ref, "default" if adapted else None):
            want = ref.generate(input_ids=ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1]:]
        assert out.token_ids == want.tolist()[:len(out.token_ids)] and len(out.token_ids) >= min(32, len(want))
    assert outs[0].text != outs[1].text
