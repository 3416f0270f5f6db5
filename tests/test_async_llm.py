"""``AsyncLLM`` (vLLM's): requests streamed to asyncio code while the engine's thread batches
them; what a stream ends with equals ``LLM.generate``'s output for the same request."""
import asyncio

import pytest

from specdec import LLM, AsyncLLM, RequestOutputKind, SamplingParams, SpecConfig

PROMPTS = ["abc abc abc", "hello hello", "xyz"]


def run(coro):
    return asyncio.run(coro)


async def collect(engine, prompt, sp, request_id=None):
    return [out async for out in engine.generate(prompt, sp, request_id)]


def same(a, b):
    """Two RequestOutputs' results agree (ids aside; logprobs to 1e-4: a batch changes
    float32's rounding on the torch runtime)."""
    def fields(o):
        return o.text, o.token_ids, o.finish_reason, o.stop_reason, [[(t, lp.rank) for t, lp in e.items()]
                                                                     for e in o.logprobs or []]

    def values(o):
        return [lp.logprob for e in o.logprobs or [] for lp in e.values()]

    return [fields(o) for o in a.outputs] == [fields(o) for o in b.outputs] and all(
        values(x) == pytest.approx(values(y), abs=1e-4) for x, y in zip(a.outputs, b.outputs))


@pytest.mark.parametrize("method, draft", [("none", None), ("self", None), ("draft", "draft")])
def test_cumulative_streams_end_as_generate(loaded, method, draft):
    """Concurrent requests (greedy and seeded sampled, one with n=2, logprobs): each stream
    grows (every text and token list a prefix of the next), only the last is finished, and
    that one equals ``LLM.generate``'s output for the request alone."""
    spec = SpecConfig(method=method, num_draft_tokens=3)
    sps = [SamplingParams(max_tokens=20, ignore_eos=True, logprobs=2),
           SamplingParams(max_tokens=16, temperature=1.0, seed=5, n=2, ignore_eos=True),
           SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=9)]
    llm = LLM(loaded("llama"), draft=draft and loaded(draft), speculative=spec, max_batch_size=3)
    want = [llm.generate(p, sp)[0] for p, sp in zip(PROMPTS, sps)]

    async def main():
        engine = AsyncLLM(llm)
        try:
            return await asyncio.gather(*(collect(engine, p, sp, f"r{i}") for i, (p, sp) in enumerate(zip(PROMPTS, sps))))
        finally:
            engine.shutdown()

    streams = run(main())
    for i, (outs, w) in enumerate(zip(streams, want)):
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True] and len(outs) > 2
        assert all(o.request_id == f"r{i}" for o in outs) and same(outs[-1], w)
        assert outs[-1].metrics["generated_tokens"] == w.metrics["generated_tokens"]
        for a, b in zip(outs, outs[1:]):
            for x, y in zip(a.outputs, b.outputs):
                assert y.text.startswith(x.text) and y.token_ids[:len(x.token_ids)] == x.token_ids
    assert llm.generate(PROMPTS[0], sps[0])[0].token_ids == want[0].token_ids  # shut down: generate works again


def test_delta_and_final_only(loaded):
    """DELTA: each completion's pieces add up to its whole output, its finish reason on its
    last piece; FINAL_ONLY: one output, the whole."""
    llm = LLM(loaded("llama"), speculative=SpecConfig(method="self"))
    sp = SamplingParams(max_tokens=14, temperature=1.0, seed=3, n=3, ignore_eos=True, logprobs=1,
                        output_kind=RequestOutputKind.DELTA)
    want = llm.generate(PROMPTS[0], sp)[0]

    async def main():
        with AsyncLLM(llm) as engine:
            delta = await collect(engine, PROMPTS[0], sp)
            final = await collect(engine, PROMPTS[0], SamplingParams(**{**sp.__dict__, "output_kind": 2}))
        return delta, final

    delta, final = run(main())
    for i, w in enumerate(want.outputs):
        pieces = [o for out in delta for o in out.outputs if o.index == i]
        assert "".join(o.text for o in pieces) == w.text and sum((o.token_ids for o in pieces), []) == w.token_ids
        assert len(sum((o.logprobs for o in pieces), [])) == len(w.logprobs)
        assert [o.finish_reason for o in pieces] == [None] * (len(pieces) - 1) + ["length"]
        assert pieces[-1].cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-3)
    assert delta[-1].finished and not any(o.finished for o in delta[:-1])
    assert len(final) == 1 and final[0].finished and same(final[0], want)


def test_stop_strings_wait_in_the_stream(loaded):
    """Text that could begin a stop string is not shown until it cannot: no output's text
    ever runs past the final (cut) text."""
    llm = LLM(loaded("llama"))
    base = llm.generate(PROMPTS[1], SamplingParams(max_tokens=24, ignore_eos=True))[0].text
    stop = base[10:13]
    sp = SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop])
    want = llm.generate(PROMPTS[1], sp)[0]
    assert want.finish_reason == "stop" and stop not in want.text

    async def main():
        with AsyncLLM(llm) as engine:
            return await collect(engine, PROMPTS[1], sp)

    outs = run(main())
    assert same(outs[-1], want) and all(want.text.startswith(o.text) for o in outs)


