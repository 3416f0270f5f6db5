"""``specdec bench`` end to end on tiny models: every method runs, outputs agree, reports are written."""
import json

import pytest


def test_bench_runs_all_kinds_of_methods(tiny_dirs, tmp_path, monkeypatch):
    from specdec.cli import main

    monkeypatch.setenv("SPECDEC_COST_CACHE", str(tmp_path / "costs.json"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "edit-a", "kind": "completion", "prompt": "hello world hello world hello"}\n'
                       '{"id": "comp-b", "kind": "completion", "prompt": "abc abc abc"}\n')
    out = tmp_path / "out"
    methods = ("specdec-plain,specdec-draft,specdec-hybrid+cost,specdec-ngram-tree,specdec-draft-tree,"
               "specdec-draft-tree+cost,hf-plain,hf-assisted")
    code = main(["bench", "--model", str(tiny_dirs["llama"]), "--draft", str(tiny_dirs["draft"]),
                 "--prompts-file", str(prompts), "--methods", methods, "--tree-shapes", "2x3x5,3x2x6",
                 "--max-new-tokens", "8", "--out", str(out)])
    assert code == 0
    report = json.loads((out / "bench.json").read_text())
    summary = report["summary"]
    assert set(summary) == {"specdec-plain", "specdec-draft", "specdec-hybrid+cost", "specdec-ngram-tree",
                            "specdec-draft-tree:2x3x5", "specdec-draft-tree:3x2x6",
                            "specdec-draft-tree:2x3x5+cost", "specdec-draft-tree:3x2x6+cost",
                            "hf-plain", "hf-assisted"}
    assert all(s["diverged"] == 0 for s in summary.values())
    tree = summary["specdec-draft-tree:3x2x6"]
    assert tree["nodes_per_verify_step"] > 2 and len(tree["acceptance_by_depth"]) == 2
    assert sum(summary["specdec-hybrid+cost"]["chosen_k"]) > 0
    assert len(report["cost_curve_s"]["target"]) == 17
    assert (out / "bench.png").stat().st_size > 10_000
    assert "chosen k" in (out / "bench.md").read_text() and "decode speed" in (out / "bench.md").read_text()
    for m in ("specdec-plain", "specdec-draft", "hf-plain", "hf-assisted"):  # time to first token noted
        for rec in report["per_prompt"][m]:
            assert all(0 < t < max(rec["seconds"]) for t in rec["ttft_s"]), (m, rec["ttft_s"])
            assert rec["decode_tokens_per_s"] > rec["tokens_per_s"] * 0.5, m
    assert summary["hf-plain"]["vs_hf_plain_median_decode"] == 1.0
    for rec in report["per_prompt"]["specdec-plain"]:  # plain decoding is one of the schedules
        bound = rec["ngram_chain_bound"]
        assert bound["decode"] >= 1.0 and bound["end_to_end"] >= 1.0
    assert "could gain" in (out / "bench.md").read_text()


def test_bench_prefills_every_run_whole(tiny_dirs, tmp_path, monkeypatch):
    """specdec's runs prefill their whole prompt each time, as transformers' and llama-cpp-python's do:
    a prompt of 300 tokens (two 256-token chunks) takes 2 forwards before its 3 decode steps in every
    run, none of its chunks reused from the warm-up or the run before."""
    from specdec.cli import main

    monkeypatch.setenv("SPECDEC_COST_CACHE", str(tmp_path / "costs.json"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "comp-long", "kind": "completion", "prompt": "abcdefghij" * 30}) + "\n")
    assert main(["bench", "--model", str(tiny_dirs["llama"]), "--prompts-file", str(prompts), "--methods",
                 "specdec-plain", "--max-new-tokens", "4", "--repeats", "2", "--out", str(tmp_path / "out")]) == 0
    rec = json.loads((tmp_path / "out" / "bench.json").read_text())["per_prompt"]["specdec-plain"][0]
    assert rec["prompt_tokens"] == 300 and rec["target_forwards"] == 5


