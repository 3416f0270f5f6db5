"""A measured cost model: each step, choose the drafter and draft length k (0 = plain
decoding) that maximise expected committed tokens per second.

* ``ForwardCosts``: seconds of one forward of n tokens (batch 1), measured at load for
  n = 1..k+1 and cached on disk, keyed by model, runtime kind, dtype, device, threads and
  machine.
* ``Acceptance``: per request and per drafter, an online estimate of
  ``alpha_i = P(draft i accepted | drafts before i accepted)``, smoothed towards a prior
  that learns across requests, with recent steps weighing more.
* ``Planner``: for a chain of k drafts, ``E[committed] = 1 + sum_{i<=k} prod_{j<=i} alpha_j``
  and ``time = draft_time(k) + target(k+1)``; it picks the best (drafter, k), including k = 0.
  A drafter that has not been tried for a while gets a one-draft probe (with exponential
  back-off), so a request whose text turns predictable can start speculating again.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass(frozen=True)
class ForwardCosts:
    """``seconds[n - 1]``: one forward of n new tokens at batch size 1."""

    seconds: tuple[float, ...]

    def __call__(self, n: int) -> float:
        if n <= len(self.seconds):
            return self.seconds[n - 1]
        last = self.seconds[-1]  # linear extrapolation from the last measured step
        slope = (last - self.seconds[-2]) if len(self.seconds) > 1 else last
        return last + slope * (n - len(self.seconds))

    def relative(self) -> list[float]:
        return [s / self.seconds[0] for s in self.seconds]


def measure(runtime, max_tokens: int, context: int = 128, repeats: int = 3) -> ForwardCosts:
    """Time forwards of 1..max_tokens tokens after a ``context``-token prefix (median of
    ``repeats``, after one warm-up each)."""
    cache = runtime.new_cache(1)
    g = torch.Generator().manual_seed(0)
    vocab = min(runtime.vocab_size, 1000)
    prefix = torch.randint(0, vocab, (context,), generator=g).tolist()
    runtime.forward(cache, [0], [prefix], last_only=True)
    sync = torch.cuda.synchronize if getattr(runtime, "device", torch.device("cpu")).type == "cuda" else None
    seconds = []
    for n in range(1, max_tokens + 1):
        chunk = torch.randint(0, vocab, (n,), generator=g).tolist()
        times = []
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            runtime.forward(cache, [0], [chunk])
            if sync:
                sync()
            if r:  # the first run warms up
                times.append(time.perf_counter() - t0)
            cache.rewind(0, context)
        seconds.append(statistics.median(times))
    return ForwardCosts(tuple(seconds))


def cost_key(model, threads: int | None = None) -> str:
    rt = model.runtime
    kinds = sorted({layer["qkv"].kind for layer in getattr(rt, "layers", [])}) or [type(rt).__name__]
    kinds += ["multi-row"] if getattr(rt, "multi_row", False) else []
    return "|".join([str(model.path), type(rt).__name__, ",".join(kinds),
                     str(getattr(rt, "dtype", "")), str(getattr(rt, "device", "")),
                     f"threads={threads or torch.get_num_threads()}", _machine(), f"torch={torch.__version__}"])


def _machine() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + f" x{os.cpu_count()}"
    except OSError:
        pass
    return f"{platform.machine()} x{os.cpu_count()}"


def cache_file() -> Path:
    """``$SPECDEC_COST_CACHE``, else ``forward_costs.json`` in specdec's cache directory."""
    if os.environ.get("SPECDEC_COST_CACHE"):
        return Path(os.environ["SPECDEC_COST_CACHE"])
    root = os.environ.get("SPECDEC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "specdec")
    return Path(root) / "forward_costs.json"


def forward_costs(model, max_tokens: int) -> ForwardCosts:
    """Measured costs for ``model`` (a ``LoadedModel``), read from / written to the cache."""
    path, key = cache_file(), cost_key(model)
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    have = table.get(key, [])
    if len(have) < max_tokens:
        have = list(measure(model.runtime, max_tokens).seconds)
        table[key] = have
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(table, indent=1))
        tmp.replace(path)
    return ForwardCosts(tuple(have[:max_tokens]))


