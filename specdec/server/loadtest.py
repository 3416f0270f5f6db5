"""``specdec loadtest``: N concurrent streaming clients for T seconds against a running server.

First each prompt of a small pool is sent alone (greedy) to get its reference output; then
N clients send requests back to back until T seconds have passed, each request a pool
prompt, streamed, greedy. Every response must come back complete (``[DONE]``, a finish
reason, usage) and equal its own prompt's reference, usage included: a response
that equals another prompt's reference was crossed, one that equals none diverged.
Reports requests/s, output tokens/s and p50/p99 time to first token and latency.
"""
from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass

WORDS = ("apple river stone cloud tiger lemon piano rocket garden silver window candle "
         "forest planet bottle mirror dragon pencil valley castle orange spider rabbit "
         "ocean violet hammer thunder marble saddle lantern meadow").split()


def prompt_pool(size: int, seed: int = 0) -> list[dict]:
    """Distinct prompts, half chat and half completion, each asking for a copy of its own list."""
    rng = random.Random(seed)
    pool = []
    for i in range(size):
        words = " ".join(rng.choice(WORDS) for _ in range(8))
        if i % 2:
            pool.append({"chat": True, "messages": [{"role": "user", "content":
                         f"Repeat this list of words exactly, once, then stop: {words}"}]})
        else:
            pool.append({"chat": False, "prompt": f"List {i}: {words}\nThe same list again: "})
    return pool


@dataclass
class Result:
    ok: bool
    tokens: int
    ttft: float | None
    latency: float
    problem: str = ""


async def one(client, url: str, model: str, p: dict, max_tokens: int, headers: dict) -> tuple[str, int, float | None, str]:
    """Send one streaming request; return (text, completion tokens, ttft, problem or '')."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if p["chat"]:
        path, body["messages"] = "/v1/chat/completions", p["messages"]
    else:
        path, body["prompt"] = "/v1/completions", p["prompt"]
    start = time.perf_counter()
    parts, ttft, usage, reason, done = [], None, None, None, False
    async with client.stream("POST", url + path, json=body, headers=headers) as r:
        if r.status_code != 200:
            return "", 0, None, f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            ev = json.loads(line[6:])
            if "error" in ev:
                return "".join(parts), 0, ttft, f"error event: {ev['error']}"
            if ev.get("usage"):
                usage = ev["usage"]
            for ch in ev.get("choices", []):
                piece = (ch["delta"].get("content") or "") if p["chat"] else ch["text"]
                if piece and ttft is None:
                    ttft = time.perf_counter() - start
                parts.append(piece)
                reason = ch.get("finish_reason") or reason
    text = "".join(parts)
    if not done:
        return text, 0, ttft, "stream ended without [DONE]"
    if reason not in ("stop", "length"):
        return text, 0, ttft, f"finish_reason {reason!r}"
    if usage is None:
        return text, 0, ttft, "no usage chunk"
    return text, usage["completion_tokens"], ttft, ""


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q / 100 * (len(v) - 1))))]


async def run(url: str, clients: int, duration: float, max_tokens: int, pool_size: int,
              api_key: str | None) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        models = (await client.get(url + "/v1/models", headers=headers)).raise_for_status().json()
        model = models["data"][0]["id"]
        pool = prompt_pool(pool_size)
        refs = []
        for p in pool:  # each alone: the reference
            text, tokens, _, problem = await one(client, url, model, p, max_tokens, headers)
            if problem:
                raise RuntimeError(f"reference request failed: {problem}")
            refs.append((text, tokens))

        results: list[Result] = []
        deadline = time.perf_counter() + duration

        async def worker(c: int) -> None:
            j = 0
            while time.perf_counter() < deadline:
                k = (c + j * clients) % len(pool)
                j += 1
                t0 = time.perf_counter()
                try:
                    text, tokens, ttft, problem = await one(client, url, model, pool[k], max_tokens, headers)
                except Exception as e:  # connection errors count as failures, the run goes on
                    text, tokens, ttft, problem = "", 0, None, f"{type(e).__name__}: {e}"
                if not problem and text != refs[k][0]:
                    others = [i for i, (r, _) in enumerate(refs) if r == text and i != k]
                    problem = f"crossed (got prompt {others[0]}'s output)" if others else "diverged from reference"
                elif not problem and tokens != refs[k][1]:
                    problem = f"usage says {tokens} completion tokens, the reference {refs[k][1]}"
                results.append(Result(not problem, tokens, ttft, time.perf_counter() - t0, problem))

        start = time.perf_counter()
        await asyncio.gather(*(worker(c) for c in range(clients)))
        elapsed = time.perf_counter() - start

    good = [r for r in results if r.ok]
    return {
        "url": url, "model": model, "clients": clients, "duration_s": duration, "elapsed_s": round(elapsed, 2),
        "max_tokens": max_tokens, "prompts": len(pool),
        "requests": len(results), "ok": len(good), "failed": len(results) - len(good),
        "requests_per_s": round(len(good) / elapsed, 3),
        "output_tokens_per_s": round(sum(r.tokens for r in good) / elapsed, 2),
        "ttft_p50_s": _r(pct([r.ttft for r in good if r.ttft is not None], 50)),
        "ttft_p99_s": _r(pct([r.ttft for r in good if r.ttft is not None], 99)),
        "latency_p50_s": _r(pct([r.latency for r in good], 50)),
        "latency_p99_s": _r(pct([r.latency for r in good], 99)),
        "problems": sorted({r.problem for r in results if r.problem})[:10],
    }


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def main(a) -> int:
    if a.clients < 1 or a.duration <= 0 or a.max_tokens < 1 or a.prompts < 1:
        raise ValueError("need --clients >= 1, --duration > 0, --max-tokens >= 1 and --prompts >= 1")
    try:
        report = asyncio.run(run(a.url.rstrip("/"), a.clients, a.duration, a.max_tokens, a.prompts, a.api_key))
    except (OSError, RuntimeError) as e:
        raise ValueError(f"load test against {a.url} failed: {e}") from None
    except Exception as e:  # httpx errors (connection refused, HTTP status) without a traceback
        if type(e).__module__.startswith("httpx"):
            raise ValueError(f"load test against {a.url} failed: {e}") from None
        raise
    if a.json:
        print(json.dumps(report))
    else:
        print(f"clients={report['clients']} duration={report['elapsed_s']}s requests={report['requests']} "
              f"ok={report['ok']} failed={report['failed']} req/s={report['requests_per_s']} "
              f"tok/s={report['output_tokens_per_s']} ttft p50={report['ttft_p50_s']}s "
              f"p99={report['ttft_p99_s']}s latency p50={report['latency_p50_s']}s p99={report['latency_p99_s']}s")
        for p in report["problems"]:
            print(f"  problem: {p}", file=sys.stderr)
    return 0 if report["failed"] == 0 and report["ok"] > 0 else 1
