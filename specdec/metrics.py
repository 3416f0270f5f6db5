"""Counters per request and per run. Names are part of the API (``--json`` output)."""
from __future__ import annotations

from dataclasses import dataclass, field

PHASES = ("prefill", "draft", "verify", "bookkeeping")  # an engine step's parts, in time_split_s


@dataclass(frozen=True)
class Mark:
    """The engine's clock between steps: the step begun last (``step``), what all steps so far
    spent in each phase (``spent``, seconds by ``PHASES``), and the time (``at``)."""

    step: int = 0
    spent: tuple[float, ...] = (0.0,) * len(PHASES)
    at: float = 0.0


def spent_over(spans: list[tuple[Mark, Mark]]) -> tuple[list[float], float]:
    """Seconds by phase of the engine steps inside any of ``spans`` (each step once, though
    spans overlap: completions of one request side by side), and the wall time they cover."""
    merged: list[list[Mark]] = []
    for a, b in sorted(spans, key=lambda span: span[0].step):
        if merged and a.step <= merged[-1][1].step:
            merged[-1][1] = max(merged[-1][1], b, key=lambda m: m.step)
        else:
            merged.append([a, b])
    phases = [sum(b.spent[i] - a.spent[i] for a, b in merged) for i in range(len(PHASES))]
    return phases, sum(b.at - a.at for a, b in merged)


@dataclass
class Metrics:
    target_forwards: int = 0  # target forwards this request took part in (prefill included)
    draft_forwards: int = 0  # draft-model forwards this request took part in
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0  # target forwards after prefill
    verify_committed: int = 0  # tokens committed by verify steps (recovered/bonus included)
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: steps accepting a draft at depth i+1
    drafted_per_position: list[int] = field(default_factory=list)  # [k]: steps drafting to depth i+1
    generated_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens whose KV came from another request (prefix reuse)
    chosen_k: list[int] = field(default_factory=list)  # [k+1]: verify steps that drafted with k = i
    drafter_steps: dict[str, int] = field(default_factory=dict)  # verify steps per drafter (hybrid)
    # wall time of the engine steps from this request's admission to its end, by phase (each
    # whole: a batch's step counts in full for each of its requests, as another's prompt chunk
    # beside them does): prefill, drafting (incl. planning), target verify forward +
    # verification, bookkeeping (commit, stop checks, drafter/planner updates); over a run or
    # a request's completions, each step once
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    bookkeeping_s: float = 0.0
    wall_s: float = 0.0

    def record_choice(self, drafter: str | None, k: int, draft_forwards: int) -> None:
        self.draft_forwards += draft_forwards
        self.chosen_k += [0] * (k + 1 - len(self.chosen_k))
        self.chosen_k[k] += 1
        if drafter is not None and k > 0:
            self.drafter_steps[drafter] = self.drafter_steps.get(drafter, 0) + 1

    def record_span(self, spans: list[tuple[Mark, Mark]]) -> None:
        """The time split and wall time of the steps inside ``spans`` (``spent_over``)."""
        (self.prefill_s, self.draft_s, self.verify_s, self.bookkeeping_s), self.wall_s = spent_over(spans)

    def record_verify(self, num_drafts: int, depth: int, num_accepted: int, committed: int) -> None:
        """One verify step: ``num_drafts`` draft tokens (tree nodes) reaching ``depth``
        (= num_drafts for a chain), ``num_accepted`` of them accepted, ``committed`` kept."""
        self.verify_steps += 1
        self.verify_committed += committed
        self.drafted_tokens += num_drafts
        self.accepted_tokens += num_accepted
        _bump(self.drafted_per_position, depth)
        _bump(self.accepted_per_position, num_accepted)
        self.accepted_per_position += [0] * (len(self.drafted_per_position) - len(self.accepted_per_position))

    def add(self, other: "Metrics") -> None:
        """Accumulate ``other``'s counters (not times: see ``record_span``) into this one."""
        for name in ("target_forwards", "draft_forwards", "drafted_tokens", "accepted_tokens",
                     "verify_steps", "verify_committed", "generated_tokens", "cached_prompt_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name, n in other.drafter_steps.items():
            self.drafter_steps[name] = self.drafter_steps.get(name, 0) + n
        for name in ("accepted_per_position", "drafted_per_position", "chosen_k"):
            add_counts(getattr(self, name), getattr(other, name))

    def to_dict(self) -> dict:
        return {
            "target_forwards": self.target_forwards,
            "draft_forwards": self.draft_forwards,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "verify_steps": self.verify_steps,
            "acceptance_rate": self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None,
            "mean_accepted_length": self.verify_committed / self.verify_steps if self.verify_steps else None,
            "nodes_per_verify_step": self.drafted_tokens / self.verify_steps if self.verify_steps else None,
            "accepted_per_position": list(self.accepted_per_position),
            "drafted_per_position": list(self.drafted_per_position),
            # P(depth i+1 accepted | the step drafted that deep)
            "acceptance_by_depth": [a / d if d else None for a, d in
                                    zip(self.accepted_per_position, self.drafted_per_position)],
            "chosen_k": list(self.chosen_k),
            "drafter_steps": dict(self.drafter_steps),
            "time_split_s": {"prefill": self.prefill_s, "draft": self.draft_s, "verify": self.verify_s,
                             "bookkeeping": self.bookkeeping_s},
            "generated_tokens": self.generated_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "tokens_per_s": self.generated_tokens / self.wall_s if self.wall_s > 0 else None,
            "wall_s": self.wall_s,
        }


def add_counts(total: list[int], counts: list[int]) -> list[int]:
    """Add ``counts`` element-wise into ``total`` (growing it as needed); return ``total``."""
    total += [0] * (len(counts) - len(total))
    for i, c in enumerate(counts):
        total[i] += c
    return total


def _bump(counts: list[int], n: int) -> None:
    """Add one to ``counts[0..n-1]``, growing the list as needed."""
    counts += [0] * (n - len(counts))
    for i in range(n):
        counts[i] += 1


def run_metrics(per_request: list[Metrics], spans: list[tuple[Mark, Mark]]) -> Metrics:
    """Totals over a run: counters summed, times those of the engine steps inside ``spans``
    (the run's, or its completions'), each step once (requests overlap in a batch)."""
    total = Metrics()
    for m in per_request:
        total.add(m)
    total.record_span(spans)
    return total