@dataclass
class Acceptance:
    """Smoothed counts per draft position: ``tried[i]`` steps reached position i (the
    drafts before it were accepted), ``accepted[i]`` of them accepted it. Older steps decay
    by ``decay`` per record."""

    prior: list[float]
    weight: float = 2.0
    decay: float = 0.95
    tried: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def alpha(self, i: int) -> float:
        p = self.prior[min(i, len(self.prior) - 1)]
        t = self.tried[i] if i < len(self.tried) else 0.0
        a = self.accepted[i] if i < len(self.accepted) else 0.0
        return (a + self.weight * p) / (t + self.weight)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.tried = [x * self.decay for x in self.tried]
        self.accepted = [x * self.decay for x in self.accepted]
        reached = min(num_accepted + 1, num_drafts)
        grow = reached - len(self.tried)
        self.tried += [0.0] * grow
        self.accepted += [0.0] * grow
        for i in range(reached):
            self.tried[i] += 1
            self.accepted[i] += i < num_accepted

    def expected_tokens(self, k: int) -> float:
        """Expected tokens committed by a verify step over k drafts (recovered/bonus included)."""
        total, reach = 1.0, 1.0
        for i in range(k):
            reach *= self.alpha(i)
            total += reach
        return total


@dataclass
class Choice:
    drafter: str | None  # None = plain decoding this step
    k: int
    tokens_per_s: float


@dataclass
class _Track:
    """A request's state with one drafter: its acceptance and when it was last tried."""

    acceptance: Acceptance
    idle: int = 0  # steps since this drafter last drafted for the request
    backoff: int = 8  # probe after this many idle steps; doubles after each failed probe


class Planner:
    """Chooses (drafter, k) per request and step from measured forward costs.

    ``draft_cost``: drafter name -> seconds per draft depth (0 for n-gram); ``target``: the
    target's ``ForwardCosts``; ``nodes``: drafter name -> (nodes per depth, node budget) for
    tree drafters (a verify step over depth k checks ``1 + min(budget, k * width)`` tokens;
    chains check ``k + 1``). A drafter may be unavailable for a step (n-gram without a
    match): pass ``available``.
    """

    def __init__(self, target: ForwardCosts, draft_cost: dict[str, float], k_max: int,
                 nodes: dict[str, tuple[int, int]] | None = None, prior: float = 0.6):
        self.target, self.draft_cost, self.k_max = target, draft_cost, k_max
        self.nodes = nodes or {}
        self.priors = {name: [prior] * k_max for name in draft_cost}  # learned across requests
        self.tracks: dict[int, dict[str, _Track]] = {}
        self.chosen_k: dict[int, int] = {}  # histogram of chosen k over all requests and steps

    def _tracks(self, request_id: int) -> dict[str, _Track]:
        if request_id not in self.tracks:
            self.tracks[request_id] = {n: _Track(Acceptance(list(self.priors[n]))) for n in self.draft_cost}
        return self.tracks[request_id]

    def rate(self, name: str, acc: Acceptance, k: int) -> float:
        width, budget = self.nodes.get(name, (1, k))
        seconds = self.target(1 + min(budget, k * width)) + self.draft_cost[name] * k
        return acc.expected_tokens(k) / seconds

    def choose(self, request_id: int, limit: int, available: set[str] | None = None) -> Choice:
        """Best (drafter, k <= min(k_max, limit)) for this request's next step."""
        best = Choice(None, 0, 1.0 / self.target(1))
        if limit <= 0:
            return best
        probe = None
        for name, track in self._tracks(request_id).items():
            if available is not None and name not in available:
                continue
            for k in range(1, min(self.k_max, limit) + 1):
                r = self.rate(name, track.acceptance, k)
                if r > best.tokens_per_s:
                    best = Choice(name, k, r)
            if track.idle >= track.backoff and probe is None:
                probe = Choice(name, 1, self.rate(name, track.acceptance, 1))
        if best.drafter is None and probe is not None:
            best = probe
        return best

    def record(self, request_id: int, choice: Choice, num_drafts: int, num_accepted: int) -> None:
        self.chosen_k[choice.k] = self.chosen_k.get(choice.k, 0) + 1
        for name, track in self._tracks(request_id).items():
            if name != choice.drafter or num_drafts == 0:
                track.idle += 1
                continue
            was_probe = track.idle >= track.backoff
            track.acceptance.record(num_drafts, num_accepted)
            track.idle = 0
            if was_probe and num_accepted == 0:
                track.backoff *= 2
            elif num_accepted:
                track.backoff = 8

    def release(self, request_id: int) -> None:
        """A request finished: fold its acceptance into the prior for later requests."""
        for name, track in self.tracks.pop(request_id, {}).items():
            acc = track.acceptance
            if acc.tried and acc.tried[0] >= 1:
                self.priors[name] = [0.5 * p + 0.5 * acc.alpha(i) for i, p in enumerate(self.priors[name])]
