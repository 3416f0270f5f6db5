"""The engine: batches of sequences going through draft -> verify -> commit rounds.

Cache invariant: between steps a sequence's target cache holds KV for all its committed ids
but the last one; that last token (the recovered or bonus token of the previous round, or
the first token after prefill) gets its KV as row 0 of the next verify forward, in front of
the new drafts. A draft model's cache (``self``/``draft``) may lag further: its last draft
is never fed, so after an all-accepted round it lacks that draft and the bonus, and a step
it did not draft (hybrid, the cost model) leaves it further behind; it catches up at its
next ``propose``.
"""
from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .config import SpecConfig
from .cost import Ask, Choice, Planner
from .drafters import Draft, Drafter
from .metrics import PHASES, Mark
from .sampling import sequence_logits
from .sequence import IncrementalText, Sequence, TokenLogprobs, common_prefix, cut_after_eos, settled_text
from .structured import chain_masks
from .tree import verify_tree
from .verify import Verdict, verify


def tree_inputs(seqs: list[Sequence], drafts: list[Draft]) -> dict:
    """Positions and masks for the verify forward when any draft is a tree (else none)."""
    if all(d.tree is None for d in drafts):
        return {}
    return {"positions": [d.tree.positions(len(s.ids) - 1) if d.tree else None for s, d in zip(seqs, drafts)],
            "chunk_masks": [d.tree.mask() if d.tree else None for d in drafts]}


def truncate(tokens: list[int], budget: int, eos_ids: frozenset[int]) -> tuple[list[int], bool]:
    """The part of a round's verified ``tokens`` that may be committed: at most ``budget``
    tokens, ending at the first EOS. Returns ``(kept, hit_eos)``."""
    kept = cut_after_eos(tokens[:budget], eos_ids)
    return kept, bool(kept) and kept[-1] in eos_ids


def token_logprobs(rows: torch.Tensor, tokens: list[int], num_top: int) -> list[TokenLogprobs]:
    """The log-probabilities of ``tokens`` under ``rows [n, vocab]`` (row j predicts
    ``tokens[j]``), their ranks and the ``num_top`` most likely tokens of each row."""
    if not tokens:
        return []
    lp = torch.log_softmax(rows.float(), dim=-1)  # [n, vocab]
    chosen = lp[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)]  # [n]
    ranks = (lp >= chosen[:, None]).sum(-1)  # [n] vLLM's: tokens at least as likely, itself included
    if num_top:
        top = lp.topk(min(num_top, lp.shape[-1]), dim=-1)
        alts = [list(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())]
    else:
        alts = [[] for _ in tokens]
    return list(map(TokenLogprobs, chosen.tolist(), ranks.tolist(), alts))


def draft_context(drafter: Drafter, seq: Sequence, k: int) -> tuple[bool, int | None]:
    """(whether ``drafter`` can draft ``k`` tokens for ``seq`` now, its context for the cost
    model). A drafter with a ``room(seq)`` method (a draft model) can while ``k`` fits its own
    context; one with a ``context(seq)`` method when that returns one (n-gram: its match
    length, when there is a match); a draft model's context is None."""
    room = getattr(drafter, "room", None)
    if room is not None and room(seq) < k:
        return False, None
    get = getattr(drafter, "context", None)
    if get is None:
        return True, None
    ctx = get(seq)
    return ctx is not None, ctx