def test_abort_leave_early_and_errors(loaded):
    """``abort`` ends a stream with finish reason ``abort``; leaving a loop early frees the
    request's slot; a running request id, bad input or a shut-down engine are refused; the
    LLM's own generate waits for shutdown."""
    llm = LLM(loaded("llama"), max_batch_size=1)
    long = SamplingParams(max_tokens=400, ignore_eos=True)

    async def main():
        engine = AsyncLLM(llm)
        with pytest.raises(ValueError, match="being served"):
            llm.generate("abc", long)
        outs = []
        async for out in engine.generate(PROMPTS[0], long, "a"):
            outs.append(out)
            if len(outs) == 1:
                with pytest.raises(ValueError, match="running already"):
                    await anext(engine.generate(PROMPTS[0], long, "a"))
                await engine.abort("a")
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        assert len(outs[-1].token_ids) < 400
        async for out in engine.generate(PROMPTS[1], long):  # left early: the one slot is freed
            break
        short = await asyncio.wait_for(collect(engine, PROMPTS[2], SamplingParams(max_tokens=5, ignore_eos=True)), 60)
        assert len(short[-1].token_ids) == 5
        with pytest.raises(ValueError, match="max_tokens"):
            await anext(engine.generate("abc", SamplingParams(max_tokens=-1)))
        with pytest.raises(ValueError, match="exceeds|no room"):
            await anext(engine.generate("abc" * 400, SamplingParams(max_tokens=5)))
        engine.shutdown()
        with pytest.raises(RuntimeError, match="shut down"):
            await anext(engine.generate("abc", long))
        assert not engine.is_running and not engine.errored

    run(main())
    with pytest.raises(ValueError, match="RequestOutputKind"):
        SamplingParams(output_kind="delta")


def test_a_raising_logits_processor_fails_its_request_alone(loaded):
    """A request whose logits processor raises (here after 5 tokens, on the draft's rows and
    the target's) ends with that exception; the requests beside it in the batch go on and
    give what they give alone. ``LLM.generate`` raises it too, and serves the next call."""
    class Broken(Exception):
        pass

    def breaks(output, logits):
        if len(output) >= 5:
            raise Broken("no more")
        return logits

    llm = LLM(loaded("llama"), draft=loaded("noisy"), speculative=SpecConfig(method="draft", num_draft_tokens=3),
              max_batch_size=3)
    good = SamplingParams(max_tokens=24, ignore_eos=True)
    want = llm.generate(PROMPTS, good)

    async def main():
        with AsyncLLM(llm) as engine:
            bad = asyncio.create_task(collect(engine, PROMPTS[0], SamplingParams(max_tokens=24, logits_processors=[breaks])))
            outs = await asyncio.wait_for(asyncio.gather(*(collect(engine, p, good) for p in PROMPTS)), 60)
            with pytest.raises(Broken, match="no more"):
                await asyncio.wait_for(bad, 60)
            return outs

    outs = run(main())
    assert [o[-1].token_ids for o in outs] == [w.token_ids for w in want]
    with pytest.raises(Broken):
        llm.generate(PROMPTS, [good, SamplingParams(max_tokens=24, logits_processors=[breaks]), good])
    assert [o.token_ids for o in llm.generate(PROMPTS, good)] == [w.token_ids for w in want]


def test_shutdown_duplicates_capacity_and_prompt_logprobs(loaded):
    """A request still queued for the engine's thread when ``shutdown`` comes ends (abort)
    instead of hanging; two requests started at once with one id: one is refused; more
    completions than the engine holds are refused; prompt logprobs come with the first DELTA
    output and every CUMULATIVE one, as vLLM's."""
    import time

    def slow(output, logits):
        time.sleep(0.05)
        return logits

    llm = LLM(loaded("llama"), max_batch_size=1)

    async def main():
        engine = AsyncLLM(llm, max_queue=2)
        first = engine.generate(PROMPTS[0], SamplingParams(max_tokens=300, ignore_eos=True, logits_processors=[slow]))
        await anext(first)
        queued = asyncio.create_task(collect(engine, PROMPTS[1], SamplingParams(max_tokens=5)))
        await asyncio.sleep(0.01)  # prepared and handed to the engine's thread, mid-step
        engine.shutdown()
        last = [out async for out in first][-1]
        outs = await asyncio.wait_for(queued, 30)
        assert last.outputs[0].finish_reason == "abort" and outs[-1].outputs[0].finish_reason == "abort"

        engine = AsyncLLM(llm, max_queue=2)
        sp = SamplingParams(max_tokens=6, ignore_eos=True)
        both = await asyncio.gather(collect(engine, PROMPTS[0], sp, "same"), collect(engine, PROMPTS[1], sp, "same"),
                                    return_exceptions=True)
        assert sorted(type(b).__name__ for b in both) == ["ValueError", "list"]
        with pytest.raises(ValueError, match="4 completions exceed"):
            await anext(engine.generate(PROMPTS[0], SamplingParams(max_tokens=4, n=4, temperature=1.0)))
        kinds = {}
        for kind in RequestOutputKind:
            sp = SamplingParams(max_tokens=6, ignore_eos=True, prompt_logprobs=1, output_kind=kind)
            kinds[kind] = await collect(engine, PROMPTS[0], sp)
        engine.shutdown()
        return kinds

    kinds = run(main())
    want = llm.generate(PROMPTS[0], SamplingParams(max_tokens=6, ignore_eos=True, prompt_logprobs=1))[0].prompt_logprobs
    assert len(want) == len(llm.encode(PROMPTS[0])) and want[0] is None
    assert all(o.prompt_logprobs == want for o in kinds[RequestOutputKind.CUMULATIVE])
    delta = kinds[RequestOutputKind.DELTA]
    assert delta[0].prompt_logprobs == want and all(o.prompt_logprobs is None for o in delta[1:])
    assert [o.prompt_logprobs for o in kinds[RequestOutputKind.FINAL_ONLY]] == [want]
