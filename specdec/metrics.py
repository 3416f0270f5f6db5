"""Counters per request and per run. Names are part of the API (``--json`` output)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Metrics:
    target_forwards: int = 0  # target forwards this request took part in (prefill included)
    draft_forwards: int = 0  # draft-model forwards this request took part in
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0  # target forwards after prefill
    verify_committed: int = 0  # tokens committed by verify steps (recovered/bonus included)
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: accepted at draft position i
    generated_tokens: int = 0
    wall_s: float = 0.0

    def record_verify(self, num_drafts: int, num_accepted: int, committed: int) -> None:
        self.verify_steps += 1
        self.verify_committed += committed
        self.drafted_tokens += num_drafts
        self.accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position += [0] * (num_drafts - len(self.accepted_per_position))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def add(self, other: "Metrics") -> None:
        """Accumulate ``other``'s counters (not wall time) into this one."""
        for name in ("target_forwards", "draft_forwards", "drafted_tokens", "accepted_tokens",
                     "verify_steps", "verify_committed", "generated_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        n = max(len(self.accepted_per_position), len(other.accepted_per_position))
        self.accepted_per_position = [
            (self.accepted_per_position[i] if i < len(self.accepted_per_position) else 0)
            + (other.accepted_per_position[i] if i < len(other.accepted_per_position) else 0)
            for i in range(n)]

    def to_dict(self) -> dict:
        return {
            "target_forwards": self.target_forwards,
            "draft_forwards": self.draft_forwards,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None,
            "mean_accepted_length": self.verify_committed / self.verify_steps if self.verify_steps else None,
            "accepted_per_position": list(self.accepted_per_position),
            "generated_tokens": self.generated_tokens,
            "tokens_per_s": self.generated_tokens / self.wall_s if self.wall_s > 0 else None,
            "wall_s": self.wall_s,
        }


def run_metrics(per_request: list[Metrics], wall_s: float) -> Metrics:
    """Totals over a run; ``wall_s`` is the run's own wall time (requests overlap in a batch)."""
    total = Metrics()
    for m in per_request:
        total.add(m)
    total.wall_s = wall_s
    return total
