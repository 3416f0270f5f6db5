"""The llama.cpp runtime: a GGUF file run by llama.cpp through llama-cpp-python's low-level
API (``pip install 'specdec[llamacpp]'``), on the CPU, with the GGUF's own quantization.

A cache is one llama.cpp context with one *unified* KV buffer shared by all its slots. Slot
``s`` is llama.cpp sequence ``s``: its committed rows are the cells of sequence ``s`` at
positions ``0..C-1`` (row index = position), so a rewind is ``llama_memory_seq_rm``.

Trees (chunks with a mask) go through sequence ids. llama.cpp stores a token's KV in one
cell that carries every sequence id the token lists, and the token's query sees exactly the
cells carrying its *first* id at positions up to its own. So each row of a masked chunk gets
a temporary *own* sequence, listed first; the later rows of the chunk that see it list
their own sequences after it. Before the decode, each own sequence is added
(``llama_memory_seq_cp``: metadata only, no copy) to the slot's committed cells and to the
cached tree rows the row sees: the cell of cached row j is the only one carrying j's own
sequence at j's position. ``keep`` adds the slot's sequence to the accepted path's cells
(a tree path sits at positions ``start + i`` already), parks the other rows' cells (see
``LlamaCppCache``) and releases every temporary sequence. Masks must be tree-shaped: a row
sees itself and only earlier rows at lower positions (llama.cpp masks keys at higher
positions anyway).

Exactness: on the CPU, llama.cpp computes one row and several rows with different kernels
that round differently (up to 0.4 logits on Qwen2.5-Coder Q4_K_M), so a verify step could
resolve a near-tie unlike plain decoding. Two such switches matter here: K-quant matrix
products take a tiled kernel from 8 rows on (from 4 rows on with repacked weights), and with
an F16 KV cache the attention of a single row is split over the threads once 512 or more
cells are cached (so even 2-row chunks part from one-row decoding past ~260 tokens of
context). ggml takes that split path only where K and V have one type, F16 or F32, so an exact
runtime keeps its K cache in Q8_0 and its V cache in F16: its attention takes one kernel for
any row count (a Q8_0 V cache, as before, did too, but it is dequantized row by row for every
query: prefilling 2048 tokens of Qwen2.5-Coder-1.5B took 23-31 s against 16 s, and a token
at that context 35 against 31 ms). At load it finds ``max_rows``, the largest forward whose logits
equal feeding its tokens one at a time after a short and after a long context
(``ROW_CONTEXTS``: the long one is past 512 cells, so the check itself catches the attention
switch above; checked once per model file, thread count and machine, then read from
``llamacpp_rows.json`` in specdec's cache directory), and feeds every continuation (a
forward whose slots all hold rows already: verification, decoding, a draft's catch-up) in
balanced pieces of at most that many rows, one ``llama_decode`` each. Prompts, and the
chunks of a chunked prefill (any ``prefill`` or ``last_only`` forward), go whole, each slot in its own
decode: plain and speculative decoding prefill alike. A draft model runs exact too: then its
proposals, and the draws of a sampled request that draft from them (q), do not depend on
what the request is batched with or on what the cache held before (with llama.cpp's F16
cache and whole products they did, and a seeded request could repeat differently; on
Qwen2.5-Coder 0.5B drafting for 1.5B the exact draft was as fast). ``exact=False`` keeps
llama.cpp's F16 KV cache and skips the check and the pieces.
"""
from __future__ import annotations

import bisect
import ctypes
import functools
import itertools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from .. import disk_cache

DEFAULT_CONTEXT = 4096  # tokens per slot; a cache's KV buffer holds num_slots of them
TREE_SEQS_PER_SLOT = 32  # temporary sequence ids (one per tree row), pooled over a cache's slots
TREE_HEADROOM = 256  # extra KV cells for tree rows beyond a full slot
PARK_ROOM = 512  # KV cells per slot beyond its context, for parked rows (see LlamaCppCache.fit)
MAX_SEQ = 256  # llama.cpp's LLAMA_MAX_SEQ
UBATCH = 512  # tokens per llama.cpp compute step (its default)
ROW_CHECKS = (2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24, 32)  # forward sizes compared with one-row decoding
ROW_CONTEXTS = (32, 300)  # ... after these many cached tokens (300: over 512 cells once padded to 256)