def test_bench_and_generate_on_dummy_weights(tiny_dirs, tmp_path, capsys):
    """``--load-format dummy``: the bench and ``generate`` run on random weights of the
    models' shapes from directories with no weights; specdec and transformers get the same
    weights, so on the CPU in float32 their greedy tokens still agree."""
    from specdec.cli import main
    from test_api_errors import run_cli
    from test_runtime import weightless

    target = weightless(tiny_dirs["llama"], tmp_path / "target")
    draft = weightless(tiny_dirs["draft"], tmp_path / "draft")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "comp-a", "kind": "completion", "prompt": "abc abc abc"}\n')
    out = tmp_path / "out"
    common = ["bench", "--model", str(target), "--draft", str(draft), "--prompts-file", str(prompts),
              "--max-new-tokens", "8", "--load-format", "dummy"]
    assert main(common + ["--methods", "specdec-plain,specdec-draft,hf-plain,hf-assisted",
                          "--out", str(out)]) == 0
    report = json.loads((out / "bench.json").read_text())
    assert report["config"]["load_format"] == "dummy"
    assert report["config"]["references"]["specdec-draft"] == "hf-plain"
    assert all(s["diverged"] == 0 for s in report["summary"].values())
    assert "random weights" in (out / "bench.md").read_text()
    assert main(common + ["--methods", "specdec-plain,llamacpp-plain", "--out", str(out)]) == 2
    assert "llama.cpp runs a GGUF's own weights" in capsys.readouterr().err
    r = run_cli("generate", "--model", str(target), "--draft", str(draft), "--load-format", "dummy",
                "-k", "3", "--max-new-tokens", "6", "--ignore-eos", "--json", "--prompt", "abc")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["token_ids"]) == 6


def test_bench_tells_near_tie_flips_from_bugs(tiny_dirs, tmp_path, monkeypatch, capsys):
    """A specdec output that parts from its reference gets the reference's top-2 logit gap at
    that token: within the dtype's near-tie tolerance the bench passes and reports the flip,
    beyond it the bench fails. (A runner is made to change one token; the tiny models' logits
    are peaked, so the gap there is no near-tie.)"""
    import specdec.bench as bench
    from specdec.cli import main

    real = bench._specdec_runner

    def flipping(llm, sampling):
        run = real(llm, sampling)
        if llm.spec.method != "ngram":
            return run

        def changed(ids, max_new_tokens, seed):
            out, stats = run(ids, max_new_tokens, seed)
            return out[:3] + [(out[3] + 1) % 256] + out[4:], stats
        return changed

    monkeypatch.setattr(bench, "_specdec_runner", flipping)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "comp-a", "kind": "completion", "prompt": "abc abc abc"}\n')
    common = ["bench", "--model", str(tiny_dirs["llama"]), "--prompts-file", str(prompts), "--max-new-tokens", "8",
              "--methods", "specdec-plain,specdec-ngram,hf-plain"]
    assert main(common + ["--out", str(tmp_path / "a")]) == 1
    summary = json.loads((tmp_path / "a" / "bench.json").read_text())["summary"]["specdec-ngram"]
    assert summary["diverged_first_index"] == {"comp-a": 3} and not summary["near_ties_only"]
    gap = summary["flip_gaps"]["comp-a"]
    assert bench.NEAR_TIE["float32"] < gap < 1
    assert f"comp-a@3 (gap {gap:.1e})" in (tmp_path / "a" / "bench.md").read_text()
    assert "FAILED" in capsys.readouterr().out
    monkeypatch.setitem(bench.NEAR_TIE, "float32", 1.0)  # the same gap, read as a near-tie
    assert main(common + ["--out", str(tmp_path / "b")]) == 0
    assert "but for 1 near-tie flip(s)" in capsys.readouterr().out