class Engine:
    """``drafters``: one drafter, or several by name (tried in order: ``hybrid`` is
    ``{"ngram": ..., "draft": ...}``); ``planner``: a cost model choosing each step's
    drafter and k per sequence (default: the first ready drafter, k = ``spec.depth``);
    ``chunked_prefill_size``: prompt tokens prefilled per step (0 = each prompt whole)."""

    def __init__(self, target, drafters: Drafter | dict[str, Drafter] | None, spec: SpecConfig,
                 max_batch_size: int, planner: Planner | None = None, chunked_prefill_size: int = 0,
                 max_rows: int | None = None, prefix_caching: bool = True):
        self.target = target  # LoadedModel
        self.runtime = target.runtime
        if drafters is not None and not isinstance(drafters, dict):
            drafters = {spec.method: drafters}
        self.drafters: dict[str, Drafter] = drafters or {}
        self.planner = planner
        self.k = spec.depth if self.drafters else 0
        self.chunked_prefill_size = chunked_prefill_size  # prompt tokens per step; 0 = whole prompts
        self.cache = self.runtime.new_cache(max_batch_size, max_rows)  # max_rows: the context window
        for d in self.drafters.values():  # (a Gemma 4 assistant attends over the target's rows)
            if hasattr(d, "attach"):
                d.attach(self.cache)
        self.free_slots = list(range(max_batch_size - 1, -1, -1))
        # prefix reuse: a free slot keeps the KV of its last request's prompt, in whole prefill
        # chunks (slot -> those tokens, oldest first), for a new prompt that starts the same
        self.retained: dict[int, list[int]] = {}
        # drafters reading the target's hidden states (EAGLE): each target forward keeps them,
        # with those of every other engine's readers on the same target (LLMs sharing it)
        self.readers = [d for d in self.drafters.values() if getattr(d, "taps", None)]
        taps = {t for d in self.readers for t in d.taps}
        if not taps <= set(getattr(self.runtime, "taps", ())):
            self.runtime.capture(sorted(taps | set(self.runtime.taps)))
        self.reuses_prefixes = prefix_caching and chunked_prefill_size > 0 and (
            getattr(self.runtime, "reuses_prefixes", False) or getattr(self.runtime, "reuses_prompt_chunks", False))
        # running requests share whole chunks where the cache can copy rows between slots
        self.shares_chunks = self.reuses_prefixes and callable(getattr(self.cache, "copy", None))
        # a whole prompt chunk's end is kept where the cache must be told (recurrent states)
        self.saves_chunk_ends = self.reuses_prefixes and callable(getattr(self.cache, "save_prefix", None))
        self._masking: ThreadPoolExecutor | None = None  # grammar masks beside the verify forward
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.steps = 0  # steps begun
        self.spent = [0.0] * len(PHASES)  # seconds all steps spent per phase

    def mark(self) -> Mark:
        """The clock now (between steps): what requests' and runs' time splits start and end at."""
        return Mark(self.steps, tuple(self.spent), time.perf_counter())

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> None:
        """Finish ``seq`` with reason ``"abort"`` (call between steps). A waiting sequence
        leaves the queue now; a running one takes no further part in rounds and frees its
        KV slot and drafter state at the next ``step()``, which returns it."""
        if seq.finished:
            return
        seq.finish_reason = "abort"
        if seq.slot < 0:
            self.waiting = deque(s for s in self.waiting if s is not seq)

    def fail(self, seqs: list[Sequence]) -> None:
        """After a step raised: finish ``seqs`` with reason ``"error"`` and free their slots,
        keeping none of their KV or drafter state (a step cut short may have left it half
        written), so that the engine serves the next requests."""
        for s in seqs:
            self.abort(s)  # a waiting one leaves the queue
            s.finish_reason = "error"
        self._retire()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[Sequence]:
        """Admit waiting sequences to free slots, prefill the next prompt chunks (a sequence
        whose prompt is complete commits its first token), and run one round for the
        sequences that had their first token before this step; return the finished ones. A
        caller streaming after each step so sends a first token right after its prefill. A
        sequence whose logits processor raised (``Sequence.failure``) finishes with reason
        "error"; the others go on."""
        self.steps += 1
        self._admit()
        live = [s for s in self.running if not s.finished]
        decoding = [s for s in live if s.num_output]  # prefilled in an earlier step
        self._prefill([s for s in live if not s.num_output])
        if decoding:
            self._round(decoding)
        for s in live:
            if s.failure is not None:  # a logits processor raised on a row its tokens came from
                s.finish_reason = "error"
        return self._retire()

    def _round(self, seqs: list[Sequence]) -> None:
        t0 = time.perf_counter()
        plan = self._plan(seqs)  # per sequence: which drafter, how many drafts
        drafts = self._propose(seqs, plan)  # 1. propose
        t1 = time.perf_counter()
        chunks = [[s.ids[-1]] + d.tokens for s, d in zip(seqs, drafts)]
        masks = self._grammar_masks(seqs, drafts)  # structured outputs: computed beside the forward
        logits = self.runtime.forward(self.cache, [s.slot for s in seqs], chunks,
                                      **tree_inputs(seqs, drafts))  # 2. verify [B, 1+k, vocab]
        allowed = masks.result() if masks else {}
        verdicts = [self._verify(s, d, rows[: len(d.tokens) + 1], allowed.get(i))  # rejected drafts' KV dropped
                    for i, (s, d, rows) in enumerate(zip(seqs, drafts, logits))]
        t2 = time.perf_counter()
        batch_rows = self.planner and self.planner.batch_rows([len(c) for c in chunks])
        if batch_rows:  # what a forward of this many rows really costs here
            self.planner.observe_verify(batch_rows, t2 - t1)
        for b, (s, d, c, v, rows) in enumerate(zip(seqs, drafts, plan, verdicts, logits)):
            path = list(v.rows) if d.tree is not None else list(range(len(v.tokens)))  # row j predicts token j
            if s.logprobs is not None:
                s.token_logprobs += token_logprobs(rows[path], v.tokens, s.logprobs)
            start = len(s.ids) - 1  # row 0's position
            committed = self._commit(s, v.tokens)  # 3. commit, stop checks
            self._hand_features(s, start, b, path[:committed])
            depth = max(d.tree.depths) if d.tree else len(d.tokens)  # drafts on the longest path
            s.metrics.record_verify(len(d.tokens), depth, v.num_accepted, committed)
            s.metrics.target_forwards += 1
            s.metrics.record_choice(c.drafter if d.tokens else None, c.k if d.tokens else 0, d.forwards)
            for drafter in self.drafters.values():
                drafter.observe(s, v.num_accepted)  # 4. observe
            if self.planner:
                self.planner.record(s.request_id, c, depth, v.num_accepted)
        t3 = time.perf_counter()
        for i, t in enumerate((t1 - t0, t2 - t1, t3 - t2)):  # draft, verify, bookkeeping
            self.spent[1 + i] += t

    def _plan(self, seqs: list[Sequence]) -> list[Choice]:
        limits = [min(self.k, s.remaining - 1, self.k if s.num_draft_tokens is None else s.num_draft_tokens,
                      self._before_switch(s)) for s in seqs]
        if self.planner:
            return self.planner.choose_batch([self._ask(s, n) for s, n in zip(seqs, limits)])
        return [self._first_ready(s, n) for s, n in zip(seqs, limits)]

    def _before_switch(self, s: Sequence) -> int:
        """The drafts that keep ``s``'s verify rows on one side of the target's longrope switch
        (``runtime.switch``: each row's factors follow the sequence's length there, as in plain
        decoding, and a forward takes one set): up to it, then none past it."""
        switch = getattr(self.runtime, "switch", None)
        return self.k if switch is None or len(s.ids) > switch else switch - len(s.ids)

    def _ready(self, s: Sequence, limit: int) -> dict[str, int | None]:
        """The drafters that can draft ``limit`` tokens for ``s`` now, with their contexts."""
        ready = {}
        for name, drafter in self.drafters.items():
            ok, ctx = draft_context(drafter, s, limit)
            if ok:
                ready[name] = ctx
        return ready

    def _ask(self, s: Sequence, limit: int) -> Ask:
        if limit <= 0:
            return Ask(s.request_id, 0)
        behind = {n: d.behind(s) for n, d in self.drafters.items() if hasattr(d, "behind")}
        return Ask(s.request_id, limit, self._ready(s, limit), behind, s.remaining)

    def _first_ready(self, s: Sequence, limit: int) -> Choice:
        """Without a planner: the first drafter that can draft, k = ``limit`` (a lone n-gram
        drafter is not asked for a match first: its ``propose`` looks anyway)."""
        if limit > 0:
            for name, drafter in self.drafters.items():
                if len(self.drafters) == 1 and not hasattr(drafter, "room") or draft_context(drafter, s, limit)[0]:
                    return Choice(name, limit, 0.0)
        return Choice(None, 0, 0.0)

    def _propose(self, seqs: list[Sequence], plan: list[Choice]) -> list[Draft]:
        drafts = [Draft([]) for _ in seqs]
        for name, drafter in self.drafters.items():
            idx = [i for i, c in enumerate(plan) if c.drafter == name and c.k > 0]
            if idx:
                timed = self.planner and hasattr(drafter, "behind")  # a model's drafting, against its costs
                items = [(plan[i].k, drafter.behind(seqs[i])) for i in idx] if timed else None
                t0 = time.perf_counter()
                for i, d in zip(idx, drafter.propose([seqs[i] for i in idx], [plan[i].k for i in idx])):
                    drafts[i] = d
                if timed:
                    self.planner.observe_draft(name, items, time.perf_counter() - t0)
        for s, d in zip(seqs, drafts):  # a chain stops before its first draft the grammar forbids
            if s.grammar is not None and d.tree is None and d.tokens:
                n = s.grammar.valid_prefix(d.tokens)
                d.tokens, d.q = d.tokens[:n], d.q[:n] if d.q is not None else None
        return drafts

    def _grammar_masks(self, seqs: list[Sequence], drafts: list[Draft]) -> Future | None:
        """A future of the grammar masks of the chains' verify rows, ``{batch index: [k+1,
        vocab]}``, computed on another thread (llguidance's, without the GIL) while the
        target verifies; None when no chain has a grammar (trees mask path by path)."""
        idx = [i for i, (s, d) in enumerate(zip(seqs, drafts)) if s.grammar is not None and d.tree is None]
        if not idx:
            return None
        if self._masking is None:
            self._masking = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdec-masks")
        chains = [(seqs[i].grammar, drafts[i].tokens) for i in idx]
        return self._masking.submit(lambda: dict(zip(idx, chain_masks(chains))))

    def _verify(self, s: Sequence, d: Draft, rows, allowed: torch.Tensor | None = None) -> Verdict:
        """Verify one sequence's draft (chain or tree) and keep only the accepted path's KV.
        Penalties and the grammar see, on each row, the drafts before it as output
        (``allowed``: the grammar's masks of the rows, when already computed)."""
        failures: dict[int, Exception] = {}  # rows whose logits processor raised
        if s.sampling.processes_logits or s.grammar is not None:
            prefixes = d.tree.prefixes() if d.tree else [d.tokens[:j] for j in range(len(d.tokens) + 1)]
            rows = sequence_logits(rows, s, prefixes, allowed, failures)
        if d.tree is None:
            v = verify(d.tokens, d.q, rows, s.sampling, s.generator)
            self.cache.rewind(s.slot, len(s.ids) + v.num_accepted)
            reached = range(v.num_accepted + 1)  # the rows the committed tokens came from
        else:
            v = verify_tree(d.tree, rows, s.sampling, s.generator)
            self.cache.keep(s.slot, len(s.ids) - 1, v.rows)  # path rows -> consecutive slots
            reached = v.rows
        s.failure = next((failures[r] for r in reached if r in failures), None)  # as plain decoding meets it
        return v

    def _admit(self) -> None:
        """Give waiting sequences free slots, oldest first. One whose LoRA adapter cannot be
        held on the device now (``max_loras`` held by running requests) waits, and so do the
        adapted ones after it (so that the adapters held drain for it); those without an
        adapter go past it."""
        if not self.free_slots:
            return
        blocked = False
        for s in list(self.waiting):
            if not self.free_slots:
                break
            if s.lora is not None and (blocked or not self.runtime.lora.acquire(s.lora)):
                blocked = True
                continue
            self.waiting.remove(s)
            s.slot, reused = self._pick_slot(s)
            if hasattr(self.cache, "adapters"):  # the torch runtime's: its forwards' rows, its prompt's KV
                self.cache.adapters[s.slot] = s.lora.id if s.lora else 0
            self.free_slots.remove(s.slot)
            self.retained.pop(s.slot, None)
            self.cache.rewind(s.slot, reused)  # the prefill goes on from there
            if hasattr(self.cache, "expect"):  # (longrope's factors follow the prompt's length)
                self.cache.expect(s.slot, s.prompt_len)
            s.metrics.cached_prompt_tokens = reused
            s.admitted = self.mark()
            self.running.append(s)

    def _pick_slot(self, s: Sequence) -> tuple[int, int]:
        """A free slot for ``s`` and how many of its prompt tokens' KV the slot holds: the
        longest prefix it shares with the slot's retained prompt, in whole chunks (so the
        prefill cuts the prompt where it would have from scratch) and short of the last
        prompt token (whose logits the first output token needs). No match: a slot that
        retains nothing, else the one retaining the oldest prompt."""
        best, reused = None, 0
        if self.reuses_prefixes and s.sampling.prompt_logprobs is None:
            best, reused = self._longest_shared(s, self.retained.items(), 0)
        if best is None:
            bare = [slot for slot in self.free_slots if slot not in self.retained]
            best = bare[-1] if bare else next(iter(self.retained))
        return best, reused

    def _prefill(self, seqs: list[Sequence]) -> None:
        """Feed prompt chunks, oldest sequence first, up to ``chunked_prefill_size`` tokens in
        all (0: every prompt whole). A prompt is cut at multiples of that size, whatever runs
        beside it, so a request's prefill forwards never depend on the batch."""
        size, budget = self.chunked_prefill_size, self.chunked_prefill_size
        batch, chunks = [], []
        for s in seqs:
            if self.shares_chunks and s.sampling.prompt_logprobs is None:
                self._copy_shared(s)
                if self._computed_beside(s, batch):  # copy it next step instead
                    continue
            done = self.cache.lengths[s.slot]  # prompt tokens with KV
            chunk = s.ids[done: s.prompt_len if not size else min(s.prompt_len, done + size)]
            if size and batch and len(chunk) > budget:
                break
            batch.append(s)
            chunks.append(chunk)
            budget -= len(chunk)
        if not batch:
            return
        t0 = time.perf_counter()
        every_row = any(s.sampling.prompt_logprobs is not None for s in batch)
        logits = self.runtime.forward(self.cache, [s.slot for s in batch], chunks, last_only=not every_row,
                                      prefill=True)  # [B, vocab], or [B, longest chunk, vocab]
        if logits.device.type == "cuda":  # the prefill's time, not its launch's
            torch.cuda.synchronize(logits.device)
        for b, (s, out, chunk) in enumerate(zip(batch, logits, chunks)):
            if self.saves_chunk_ends and self.cache.lengths[s.slot] % size == 0:
                self.cache.save_prefix(s.slot)  # a whole chunk's end, where prefix reuse may come back
            self._hand_features(s, self.cache.lengths[s.slot] - len(chunk), b, range(len(chunk)))
            s.metrics.target_forwards += 1
            row = out  # [vocab]: the logits after the chunk's last token
            if every_row:
                rows = out[:len(chunk)]  # [chunk, vocab]: row j predicts the token after chunk[j]
                if s.sampling.prompt_logprobs is not None:
                    end = self.cache.lengths[s.slot]  # the chunk is s.ids[end - len(chunk):end]
                    predicted = s.ids[end - len(chunk) + 1: min(end + 1, s.prompt_len)]  # prompt tokens the rows predict
                    s.prompt_token_logprobs += token_logprobs(rows[:len(predicted)], predicted,
                                                              s.sampling.prompt_logprobs)
                row = rows[-1]
            if self.cache.lengths[s.slot] < s.prompt_len:
                continue
            failures: dict[int, Exception] = {}
            scored = sequence_logits(row[None], s, [[]], failures=failures)  # [1, vocab]
            s.failure = failures.get(0)
            token = verify([], None, scored, s.sampling, s.generator).tokens[0]  # no drafts: the first token, from p
            if s.logprobs is not None:
                s.token_logprobs += token_logprobs(row[None], [token], s.logprobs)
            self._commit(s, [token])
        self.spent[0] += time.perf_counter() - t0  # the prefill phase (PHASES[0])

    def _hand_features(self, s: Sequence, start: int, b: int, rows) -> None:
        """Give the drafters that read hidden states (EAGLE) the last target forward's
        ``rows`` of batch row ``b``: ``s``'s committed tokens at positions ``start`` on."""
        if self.readers and len(rows):
            features = self.runtime.features[b, list(rows)]  # [n, len(runtime taps) * hidden]
            have = self.runtime.taps
            width = features.shape[-1] // len(have)
            for d in self.readers:  # each its own taps' columns, in the layers' order
                d.features(s, start, features if d.taps == have else torch.cat(
                    [features[:, i * width:(i + 1) * width] for i, t in enumerate(have) if t in d.taps], dim=-1))

    def _copy_shared(self, s: Sequence) -> None:
        """Give ``s`` the KV of the whole prompt chunks it shares with another request's
        prompt (running, or kept by a free slot) beyond what it has: ``n`` completions of a
        prompt, or prompts that start the same, prefill the shared chunks once."""
        done = self.cache.lengths[s.slot]
        sources = [(t.slot, t.ids[:min(self.cache.lengths[t.slot], t.prompt_len)])
                   for t in self.running if t is not s and not t.finished] + list(self.retained.items())
        best, n = self._longest_shared(s, sources, done)
        if best is not None:
            self.cache.copy(best, s.slot, n)
            for d in self.readers:  # the copied rows' hidden states, which no forward computes for s
                d.share(best, s.slot, done, n)
            s.metrics.cached_prompt_tokens += n - done

    def _longest_shared(self, s: Sequence, sources, floor: int) -> tuple[int | None, int]:
        """Among ``(slot, ids with KV)`` ``sources``, the one sharing the most of ``s``'s prompt
        in whole chunks, and how much, if more than ``floor`` (else ``(None, floor)``). The
        last prompt token is never shared: its logits give the first output token."""
        size, prompt = self.chunked_prefill_size, s.ids[:s.prompt_len - 1]
        best, n = None, floor
        adapters, own = getattr(self.cache, "adapters", None), s.lora.id if s.lora else 0
        for slot, kept in sources:
            if adapters is not None and adapters[slot] != own:  # KV computed through another LoRA adapter
                continue
            m = self._restorable(slot, common_prefix(kept, prompt) // size * size, n)
            if m > n:
                best, n = slot, m
        return best, n

    def _restorable(self, slot: int, m: int, floor: int = 0) -> int:
        """The most of ``slot``'s first ``m`` tokens, in whole chunks, that its cache can go back
        to (and copy), down to ``floor``: all, but for recurrent states (``holds``)."""
        holds = getattr(self.cache, "holds", None)
        while holds is not None and m > floor and not holds(slot, m):
            m -= self.chunked_prefill_size
        return m

    def _computed_beside(self, s: Sequence, batch: list[Sequence]) -> bool:
        """Whether a request already in this prefill ``batch`` computes the whole chunk ``s``
        would prefill next, after the same tokens (``s`` then copies it next step)."""
        size, done = self.chunked_prefill_size, self.cache.lengths[s.slot]
        if done + size > s.prompt_len - 1:  # the last chunk: s prefills it itself
            return False
        return any(self.cache.lengths[t.slot] == done and t.ids[:done + size] == s.ids[:done + size]
                   for t in batch)

    def _commit(self, s: Sequence, tokens: list[int]) -> int:
        """Commit a round's verified ``tokens`` as plain decoding would, one at a time: a
        token ends the output if it is an EOS or stop token, else if the output's text then
        holds a stop string; the budget cuts the rest."""
        before = s.num_output
        kept, hit_eos = truncate(tokens, s.remaining, s.eos_ids)
        s.ids.extend(kept)
        stop = self._stop_string(s, before + len(kept) - hit_eos)  # an EOS ends its step first
        if stop is not None:
            end, s.text, s.stop_reason = stop
            s.cut(s.prompt_len + end)
            kept, hit_eos = kept[: end - before], False
            s.finish_reason = "stop"
        elif hit_eos:
            s.finish_reason = "stop"
            last, sp = kept[-1], s.sampling
            if last in sp.stop_token_ids and (sp.ignore_eos or last not in self.target.eos_ids):
                s.stop_reason = last  # vLLM's: a stop token, not the model's EOS
            if not sp.include_stop_str_in_output and sp.detokenize:  # the token is not in the text (vLLM's rule)
                s.text = settled_text(self.target.tokenizer, s.output_ids[:-1], sp, s.text_context)
        elif s.remaining == 0:
            s.finish_reason = "length"
        if s.grammar is not None:
            s.grammar.advance(kept)
        del s.token_logprobs[s.num_output:]  # captured for tokens cut at EOS / budget / stop
        return len(kept)

    def _stop_string(self, s: Sequence, after: int) -> tuple[int, str, str] | None:
        """The stop string plain decoding would meet in the tokens committed since the last
        call (the output up to length ``after``), sought as vLLM seeks it: after each token
        past the first ``min_tokens``, the first of ``stop`` whose occurrence ends in the text
        that token added, the text grown as vLLM's incremental detokenizer grows it
        (``s.stop_text``: a character still incomplete waits; the cost per token does not
        grow with the output). As ``(output tokens kept, text, stop string)``; the text ends
        before the stop string (after it with ``include_stop_str_in_output``)."""
        sp = s.sampling
        if not sp.stop:
            return None
        if s.stop_text is None:
            s.stop_text = IncrementalText(self.target.tokenizer, sp, s.text_context)
        text, out = s.stop_text, s.output_ids
        for m in range(len(text.ids) + 1, after + 1):  # it holds the output before this round's
            seen = len(text.text)
            text.add([out[m - 1]])
            if m <= sp.min_tokens:
                continue
            for stop in sp.stop:
                at = text.text.find(stop, max(0, seen - len(stop) + 1))
                if at >= 0:
                    return m, text.text[:at + len(stop) if sp.include_stop_str_in_output else at], stop
        return None

    def _retire(self) -> list[Sequence]:
        done = [s for s in self.running if s.finished]
        if not done:
            return []
        now = self.mark()
        for s in done:
            kept = 0
            if self.reuses_prefixes and s.finish_reason != "error":  # the prompt's KV in whole chunks stays
                size = self.chunked_prefill_size
                kept = self._restorable(s.slot, min(self.cache.lengths[s.slot], s.prompt_len) // size * size)
                if kept:
                    self.retained[s.slot] = s.ids[:kept]
            self.cache.rewind(s.slot, kept, idle=True)
            if s.lora is not None:
                self.runtime.lora.release(s.lora.id)
            for drafter in self.drafters.values():
                drafter.release(s)
            if self.planner:
                self.planner.release(s.request_id)
            self.free_slots.append(s.slot)
            s.retired = now
            s.metrics.record_span([(s.admitted, now)])
            s.metrics.generated_tokens = s.num_output
        self.running = [s for s in self.running if not s.finished]
        return done