GGML_LOG_ERROR, GGML_LOG_CONT = 4, 5  # ggml_log_level


def seq_ids(num_slots: int) -> int:
    """llama.cpp sequence ids of a cache of ``num_slots``: a committed and a parking one per
    slot, the rest for tree rows."""
    return min(MAX_SEQ, num_slots * (2 + TREE_SEQS_PER_SLOT))


def tree_rows(num_slots: int) -> int:
    """The tree rows (a verify forward's root and nodes, a draft tree's fed nodes) each slot
    can hold at once when every slot holds a tree."""
    return (seq_ids(num_slots) - 2 * num_slots) // num_slots


_log_callback = None  # the ctypes callback must stay alive


def llama_lib():
    """llama-cpp-python's ctypes bindings (``llama_cpp.llama_cpp``); the first call initialises
    the backend and routes llama.cpp's log (process-wide) to stderr for errors only."""
    global _log_callback
    try:
        from llama_cpp import llama_cpp as lib
    except ImportError:
        raise ValueError("the llama.cpp backend needs llama-cpp-python: "
                         "pip install 'specdec[llamacpp]'") from None
    if _log_callback is None:
        last = [0]

        def log(level: int, text: bytes, _user_data) -> None:
            last[0] = last[0] if level == GGML_LOG_CONT else level
            if last[0] == GGML_LOG_ERROR:
                sys.stderr.write(text.decode("utf-8", "replace"))

        _log_callback = lib.llama_log_callback(log)
        lib.llama_log_set(_log_callback, ctypes.c_void_p(0))
        lib.llama_backend_init()
    return lib


@dataclass
class TreeRow:
    """A cached row of a masked chunk: its position, token and own temporary sequence id."""

    pos: int
    token: int
    seq: int