def test_bench_sampled(tiny_dirs, tmp_path, capsys):
    """``--temperature`` > 0: every method samples with the same top_p / top_k, repeat r with
    seed + r; specdec's draws are those of ``LLM.generate`` with that seed, outputs are not
    compared token by token, and the report says so."""
    from specdec import LLM, SamplingParams
    from specdec.bench_report import count as _count
    from specdec.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "comp-a", "kind": "completion", "prompt": "abc abc abc"}\n')
    out = tmp_path / "out"
    code = main(["bench", "--model", str(tiny_dirs["llama"]), "--draft", str(tiny_dirs["draft"]),
                 "--prompts-file", str(prompts), "--methods", "specdec-plain,specdec-draft,hf-plain,hf-assisted",
                 "--max-new-tokens", "12", "--temperature", "1.5", "--top-p", "0.95", "--top-k", "50",
                 "--seed", "3", "--repeats", "3", "--out", str(out)])
    assert code == 0
    report = json.loads((out / "bench.json").read_text())
    assert report["config"]["sampling"] == {"temperature": 1.5, "top_p": 0.95, "top_k": 50}
    plain = report["summary"]["specdec-plain"]  # plain decoding's time split and k=0 steps are reported too
    assert set(plain["time_split_s"]) == {"prefill", "draft", "verify", "bookkeeping"} and plain["chosen_k"][0] > 0
    assert "| specdec-plain |" in (out / "bench.md").read_text().split("specdec time split")[1]
    assert report["config"]["seeds"] == [3, 5]
    assert all(s["reference"] is None for s in report["summary"].values())
    sp = SamplingParams(max_tokens=12, temperature=1.5, top_p=0.95, top_k=50, seed=3)
    ids = report["per_prompt"]["specdec-plain"][0]["token_ids"]
    llm = LLM(str(tiny_dirs["llama"]), device="cpu")
    assert ids == list(llm.generate("abc abc abc", sp, use_tqdm=False)[0].token_ids)
    greedy = list(llm.generate("abc abc abc", SamplingParams(max_tokens=12), use_tqdm=False)[0].token_ids)
    assert ids != greedy
    assert not report["per_prompt"]["hf-plain"][0]["repeats_identical"]  # three seeds, three draws
    md = (out / "bench.md").read_text()
    assert "sampled (temperature 1.5, top_p 0.95, top_k 50; seeds 3..5" in md and "- (sampled)" in md
    counts = sorted({_count(r[0]["generated_tokens"]) for r in report["per_prompt"].values()}, key=float)
    row = md.split("per prompt, tokens/s:")[1].split("| comp-a | ")[1]  # the methods' token counts, as a range
    assert len(counts) > 1 and row.startswith(f"{counts[0]}-{counts[-1]} |"), (counts, row)
    assert "sampled: outputs are draws" in capsys.readouterr().out
    assert main(["bench", "--model", str(tiny_dirs["llama"]), "--temperature", "0.5", "--top-p", "0",
                 "--prompts-file", str(prompts), "--methods", "specdec-plain", "--out", str(out)]) == 2


def test_bench_sampling_reads_top_k_minus_one_as_off():
    from argparse import Namespace

    from specdec.bench import bench_sampling

    assert bench_sampling(Namespace(temperature=0.7, top_p=0.8, top_k=-1)) == {"temperature": 0.7, "top_p": 0.8, "top_k": 0}
    assert bench_sampling(Namespace(temperature=0, top_p=0.8, top_k=-1)) == {}


def test_pool_draws_means_counts_and_weights_ratios():
    """Sampled draws pool into the mean draw: counts, lists and dicts averaged; each ratio
    weighted by its denominator, so it equals all numerators over all denominators."""
    from specdec.bench import pool_draws

    a = {"target_forwards": 11, "drafted_tokens": 40, "accepted_tokens": 30, "verify_steps": 10,
         "acceptance_rate": 0.75, "mean_accepted_length": 4.0, "nodes_per_verify_step": 4.0,
         "chosen_k": [0, 0, 10], "drafter_steps": {"ngram": 10}, "time_split_s": {"draft": 1.0},
         "accepted_per_position": [9, 8], "ttft_s": None}
    b = {"target_forwards": 31, "drafted_tokens": 10, "accepted_tokens": 0, "verify_steps": 30,
         "acceptance_rate": 0.0, "mean_accepted_length": 1.0, "nodes_per_verify_step": 1 / 3,
         "chosen_k": [20, 10], "drafter_steps": {"draft": 10}, "time_split_s": {"draft": 3.0},
         "accepted_per_position": [0], "ttft_s": None}
    pooled = pool_draws([a, b])
    assert pooled["target_forwards"] == 21 and pooled["drafted_tokens"] == 25
    assert pooled["acceptance_rate"] == pytest.approx(30 / 50)
    assert pooled["mean_accepted_length"] == pytest.approx((40 + 30) / 40)
    assert pooled["nodes_per_verify_step"] == pytest.approx(50 / 40)
    assert pooled["chosen_k"] == [10, 5, 5] and pooled["accepted_per_position"] == [4.5, 4]
    assert pooled["drafter_steps"] == {"ngram": 5, "draft": 5} and pooled["time_split_s"] == {"draft": 2.0}
    assert pooled["ttft_s"] is None
    assert pool_draws([a]) == {**a, "chosen_k": [0, 0, 10], "accepted_per_position": [9, 8]}


def test_first_token_counts_the_tokens_that_came_with_it():
    """transformers' assisted generation verifies its first drafts in the prompt's forward: its
    streamer's second ``put`` can carry several tokens, all of them inside the time to the
    first token, so the decode speed counts only the tokens after them."""
    import torch

    from specdec.bench import FirstToken

    first = FirstToken()
    first.put(torch.zeros(1, 5))  # the prompt
    first.put(torch.zeros(4))  # the first token and 3 accepted drafts
    first.put(torch.zeros(2))
    assert first.tokens == 4 and first.seconds() >= 0
