"""A measured cost model: each step, choose the drafter and draft length k (0 = plain
decoding) that maximise expected committed tokens per second.

* ``ForwardCosts``: seconds of one forward of n tokens (batch 1), measured at load for
  n = 1..k+1 and cached on disk, keyed by model, runtime kind, dtype, device, threads and
  machine.
* ``Acceptance``: an online estimate of ``alpha_i = P(draft i accepted | drafts before i
  accepted)``, with recent steps weighing more: per request for a draft model (smoothed
  towards a prior learned from finished requests), per *context* for the n-gram drafter
  (the length of the match it drafts from, learned across requests).
* ``Planner``: for a chain of k drafts, ``E[committed] = 1 + sum_{i<=k} prod_{j<=i} alpha_j``
  and ``time = draft_time(k) + target(k+1)``, where a model drafter's first depth is a
  forward over the tokens it has not seen yet (a long one spread over the tokens the request
  has left, see ``DraftCost``), and the target's measured costs are corrected
  online by the verify steps actually timed, a model drafter's by its drafting steps; it picks the best (drafter, k), including k = 0.
  A drafter that has not been tried for a while gets a one-draft probe (with exponential
  back-off until it is chosen on merit again, and only if perfect drafts would gain 10%), so a
  request whose text turns predictable can start speculating again.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from . import disk_cache

LONG_TOKENS = 64  # one longer forward is measured too: it prices a draft model's long catch-up
STEADY_BEHIND = 2  # tokens a draft model in use is behind at each step (last draft, bonus)
CATCH_UP_HORIZON = 256  # a long catch-up is spread over at most this many tokens (requests stop early)
# how a runtime runs a batch's chunks: one forward with every chunk padded to the longest
# (torch), one forward over all their rows (llama.cpp), or one forward per chunk (transformers)
BATCH_LAYOUTS = ("padded", "packed", "serial")


@dataclass(frozen=True)
class ForwardCosts:
    """``seconds[n - 1]``: one forward of n new tokens at batch size 1, for n = 1..len;
    ``long``: (n, seconds) of one longer forward. Beyond the measured sizes the cost grows
    linearly towards (and past) ``long``, else at the measured sizes' mean slope; never
    downwards (measured costs are not monotone: at 16 tokens llama.cpp may be faster than at
    15, and a negative slope would price a 200-token catch-up below zero)."""

    seconds: tuple[float, ...]
    long: tuple[int, float] | None = None

    def __call__(self, n: int) -> float:
        m, last = len(self.seconds), self.seconds[-1]
        if n <= m:
            return self.seconds[n - 1]
        if self.long is not None and self.long[0] > m:
            slope = (self.long[1] - last) / (self.long[0] - m)
        else:
            slope = (last - self.seconds[0]) / (m - 1) if m > 1 else last
        return last + max(slope, 0.0) * (n - m)


def forward_seconds(runtime, cache, tokens: list[int], last_only: bool) -> float:
    """The time of one forward of ``tokens`` into slot 0 of ``cache`` (on CUDA, to its end)."""
    device = getattr(runtime, "device", torch.device("cpu"))
    t0 = time.perf_counter()
    runtime.forward(cache, [0], [tokens], last_only=last_only)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def measure(runtime, max_tokens: int, context: int = 128, repeats: int = 3) -> ForwardCosts:
    """Time forwards of 1..max_tokens tokens, and of ``LONG_TOKENS`` (at most half the
    model's context), after a ``context``-token prefix: the least of ``repeats`` rounds over
    all sizes in turn (load only adds time: a slow spell over two rounds of a size made its
    median dear, and the cached curve kept it), after one warm-up round."""
    long_n = min(LONG_TOKENS, runtime.max_context // 2)  # a short context (a small draft's) fits it
    context = max(0, min(context, runtime.max_context - max(long_n, max_tokens)))
    cache = runtime.new_cache(1)
    g = torch.Generator().manual_seed(0)
    vocab = min(runtime.vocab_size, 1000)
    if context:
        runtime.forward(cache, [0], [torch.randint(0, vocab, (context,), generator=g).tolist()], last_only=True)
    sizes = list(range(1, max_tokens + 1)) + ([long_n] if long_n > max_tokens else [])
    chunks = {n: torch.randint(0, vocab, (n,), generator=g).tolist() for n in sizes}
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for r in range(repeats + 1):
        for n in sizes:
            seconds = forward_seconds(runtime, cache, chunks[n], last_only=False)
            if r:  # round 0 warms up
                times[n].append(seconds)
            cache.rewind(0, context)
    seconds = tuple(min(times[n]) for n in range(1, max_tokens + 1))
    long = (long_n, min(times[long_n])) if long_n > max_tokens else None
    return ForwardCosts(seconds, long)


def cost_key(model) -> str:
    """The measured cost curve's cache key: the model, its runtime's ``speed_key``, the
    threads (llama.cpp's own, else torch's), the machine and the torch version."""
    rt = model.runtime
    device = getattr(rt, "device", torch.device("cpu"))
    gpu = [torch.cuda.get_device_name(device)] if device.type == "cuda" else []
    return "|".join([str(model.path), type(rt).__name__, rt.speed_key, *gpu,
                     f"threads={getattr(rt, 'threads', None) or torch.get_num_threads()}",
                     disk_cache.machine(), f"torch={torch.__version__}"])


def cache_file() -> Path:
    """``$SPECDEC_COST_CACHE``, else ``forward_costs.json`` in specdec's cache directory."""
    return Path(os.environ.get("SPECDEC_COST_CACHE") or disk_cache.directory() / "forward_costs.json")


STALE_RATIO = 1.5  # a cached one-token time this many times today's was measured under load


def measured_under_load(runtime, cached: dict) -> bool:
    """Whether a cached curve's one-token time is ``STALE_RATIO`` times what the least of a few
    one-token forwards takes now: it was measured under load, and kept it for good (a 135M
    model cached at 635 ms a token priced a random draft model into 0.63x plain decoding).
    A curve cheaper than now is kept: now is what is loaded."""
    if not isinstance(cached.get("seconds"), list) or not cached["seconds"]:
        return True
    cache = runtime.new_cache(1)
    token = [min(runtime.vocab_size, 1000) - 1]
    times = []
    for _ in range(4):
        times.append(forward_seconds(runtime, cache, token, last_only=True))
        cache.rewind(0, 0)
    return cached["seconds"][0] > STALE_RATIO * min(times[1:])  # the first warms up


def forward_costs(model, max_tokens: int) -> ForwardCosts:
    """Measured costs for ``model`` (a ``LoadedModel``), read from / written to the cache."""
    path, key = cache_file(), cost_key(model)
    have = disk_cache.read(path).get(key)  # {"seconds": [...], "long": [n, seconds] or null}
    if not isinstance(have, dict) or len(have["seconds"]) < max_tokens or measured_under_load(model.runtime, have):
        costs = measure(model.runtime, max_tokens)
        have = {"seconds": list(costs.seconds), "long": costs.long and list(costs.long)}
        disk_cache.store(path, key, have)
    long = have.get("long")
    return ForwardCosts(tuple(have["seconds"][:max_tokens]), tuple(long) if long else None)


@dataclass
class Acceptance:
    """Smoothed counts per draft position: ``tried[i]`` steps reached position i (the
    drafts before it were accepted), ``accepted[i]`` of them accepted it. Older steps decay
    by ``decay`` per record.

    Position i's estimate is smoothed towards its ``prior`` scaled by how position i-1 does
    against its own prior, so a position the request has not reached yet leans on the one
    before it: drafts accepted at depths 0-1 raise the estimate of depth 2, and the planner
    tries deeper drafts instead of staying at the depths it has evidence for."""

    prior: list[float]
    weight: float = 2.0
    decay: float = 0.95
    tried: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def alphas(self, k: int, prior: float | None = None) -> list[float]:
        """``alpha_i`` for i < k; ``prior``: smooth position 0 towards this instead."""
        out, ratio = [], 1.0  # ratio: the previous position's estimate over its prior
        for i in range(k):
            p = self.prior[min(i, len(self.prior) - 1)] if i or prior is None else prior
            t = self.tried[i] if i < len(self.tried) else 0.0
            a = self.accepted[i] if i < len(self.accepted) else 0.0
            out.append((a + self.weight * min(1.0, p * ratio)) / (t + self.weight))
            ratio = out[-1] / p if p > 0 else 1.0
        return out

    def alpha(self, i: int, prior: float | None = None) -> float:
        return self.alphas(i + 1, prior)[i]

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

    def expected_upto(self, k: int) -> list[float]:
        """Expected tokens committed by a verify step over j drafts (recovered/bonus included),
        for j = 0..k, in one pass (the planner weighs every k)."""
        return chain_tokens(self.alphas(k))


def chain_tokens(alphas: list[float]) -> list[float]:
    """``1 + sum_{i<j} prod_{l<=i} alpha_l`` for j = 0..len(alphas): the tokens a chain step of
    j drafts is expected to commit."""
    out, reach = [1.0], 1.0
    for a in alphas:
        reach *= a
        out.append(out[-1] + reach)
    return out


def match_bucket(m: int) -> int:
    """Match lengths grouped for learning: 1..6 alone, then 7-10, 11-16, 17-24, 25+."""
    return m if m <= 6 else 7 if m <= 10 else 8 if m <= 16 else 9 if m <= 24 else 10


@dataclass
class MatchAcceptance:
    """Acceptance of a draft that copies what followed an earlier match of the text's last
    ``match`` tokens (the n-gram drafter's int context): once draft i-1 is accepted, draft i
    continues a match of ``match + i`` tokens, so ``alpha_i`` is the first-draft acceptance
    learned for matches that long (across requests). Every step then teaches every depth, and
    a long copy is trusted as deep as its match lengths have earned."""

    planner: "Planner"
    name: str
    match: int
    request_id: int

    def alpha(self, i: int) -> float:
        """The request's own record at this match length, smoothed towards the table learned
        across requests (a request whose copies go wrong stops trusting them quickly)."""
        shared = self.planner._first(self.name, self.match + i).alpha(0)
        return self.planner._first(self.name, self.match + i, self.request_id).alpha(0, prior=shared)

    def expected_upto(self, k: int) -> list[float]:
        return chain_tokens([self.alpha(i) for i in range(k)])

    def record(self, num_drafts: int, num_accepted: int) -> None:
        for i in range(min(num_accepted + 1, num_drafts)):  # draft i was reached
            for request in (None, self.request_id):
                self.planner._first(self.name, self.match + i, request).record(1, int(i < num_accepted))


LEVEL_RATE = 0.3  # weight of a verify step's timing in the current speed level of all forwards
DRAFT_RATE = 0.2  # weight of a drafting step's timing in its drafter's correction (log space)
SHAPE_RATE = 0.1  # ... in its size's cost relative to that level (the verify-cost correction)
SHAPE_GRACE, SHAPE_HALF_LIFE = 16, 50  # a size not timed for 16 verify steps: its correction
# fades towards 1, halving every 50 steps
PROBE_MARGIN = 1.1  # probe a drafter only if perfect drafts would beat plain decoding by this much
PROBE_BACKOFF = 8  # idle steps before a drafter's first probe (doubling after each that does not pay)
PROBE_BACKOFF_CARRIED = 64  # the most of a back-off a new request takes over (else one bad stretch
# of requests doubled it past any request's length, and the drafter was never tried again)


@dataclass(frozen=True)
class StatsKey:
    """Whose acceptance an ``Acceptance`` in ``Planner.stats`` records: a drafter's, in one
    request (``request_id``) or across requests (None); for a whole draft (``match`` None) or
    for first drafts after a match of one ``match_bucket``."""

    name: str
    request_id: int | None
    match: int | None = None


@dataclass
class Choice:
    drafter: str | None  # None = plain decoding this step
    k: int
    tokens_per_s: float  # expected, for this request alone
    context: int | None = None  # the n-gram drafter's match length this step (see ``Planner``)
    probe: bool = False  # chosen to re-test the drafter, not for its expected rate


@dataclass(frozen=True)
class Ask:
    """What ``Planner.choose`` needs of one request for its next step."""

    request_id: int
    limit: int  # most drafts it may take (0: none)
    available: dict[str, int | None] | None = None  # drafters that can draft: their contexts
    behind: dict[str, int] | None = None  # tokens each model drafter must catch up on first
    left: int | None = None  # tokens the request may still generate


@dataclass
class _Track:
    """A request's state with one drafter: when it was last tried."""

    idle: int = 0  # steps since this drafter last drafted for the request
    backoff: int = PROBE_BACKOFF  # probe after this many idle steps; doubles after each probe that does not pay


@dataclass(frozen=True)
class DraftCost:
    """What drafting costs: ``per_depth`` seconds for each depth after the first; the first
    depth is a forward over the tokens the drafter has not seen yet (``catch_up``: its
    ``ForwardCosts``; None for a drafter without a model, e.g. n-gram, whose every depth
    costs ``per_depth``).

    A catch-up longer than a drafting step leaves behind (``STEADY_BEHIND``: the last draft
    and the bonus token) is an investment: a draft model catches up on each committed token
    once and then serves the rest of the request. ``share`` is the part of that excess charged
    to this step (the planner spreads it over the tokens the request has left)."""

    per_depth: float = 0.0
    catch_up: ForwardCosts | None = None

    def __call__(self, k: int, behind: int = 1, share: float = 1.0) -> float:
        if k == 0:
            return 0.0
        if self.catch_up is None:
            return self.per_depth * k
        behind = max(behind, 1)
        steady = self.catch_up(min(behind, STEADY_BEHIND))
        return steady + share * (self.catch_up(behind) - steady) + self.per_depth * (k - 1)


class Planner:
    """Chooses (drafter, k) per request and step from measured forward costs.

    ``draft_cost``: drafter name -> ``DraftCost`` (or seconds per depth); ``target``: the
    target's ``ForwardCosts``; ``nodes``: drafter name -> (nodes per depth, node budget) for
    tree drafters (a verify step over depth k checks ``1 + min(budget, k * width)`` tokens;
    chains check ``k + 1``).

    ``choose(Ask(..., available={name: context}))`` lists the drafters that can draft this step
    (n-gram only with a match) and each one's *context*. The n-gram drafter's is the length
    of the longest earlier match of the text's end (a long match is a copy in progress), whose
    acceptance is learned across requests (``MatchAcceptance``); ``None`` (a draft model)
    learns per request instead, starting from a prior learned from the finished requests.
    ``behind``: tokens a model drafter must catch up on before its first depth (it skips the
    steps it does not draft); ``left``: tokens the request may still generate (see
    ``DraftCost``). ``layout``: how the target runtime runs a batch (``BATCH_LAYOUTS``), for
    ``choose_batch``.
    """

    def __init__(self, target: ForwardCosts, draft_cost: dict[str, DraftCost | float], k_max: int,
                 nodes: dict[str, tuple[int, int]] | None = None, prior: float = 0.6,
                 layout: str = "padded"):
        if layout not in BATCH_LAYOUTS:
            raise ValueError(f"unknown batch layout {layout!r}; choose {', '.join(BATCH_LAYOUTS)}")
        self.target, self.k_max, self.layout = target, k_max, layout
        self.draft_cost = {n: c if isinstance(c, DraftCost) else DraftCost(c) for n, c in draft_cost.items()}
        self.nodes = nodes or {}
        self.priors = {name: [prior] * k_max for name in draft_cost}  # learned across requests
        self.stats: dict[StatsKey, Acceptance] = {}
        self.tracks: dict[int, dict[str, _Track]] = {}
        self.level = 1.0  # observed / measured seconds of recent verify steps, any size
        # verify tokens -> (its observed / measured over the level, ``verify_steps`` when last timed)
        self.shape: dict[int, tuple[float, int]] = {}
        self.verify_steps = 0
        # model drafter -> (its drafting's observed / measured seconds lately, ``verify_steps`` when last timed)
        self.drafting: dict[str, tuple[float, int]] = {}
        # each drafter's probe back-off, carried to the next request (every request probing a
        # drafter that never pays from scratch cost ~5% a request)
        self.backoff = {name: PROBE_BACKOFF for name in draft_cost}

    def _tracks(self, request_id: int) -> dict[str, _Track]:
        if request_id not in self.tracks:
            self.tracks[request_id] = {n: _Track(backoff=min(self.backoff[n], PROBE_BACKOFF_CARRIED))
                                       for n in self.draft_cost}
        return self.tracks[request_id]

    def acceptance(self, name: str, context: int | None, request_id: int) -> Acceptance:
        """The acceptance estimate for a draft from ``context``: a match length (see
        ``MatchAcceptance``), or None for the request's own record."""
        if context is not None:
            return MatchAcceptance(self, name, context, request_id)
        key = StatsKey(name, request_id)
        if key not in self.stats:
            self.stats[key] = Acceptance(list(self.priors[name]))
        return self.stats[key]

    def _first(self, name: str, match: int, request_id: int | None = None) -> Acceptance:
        """Acceptance of a first draft token that continues a match of ``match`` tokens,
        across requests (``request_id`` None) or in one request."""
        key = StatsKey(name, request_id, match_bucket(match))
        if key not in self.stats:
            self.stats[key] = Acceptance(self.priors[name][:1])
        return self.stats[key]

    def rate(self, name: str, tokens: float, k: int, behind: int = 1, left: int | None = None) -> float:
        """Expected committed tokens per second of a step drafting k with ``name`` that is
        expected to commit ``tokens``; ``left``: tokens the request may still generate, over
        which a long catch-up is spread."""
        seconds = self.verify_seconds(self.verify_rows(name, k)) + self.draft_seconds(name, tokens, k, behind, left)
        return tokens / seconds

    def verify_rows(self, name: str | None, k: int) -> int:
        """Tokens a verify step over k drafts of ``name`` checks (a tree: its node budget)."""
        width, budget = self.nodes.get(name, (1, k))
        return 1 + min(budget, k * width)

    def draft_seconds(self, name: str | None, tokens: float, k: int, behind: int = 1,
                      left: int | None = None) -> float:
        """Drafting k with ``name`` for a step expected to commit ``tokens``."""
        if name is None or k == 0:
            return 0.0
        share = 1.0 if left is None else min(1.0, tokens / min(left, CATCH_UP_HORIZON))
        return self.draft_cost[name](k, behind, share) * self.draft_factor(name)

    def draft_factor(self, name: str) -> float:
        """How ``name``'s drafting has compared lately with its measured forwards (its own
        Python and sampling included, which the measurement leaves out), over the target's
        ``level``: what slows both alike changes no choice. Not timed for a while, it fades
        towards 1 as ``_shape`` does (a drafter priced out is never timed again)."""
        if name not in self.drafting:
            return 1.0
        ratio, timed = self.drafting[name]
        fade = 0.5 ** (max(self.verify_steps - timed - SHAPE_GRACE, 0) / SHAPE_HALF_LIFE)
        return 1.0 + (ratio / self.level - 1.0) * fade

    def observe_draft(self, name: str, items: list[tuple[int, int]], seconds: float) -> None:
        """A drafting step of model drafter ``name``, drafting ``(k, behind)`` for each request
        of a batch, took ``seconds`` (its whole catch-up included)."""
        cost = self.draft_cost[name]
        predicted = self._batch_drafting(name, [cost(k, behind) for k, behind in items])
        if predicted > 0 and seconds > 0:
            ratio = self.draft_factor(name) * self.level  # the faded ratio, as the planner prices it now
            # in log space, a step counting for at most a doubling or a halving: a spike (a CUDA
            # graph captured in the step) moves it by 15% at most, a lasting change in ~20 steps
            step = max(-1.0, min(1.0, math.log2(seconds / predicted / ratio)))
            self.drafting[name] = (ratio * 2 ** (DRAFT_RATE * step), self.verify_steps)

    def _batch_drafting(self, name: str, seconds: list[float]) -> float:
        """A batch drafting with ``name``, each request's drafting alone taking ``seconds``: the
        dearest one's, scaled by the cost of one forward over all their rows against one row
        (a batch drafts in the same forwards)."""
        cost = self.draft_cost[name]
        return max(seconds) * (cost.catch_up(len(seconds)) / cost.catch_up(1) if cost.catch_up else 1.0)

    def could_pay(self, name: str, limit: int, behind: int = 1, left: int | None = None) -> bool:
        """Whether ``name`` would beat plain decoding by ``PROBE_MARGIN`` if every draft were
        accepted. A probe is pointless otherwise: e.g. a draft model that must first catch up on
        a whole prompt a short request cannot repay, or one that costs so much that even its
        best case gains a few percent (the probes' losses would eat that)."""
        plain = PROBE_MARGIN / self.verify_seconds(1)
        return any(self.rate(name, k + 1, k, behind, left) > plain for k in range(1, min(self.k_max, limit) + 1))

    def verify_seconds(self, n: int) -> float:
        """A target forward of n tokens: the measured cost, times how this process's verify
        steps of n tokens have compared lately with its verify steps of every size
        (``shape``, 1 for a size not seen yet). What slows every forward alike (another
        process on the CPU, a longer context) goes into ``level`` and is left out: it slows
        drafting as much and changes no choice. Kept per size instead, a passing load made
        the sizes timed under it look dear for good, since a size not chosen is never timed
        again (a bench run with the CPU shared for a few minutes then stayed at k <= 1)."""
        return self.target(n) * self._shape(n)

    def _shape(self, n: int) -> float:
        """``shape[n]``, faded towards 1 by the verify steps since n was last timed."""
        if n not in self.shape:
            return 1.0
        shape, timed = self.shape[n]
        fade = 0.5 ** (max(self.verify_steps - timed - SHAPE_GRACE, 0) / SHAPE_HALF_LIFE)
        return 1.0 + (shape - 1.0) * fade

    def observe_verify(self, n: int, seconds: float) -> None:
        """A verify forward of n rows (``batch_rows``) took ``seconds``. Real requests have
        longer contexts than the measurement's 128 tokens, and there a forward of several
        tokens can cost relatively more (on llama.cpp, 5 tokens after ~600: about 3x one
        token instead of the measured 2.5x); ``shape`` learns that where sizes are timed
        side by side (the level follows whatever is timed most). The correction of a size
        not timed fades back to the measurement, so none is ruled out for good."""
        self.verify_steps += 1
        ratio = seconds / self.target(n)
        shape = self._shape(n)
        self.level += LEVEL_RATE * (ratio / shape - self.level)
        self.shape[n] = (shape + SHAPE_RATE * (ratio / self.level - shape), self.verify_steps)
        # only sizes timed side by side tell their shapes apart: those timed lately keep a
        # geometric mean of 1, the rest going into the level (else a load spike timed on one
        # size left its correction there for good: always-rejected drafts at 0.9x plain)
        recent = [m for m, (_, timed) in self.shape.items() if self.verify_steps - timed <= SHAPE_GRACE]
        mean = math.exp(sum(math.log(self.shape[m][0]) for m in recent) / len(recent))
        for m in recent:
            self.shape[m] = (self.shape[m][0] / mean, self.shape[m][1])
        self.level *= mean

    def choose(self, ask: Ask) -> Choice:
        """Best (drafter, k <= min(k_max, ask.limit)) for this request's next step."""
        request_id, limit, left = ask.request_id, ask.limit, ask.left
        best = Choice(None, 0, 1.0 / self.verify_seconds(1))
        if limit <= 0:
            return best
        available = {n: None for n in self.draft_cost} if ask.available is None else ask.available
        behind = ask.behind or {}
        probe = None
        for name, track in self._tracks(request_id).items():
            if name not in available:
                continue
            ctx, lag = available[name], behind.get(name, 1)
            expected = self.acceptance(name, ctx, request_id).expected_upto(min(self.k_max, limit))
            for k in range(1, len(expected)):
                r = self.rate(name, expected[k], k, lag, left)
                if r > best.tokens_per_s:
                    best = Choice(name, k, r, ctx)
            if track.idle >= track.backoff and probe is None and self.could_pay(name, limit, lag, left):
                probe = Choice(name, 1, self.rate(name, expected[1], 1, lag, left), ctx, probe=True)
        if best.drafter is None and probe is not None:
            best = probe
        return best

    def choose_batch(self, asks: list[Ask]) -> list[Choice]:
        """Choices for the requests of one step. ``choose`` prices a request's verify rows as
        if it ran alone; in a batch they share one forward, whose cost grows with all its rows
        (padded: the batch size times the longest chunk). So each request's own choice is
        capped at the common k that gives the whole step the most expected tokens per second:
        the verify forward over the batch, plus, per draft model, its dearest request's
        drafting scaled by the cost of one forward over all its requests' rows against one
        row (a batch drafts in the same forwards). One request alone, or a ``serial`` layout
        (its forwards add up per request), keeps its own choices."""
        own = [self.choose(a) for a in asks]
        if len(asks) == 1 or self.layout == "serial":
            return own
        expected = [self.acceptance(c.drafter, c.context, a.request_id).expected_upto(c.k) if c.k else [1.0]
                    for a, c in zip(asks, own)]  # per request: its expected tokens for k = 0..its own k
        best, best_rate = 0, 0.0
        for cap in range(max(c.k for c in own) + 1):
            ks = [min(c.k, cap) for c in own]
            rate = self._step_rate(asks, own, ks, [e[k] for e, k in zip(expected, ks)])
            if rate > best_rate:
                best, best_rate = cap, rate
        return [c if c.k <= best else replace(c, k=best) if best else Choice(None, 0, 1.0 / self.verify_seconds(1))
                for c in own]

    def batch_rows(self, sizes: list[int]) -> int | None:
        """The rows of one forward over chunks of ``sizes`` tokens, by ``layout`` (None:
        ``serial``, several forwards)."""
        if len(sizes) == 1:
            return sizes[0]
        return {"padded": len(sizes) * max(sizes), "packed": sum(sizes)}.get(self.layout)

    def _step_rate(self, asks: list[Ask], own: list[Choice], ks: list[int], tokens: list[float]) -> float:
        """Expected tokens per second of a batch step: request i drafts ``ks[i]`` with
        ``own[i].drafter``, expected to commit ``tokens[i]``."""
        seconds = self.verify_seconds(self.batch_rows([self.verify_rows(c.drafter, k) for c, k in zip(own, ks)]))
        for name in self.draft_cost:
            mine = [i for i, (c, k) in enumerate(zip(own, ks)) if c.drafter == name and k]
            if mine:
                seconds += self._batch_drafting(name, [self.draft_seconds(
                    name, tokens[i], ks[i], (asks[i].behind or {}).get(name, 1), asks[i].left) for i in mine])
        return sum(tokens) / seconds

    def record(self, request_id: int, choice: Choice, depth: int, num_accepted: int) -> None:
        """A verify step of ``choice`` whose draft reached ``depth`` (a chain's length, a
        tree's deepest path) and had ``num_accepted`` of those accepted."""
        for name, track in self._tracks(request_id).items():
            if name != choice.drafter or depth == 0:
                track.idle += 1
                continue
            self.acceptance(name, choice.context, request_id).record(depth, num_accepted)
            track.idle = 0
            # a probe re-tests a drafter that did not pay; it is tried again on merit (its
            # acceptance estimate now includes the probe) or after twice the wait
            track.backoff = track.backoff * 2 if choice.probe else PROBE_BACKOFF
            self.backoff[name] = track.backoff

    def release(self, request_id: int) -> None:
        """A request finished: fold its per-request acceptance into the prior for later requests."""
        self.tracks.pop(request_id, None)
        for key in [k for k in self.stats if k.match is not None and k.request_id == request_id]:
            del self.stats[key]
        for name in self.draft_cost:
            acc = self.stats.pop(StatsKey(name, request_id), None)
            if acc is not None and acc.tried and acc.tried[0] >= 1:
                self.priors[name] = [0.5 * p + 0.5 * a for p, a in zip(self.priors[name], acc.alphas(self.k_max))]