def piece_bounds(n: int, limit: int | None) -> list[int]:
    """Bounds of ``n`` rows cut into the fewest pieces of at most ``limit`` rows (None: one),
    balanced: their sizes differ by at most one."""
    pieces = -(-n // limit) if limit and n else 1
    return [n * i // pieces for i in range(pieces + 1)]


class LlamaCppCache:
    """One llama.cpp context: ``lengths[s]`` rows per slot, the first ``committed(s)`` (one per
    token of ``tokens[s]``) in sequence ``s``, the rest tree rows (``tail[s]``) in temporary
    sequences.

    Dropped rows are *parked* (sequence ``num_slots + s``) rather than freed, until a new
    prompt refills their cells (``make_room``) or the buffer is full (``fit``). llama.cpp
    attends over cells in cell order and quantizes activations, so a token placed in a freed
    cell below its sequence's newer cells gets visibly different logits (up to ~0.9 on
    SmolLM2-135M Q4_1); with parking, a slot's cells stay in position order, as in plain
    decoding, and a chunk of fewer than 64 tokens (and at most the runtime's ``max_rows``,
    where products switch kernels) then gives exactly its one-by-one logits.
    The cache keeps each slot's committed tokens (``tokens``) and where its prefill decodes
    ended (``prefill_ends``), to recompute its KV when it must free parked cells mid-request
    (``fit``)."""

    def __init__(self, runtime: "LlamaCppRuntime", num_slots: int):
        lib = self.lib = runtime.lib
        self.runtime = runtime  # the model must outlive the context
        n_seq = seq_ids(num_slots)
        if 2 * num_slots >= n_seq:
            raise ValueError(f"the llama.cpp backend supports at most {MAX_SEQ // 2 - 1} slots, not {num_slots}")
        p = lib.llama_context_default_params()
        p.n_ctx = num_slots * (runtime.max_context + PARK_ROOM) + TREE_HEADROOM
        p.n_batch = p.n_ctx  # any forward fits one llama_decode
        p.n_ubatch = UBATCH
        p.n_seq_max = n_seq
        p.n_threads = p.n_threads_batch = runtime.threads
        p.kv_unified = True  # one buffer: sequences share cells, seq_cp is metadata only
        # flash attention: a chunk of fewer than 64 tokens per ubatch then attends as feeding
        # its tokens one by one (without it, llama.cpp's CPU kernels differ; the products'
        # own switch is ``max_rows``)
        p.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
        p.no_perf = True
        p.type_k, p.type_v = runtime.kv_types
        self.ctx = lib.llama_init_from_model(runtime.model, p)
        if not self.ctx:
            raise ValueError(f"llama.cpp could not create a context of {p.n_ctx} tokens")
        self.mem = lib.llama_get_memory(self.ctx)
        self.size = lib.llama_n_ctx(self.ctx)  # KV cells
        self.lengths = [0] * num_slots
        self.tokens: list[list[int]] = [[] for _ in range(num_slots)]  # the committed rows' tokens
        # per slot, the forward (``clock``) that wrote each committed row: rows written later
        # took cells above those written before (llama.cpp fills the lowest free cells, and
        # freed cells are refilled in order, see ``make_room``)
        self.written: list[list[int]] = [[] for _ in range(num_slots)]
        self.clock = 0  # forwards into this cache
        # per slot, the ends of the whole decodes (a prompt, or its chunks) its rows begin with
        self.prefill_ends: list[list[int]] = [[] for _ in range(num_slots)]
        self.recomputes = 0  # times ``fit`` recomputed the running sequences
        self.tail: list[list[TreeRow]] = [[] for _ in range(num_slots)]
        self.parked: list[list[int]] = [[] for _ in range(num_slots)]  # positions of parked cells, sorted
        self.idle: set[int] = set()  # slots whose rows wait for a prompt that starts the same (rewind idle=True)
        self.free_seqs = list(range(n_seq - 1, 2 * num_slots - 1, -1))

    def __del__(self):
        ctx, self.ctx = getattr(self, "ctx", None), None
        if ctx:
            self.lib.llama_free(ctx)

    def rewind(self, slot: int, length: int, idle: bool = False) -> None:
        """Drop the slot's rows from ``length`` on. A chain's rows dropped mid-request while no
        other slot runs (rejected drafts) are its newest cells, above every used one: they
        are freed, and the next forward refills them in order. Any other dropped rows are
        parked: freed, they would leave free cells below newer ones. ``idle``: the slot's
        request finished and its first ``length`` rows wait for a prompt that starts the same
        (prefix reuse): it adds no rows until then, so it does not keep another slot's
        dropped rows from being freed."""
        assert 0 <= length <= self.lengths[slot], (length, self.lengths[slot])
        tail, cut = self.tail[slot], max(length - self.committed(slot), 0)
        newest = length and not tail and slot not in self.idle and self.newest(slot, length)
        self._park_rows(slot, tail[cut:])
        del tail[cut:]
        if length < self.committed(slot):
            if newest:
                self.lib.llama_memory_seq_rm(self.mem, slot, length, -1)
                self._cut(slot, length)
            else:
                self._park_committed(slot, length)
        self.lengths[slot] = length
        if idle and length:
            self.idle.add(slot)

    def unpark(self, slot: int) -> None:
        """Free the slot's parked rows (their cells go back to llama.cpp)."""
        if self.parked[slot]:
            self.lib.llama_memory_seq_rm(self.mem, self.park_seq(slot), -1, -1)
            self.parked[slot].clear()

    @property
    def used(self) -> int:
        """KV cells in use: committed, tree and parked rows."""
        return sum(map(len, self.tokens)) + sum(map(len, self.tail)) + sum(map(len, self.parked))

    def committed(self, slot: int) -> int:
        """The slot's committed rows (in its sequence, at positions 0..committed-1)."""
        return len(self.tokens[slot])

    def alone(self, slot: int) -> bool:
        """No other slot holds rows."""
        return not any(n for x, n in enumerate(self.lengths) if x != slot)

    def newest(self, slot: int, length: int) -> bool:
        """Whether the slot's committed rows from ``length`` on lie above every other slot's
        cells: no other slot runs, and an idle one (a kept prompt, adding no rows until a
        prompt that starts the same comes) wrote all its rows before them. (Its prompt
        chunks may have been written between this slot's rows, while it prefilled beside it.)"""
        first = self.written[slot][length] if length < len(self.written[slot]) else self.clock + 1
        return all(not n or (x in self.idle and (not self.written[x] or self.written[x][-1] < first))
                   for x, n in enumerate(self.lengths) if x != slot)

    def make_room(self, slot: int, n: int) -> None:
        """Before a prompt of ``n`` tokens in ``slot``: free at most ``n`` parked cells (the
        slot's own first, then other slots'), so that the prompt refills every cell freed.
        llama.cpp searches for free cells from the lowest one freed, so the prompt's tokens
        take exactly those, in order, and then the free cells past every used one; had more
        been freed, the rest would lie below running sequences' newest cells, and their next
        tokens, put there, would be attended out of order (rounding unlike plain decoding).
        With no other slot running, every parked cell is freed (no order to keep)."""
        others = [x for x in range(len(self.lengths)) if x != slot]
        if self.alone(slot):
            for x in [slot] + others:
                self.unpark(x)
            return
        for s in [slot] + others:
            pos = self.parked[s]  # sorted
            if len(pos) <= n:  # all of them (positions -1..-1: any)
                freed, first, end = len(pos), -1, -1
            else:  # those below position pos[n]: at most n
                freed, first, end = bisect.bisect_left(pos, pos[n]), 0, pos[n]
            if freed:
                self.lib.llama_memory_seq_rm(self.mem, self.park_seq(s), first, end)
                del pos[:freed]
                n -= freed

    def fit(self, n: int) -> None:
        """Before a forward of ``n`` rows: when the buffer lacks room for them, drop every
        parked cell. Freed mid-request, parked cells would leave holes below running
        sequences' newest cells (see ``make_room``), so an exact runtime instead clears the
        buffer and recomputes each running sequence's KV from its tokens, with forwards like
        those that made it (vLLM's preemption by recompute): the prompt's decodes, the rest
        in pieces of at most ``max_rows`` rows, so that every sequence's cells are in
        position order again. Any other runtime, or one with tree rows pending, frees them;
        so a forward with no tree open makes room for the tree rows every slot may then hold
        (a draft model grows its trees a depth a forward: a buffer filling mid-tree unparked
        cells under running sequences, and a seeded request's draws came to depend on its
        batch)."""
        num_slots = len(self.lengths)
        reserve = 0 if any(self.tail) else tree_rows(num_slots) * num_slots  # <= TREE_HEADROOM
        if self.used + n + reserve <= self.size or not any(self.parked):
            return
        if not self.runtime.exact or any(self.tail):
            for s in range(len(self.lengths)):
                self.unpark(s)
            return
        self.lib.llama_memory_clear(self.mem, False)
        for pos in self.parked:
            pos.clear()
        self.recomputes += 1
        for slot in range(len(self.lengths)):
            self.runtime.recompute(self, slot)

    def keep(self, slot: int, start: int, rows: Sequence[int]) -> None:
        """Keep only rows ``start + rows[i]`` (increasing), moved to ``start + i``: the
        accepted path of a token tree joins the slot's sequence, every tree row is dropped.
        Rows that move must be tree rows already at position ``start + i`` (a tree path)."""
        rows = list(rows)
        assert rows == sorted(rows) and start + rows[-1] < self.lengths[slot], (rows, self.lengths[slot])
        c, tail = self.committed(slot), self.tail[slot]
        if start > c:
            raise ValueError(f"keep from row {start}: the slot has only {c} committed rows before it")
        same = 0  # committed rows that stay where they are
        while same < len(rows) and start + same < c and rows[same] == same:
            same += 1
        moved = [tail[start + r - c] if start + r >= c else None for r in rows[same:]]
        for i, row in enumerate(moved, start + same):
            if row is None or row.pos != i:
                raise ValueError(f"the llama.cpp runtime keeps tree paths only: row {i} would move "
                                 "a committed row or change a position")
        if start + same < c:
            self._park_committed(slot, start + same)
        for row in moved:  # the only cell with the row's own sequence at its position
            self.lib.llama_memory_seq_cp(self.mem, row.seq, slot, row.pos, row.pos + 1)
        self._park_rows(slot, [row for row in tail if all(row is not m for m in moved)])
        self._release(moved)
        tail.clear()
        self.tokens[slot] += [row.token for row in moved]
        self.written[slot] += [self.clock] * len(moved)  # the verify forward just before
        self.lengths[slot] = start + len(rows)

    def open_tree(self, slot: int, tokens: list[int], pos: list[int],
                  mask: torch.Tensor) -> tuple[list[TreeRow], list[list[int]]]:
        """Own sequences for the rows of a masked chunk, already given the keys each row sees
        before the chunk; returns them and each token's sequence list for the batch."""
        n, m = mask.shape
        t, c, tail = m - n, self.committed(slot), self.tail[slot]
        if m < n or len(pos) != n:
            raise ValueError(f"chunk mask {tuple(mask.shape)} for {len(pos)} tokens: need [n, m >= n]")
        sees = mask.tolist()
        start = len(tail) - t  # tail index of the mask's first column (negative: committed rows)
        if start < 0 and not all(all(r[:-start]) for r in sees):
            raise ValueError("the llama.cpp runtime cannot hide committed rows from a chunk")
        for i in range(n):
            if not sees[i][t + i] or pos[i] < c or any(
                    sees[i][t + r] and (r > i or pos[r] >= pos[i]) for r in range(n) if r != i):
                raise ValueError("the llama.cpp runtime needs tree-shaped chunk masks: each row sees "
                                 "itself and earlier rows at lower positions, after the committed ones")
        rows = []
        try:
            for i in range(n):
                seen = tail[: max(start, 0)] + [tail[start + j] for j in range(max(-start, 0), t) if sees[i][j]]
                if any(row.pos >= pos[i] for row in seen):
                    raise ValueError("a tree row must sit at a higher position than the cached rows it sees")
                rows.append(TreeRow(pos[i], tokens[i], self._new_seq()))
                own = rows[-1].seq
                self.lib.llama_memory_seq_cp(self.mem, slot, own, -1, -1)
                for row in seen:
                    self.lib.llama_memory_seq_cp(self.mem, row.seq, own, row.pos, row.pos + 1)
        except ValueError:
            self._release(rows)
            raise
        seqs = [[rows[i].seq] + [rows[r].seq for r in range(i + 1, n) if sees[r][t + i]] for i in range(n)]
        return rows, seqs

    def park_seq(self, slot: int) -> int:
        return len(self.lengths) + slot

    def _park_committed(self, slot: int, length: int) -> None:
        """Move the slot's committed rows from ``length`` on to its parking."""
        lib, mem = self.lib, self.mem
        lib.llama_memory_seq_cp(mem, slot, self.park_seq(slot), length, -1)
        lib.llama_memory_seq_rm(mem, slot, length, -1)
        self._add_parked(slot, range(length, self.committed(slot)))
        self._cut(slot, length)

    def _cut(self, slot: int, length: int) -> None:
        """Forget the slot's committed tokens from ``length`` on."""
        del self.tokens[slot][length:]
        del self.written[slot][length:]
        ends = self.prefill_ends[slot]
        del ends[bisect.bisect_right(ends, length):]

    def _park_rows(self, slot: int, rows: list[TreeRow]) -> None:
        """Park tree rows' cells and release their sequences."""
        for row in rows:
            self.lib.llama_memory_seq_cp(self.mem, row.seq, self.park_seq(slot), row.pos, row.pos + 1)
        self._add_parked(slot, [row.pos for row in rows])
        self._release(rows)

    def _add_parked(self, slot: int, positions) -> None:
        for p in positions:
            bisect.insort(self.parked[slot], p)

    def _new_seq(self) -> int:
        if not self.free_seqs:
            raise ValueError(f"the llama.cpp runtime ran out of sequence ids for tree rows "
                             f"({TREE_SEQS_PER_SLOT} per slot): use a smaller tree")
        return self.free_seqs.pop()

    def _release(self, rows: list[TreeRow]) -> None:
        for row in rows:
            self.lib.llama_memory_seq_rm(self.mem, row.seq, -1, -1)
            self.free_seqs.append(row.seq)


class LlamaCppRuntime:
    """Runtime for a GGUF file on llama.cpp (CPU). ``threads``: default torch's thread count;
    ``context``: tokens per slot (capped by the model's training context); ``exact``: feed
    continuations in pieces of at most ``max_rows`` rows, so they give one-row decoding's
    logits (see the module docstring); ``repack``: llama.cpp's repacked CPU weights for
    Q4_0/Q4_K/IQ4_NL (llama-cpp-python's default too): one-row forwards ~5% faster on
    Qwen2.5-Coder-1.5B Q4_K_M, but their products of 4+ rows round unlike one row, so an
    exact runtime's check finds 3 rows at most there and long verifications cost more (5
    rows: 3.75x one row, against 3.03x unrepacked); on the bench that is faster on the chat
    and completion prompts and within the noise on the edits (docs/bench.md)."""

    supports_masks = masks_reach_cache = True
    batch_layout = "packed"
    # prefix reuse: a finished prompt's rows stay in its slot (its cells rise with position, and
    # a new prompt's rows go to cells above them); no copies between slots (LlamaCppCache has
    # no ``copy``: shared cells could lie above the destination's next ones)
    reuses_prefixes = True
    whole_prompts = False
    rewinds = True

    def __init__(self, gguf: str | Path, threads: int | None = None, context: int = DEFAULT_CONTEXT,
                 repack: bool = True, exact: bool = True):
        lib = self.lib = llama_lib()
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0
        params.use_extra_bufts = repack
        self.model = lib.llama_model_load_from_file(str(gguf).encode(), params)
        if not self.model:
            raise ValueError(f"llama.cpp could not load {gguf}")
        self.gguf, self.repack, self.exact = Path(gguf).resolve(), repack, exact
        self.vocab_size = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.trained_context = lib.llama_model_n_ctx_train(self.model)
        self.max_context = min(self.trained_context, context)
        self.threads = threads or torch.get_num_threads()
        self.device = torch.device("cpu")

    @property
    def kv_types(self) -> tuple[int, int]:
        """The ggml types of the K and V caches: Q8_0 and F16 for an exact runtime (with K and V
        both F16, llama.cpp's default, it splits one row's attention over the threads from 512
        cached cells on, which rounds unlike the attention of several rows; see the module
        docstring), else F16 and F16."""
        f16 = self.lib.GGML_TYPE_F16
        return (self.lib.GGML_TYPE_Q8_0 if self.exact else f16), f16

    @property
    def settings(self) -> str:
        """What besides the file and the threads sets this runtime's rounding and speed (part
        of the keys of the row-limit and forward-cost caches)."""
        return f"repack={self.repack},kv_types={self.kv_types}"

    @property
    def speed_key(self) -> str:
        """``settings``, and an exact runtime's piece size."""
        return self.settings + (f",max-rows={self.max_rows}" if self.exact else "")

    @functools.cached_property
    def max_rows(self) -> int:
        """The largest forward (in rows) checked to give one-row decoding's logits: measured
        once by ``exact_rows``, then read from specdec's cache directory."""
        from importlib.metadata import version

        stat = self.gguf.stat()
        key = "|".join([str(self.gguf), str(stat.st_size), str(stat.st_mtime_ns), f"threads={self.threads}",
                        self.settings, "contexts=" + ",".join(map(str, ROW_CONTEXTS)), f"llama_cpp={version('llama_cpp_python')}",
                        disk_cache.machine()])
        path = disk_cache.directory() / "llamacpp_rows.json"
        rows = disk_cache.read(path).get(key)
        if not isinstance(rows, int):
            rows = exact_rows(self)
            disk_cache.store(path, key, rows)
        return rows

    def __del__(self):
        model, self.model = getattr(self, "model", None), None
        if model:
            self.lib.llama_model_free(model)

    def eog_ids(self) -> frozenset[int]:
        """The tokens llama.cpp ends generation at (``llama_vocab_is_eog``)."""
        vocab = self.lib.llama_model_get_vocab(self.model)
        return frozenset(i for i in range(self.vocab_size) if self.lib.llama_vocab_is_eog(vocab, i))

    def tree_rows(self, num_slots: int) -> int:
        """Tree rows each of ``num_slots`` slots can hold at once (``tree_rows``)."""
        return tree_rows(num_slots)

    def new_cache(self, num_slots: int, max_rows: int | None = None) -> LlamaCppCache:
        return LlamaCppCache(self, num_slots)

    def forward(self, cache: LlamaCppCache, slots, tokens, *, positions=None, chunk_masks=None,
                last_only: bool = False, prefill: bool = False) -> torch.Tensor:
        """Every slot's chunk in one ``llama_decode`` (a continuation on an ``exact`` runtime: in
        pieces of at most ``max_rows`` rows); logits only for the rows returned. An ``exact``
        runtime decodes each prompt (a slot at length 0) and each ``prefill`` or ``last_only``
        chunk (a prefill chunk) whole and alone: llama.cpp's matrix products take rows in
        groups (of 4 with repacked weights), so a prompt's last rows batched after another
        prompt's would round unlike the same prompt alone."""
        whole = prefill or last_only or not all(cache.lengths[s] for s in slots)
        if self.exact and len(slots) > 1 and whole:
            rows = [self.forward(cache, [slot], [toks], last_only=last_only, prefill=prefill,
                                 positions=positions and [positions[b]], chunk_masks=chunk_masks and [chunk_masks[b]])
                    for b, (slot, toks) in enumerate(zip(slots, tokens))]  # [1, vocab] or [1, n_b, vocab]
            rows = torch.cat([r if last_only else r[0] for r in rows])  # [sum of returned rows, vocab]
            return self._logits(rows, [len(t) for t in tokens], last_only)
        limit = self.max_rows if self.exact and not whole else None
        return self._forward(cache, slots, tokens, positions=positions, chunk_masks=chunk_masks,
                             last_only=last_only, limit=limit)

    def _forward(self, cache: LlamaCppCache, slots, tokens, *, positions=None, chunk_masks=None,
                 last_only: bool = False, limit: int | None = None) -> torch.Tensor:
        """``forward`` in one ``llama_decode``, or in balanced pieces of at most ``limit`` rows
        (sizes differing by at most one)."""
        opened: list[tuple[int, list[TreeRow]]] = []  # (slot, rows) of masked chunks
        pos, seqs = [], []
        for slot, toks in zip(slots, tokens):  # a new sequence refills parked cells, in order
            cache.idle.discard(slot)
            if cache.lengths[slot] == 0:
                cache.make_room(slot, len(toks))
        cache.fit(sum(map(len, tokens)))
        cache.clock += 1
        try:
            for b, (slot, toks) in enumerate(zip(slots, tokens)):
                p = positions[b] if positions is not None else None
                m = chunk_masks[b] if chunk_masks is not None else None
                length = cache.lengths[slot]
                p = list(range(length, length + len(toks))) if p is None else list(p)
                if m is None:
                    if cache.tail[slot] or p != list(range(length, length + len(toks))):
                        raise ValueError("the llama.cpp runtime appends chains at the slot's next "
                                         "positions, after its tree rows were kept or rewound")
                    seqs += [[slot]] * len(toks)
                else:
                    rows, chunk_seqs = cache.open_tree(slot, list(map(int, toks)), p, m)
                    opened.append((slot, rows))
                    seqs += chunk_seqs
                pos += p
            outputs = [int(i == len(t) - 1 or not last_only) for t in tokens for i in range(len(t))]
            flat = [x for t in tokens for x in t]
            bounds = piece_bounds(len(flat), limit)
            out = [self._decode(cache, flat[a:b], pos[a:b], seqs[a:b], outputs[a:b])
                   for a, b in zip(bounds, bounds[1:])]
        except BaseException:
            for _, rows in opened:
                cache._release(rows)
            for slot in slots:  # a failed decode may leave some of a chain behind
                if not cache.tail[slot]:
                    self.lib.llama_memory_seq_rm(cache.mem, slot, cache.lengths[slot], -1)
            raise
        for slot, rows in opened:
            cache.tail[slot] += rows
        for b, (slot, toks) in enumerate(zip(slots, tokens)):
            if chunk_masks is None or chunk_masks[b] is None:
                ends = cache.prefill_ends[slot]
                if self.exact and limit is None and (ends[-1] if ends else 0) == cache.committed(slot):
                    ends.append(cache.committed(slot) + len(toks))  # a whole decode, for recompute
                cache.tokens[slot] += map(int, toks)
                cache.written[slot] += [cache.clock] * len(toks)
            cache.lengths[slot] += len(toks)
        rows = out[0] if len(out) == 1 else torch.cat(out)  # [sum(outputs), vocab]
        return self._logits(rows, [len(t) for t in tokens], last_only)

    def recompute(self, cache: LlamaCppCache, slot: int) -> None:
        """Write the KV of the slot's committed tokens (``cache.tokens``) anew, as plain
        decoding made it: the prefill's whole decodes (``cache.prefill_ends``), then pieces
        of at most ``max_rows`` rows (whose logits are one-row decoding's)."""
        ids, ends = cache.tokens[slot], cache.prefill_ends[slot]
        cache.clock += 1
        cache.written[slot] = [cache.clock] * len(ids)
        p = ends[-1] if ends else 0
        bounds = [0] + ends + [p + b for b in piece_bounds(len(ids) - p, self.max_rows)[1:]]
        for a, b in zip(bounds, bounds[1:]):
            if b > a:  # the prefill's logits: each decode's last row only, as when it was made
                self._decode(cache, ids[a:b], list(range(a, b)), [[slot]] * (b - a),
                             [int(a >= p or i == b - 1) for i in range(a, b)])

    def _decode(self, cache: LlamaCppCache, tokens: list[int], pos: list[int],
                seqs: list[list[int]], outputs: list[int]) -> torch.Tensor:
        """One ``llama_decode``; the logits of its output rows, ``[sum(outputs), vocab]``."""
        lib = self.lib
        token = np.asarray(tokens, dtype=np.int32)  # [N]
        position = np.asarray(pos, dtype=np.int32)  # [N]
        n_seq = np.asarray([len(s) for s in seqs], dtype=np.int32)  # [N]
        flat = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int32)  # [sum n_seq]
        first = np.concatenate(([0], np.cumsum(n_seq)[:-1]))  # [N] offset of each token's ids
        seq_ptr = (flat.ctypes.data + flat.itemsize * first).astype(np.uintp)  # [N] int32 *
        logits = np.asarray(outputs, dtype=np.int8)  # [N]
        batch = lib.llama_batch()
        batch.n_tokens = len(tokens)
        batch.token = token.ctypes.data_as(ctypes.POINTER(lib.llama_token))
        batch.pos = position.ctypes.data_as(ctypes.POINTER(lib.llama_pos))
        batch.n_seq_id = n_seq.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        batch.seq_id = seq_ptr.ctypes.data_as(ctypes.POINTER(ctypes.POINTER(lib.llama_seq_id)))
        batch.logits = logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        rc = lib.llama_decode(cache.ctx, batch)
        if rc == 1:
            raise ValueError("the llama.cpp KV cache is full: fewer slots or shorter requests")
        if rc != 0:
            raise ValueError(f"llama_decode failed with code {rc} (llama.cpp's log above says why)")
        rows = int(logits.sum())
        if not rows:
            return torch.empty(0, self.vocab_size)
        ptr = lib.llama_get_logits(cache.ctx)
        return torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(rows, self.vocab_size)).copy())  # [rows, V]

    def _logits(self, out: torch.Tensor, sizes: list[int], last_only: bool) -> torch.Tensor:
        """The output rows ``out`` ``[rows, vocab]`` as ``[batch, vocab]`` (last_only) or
        ``[batch, max_n, vocab]``."""
        if last_only or len(set(sizes)) == 1:
            return out if last_only else out.view(len(sizes), sizes[0], self.vocab_size)
        padded = out.new_zeros(len(sizes), max(sizes), self.vocab_size)  # [B, T, V]
        for b, chunk in enumerate(out.split(sizes)):
            padded[b, : sizes[b]] = chunk
        return padded


def exact_rows(runtime: LlamaCppRuntime, contexts: Sequence[int] = ROW_CONTEXTS) -> int:
    """The largest of ``ROW_CHECKS`` up to which every checked forward size gives exactly the
    logits of feeding its tokens one at a time, after each context length of ``contexts``
    (kernels may switch with the number of cached cells), else 1."""
    g = torch.Generator().manual_seed(0)
    vocab = min(runtime.vocab_size, 1000)
    ids = torch.randint(0, vocab, (max(contexts) + max(ROW_CHECKS),), generator=g).tolist()
    good = max(ROW_CHECKS)
    for context in contexts:
        cache = LlamaCppCache(runtime, 1)
        runtime._forward(cache, [0], [ids[:context]], last_only=True)
        sizes = [n for n in ROW_CHECKS if n <= good]
        one = torch.cat([runtime._forward(cache, [0], [[t]])[0]
                         for t in ids[context: context + max(sizes)]])  # [rows, V]
        good = 1
        for n in sizes:
            cache.rewind(0, context)
            if not torch.equal(runtime._forward(cache, [0], [ids[context: context + n]])[0], one[:n]):
                break
            good = n
        if good == 1:
            break
    return good
