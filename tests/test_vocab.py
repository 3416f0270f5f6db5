"""Draft/target tokenizer compatibility (``specdec.vocab``).

Every tokenizer here is built in-process with the ``tokenizers`` library (a byte-level BPE
over a handful of merges) and wrapped in ``transformers.PreTrainedTokenizerFast``; one test
uses a minimal slow (pure-Python) tokenizer. Nothing is downloaded.
"""
from __future__ import annotations

import json
import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tiny import char_tokenizer

from specdec.vocab import (PROBE_TEXT, VocabReport, _first_merge_difference, compare_tokenizers,
                           require_compatible)

ALPHABET = sorted(pre_tokenizers.ByteLevel.alphabet())  # 256 byte-level symbols, ids 0..255
# "Ġ" is the byte-level space. The probe text contains "hello", "the", "world" and " the".
MERGES = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("t", "h"), ("th", "e"),
          ("Ġ", "t"), ("Ġt", "he"), ("o", "r"), ("w", "or"), ("wor", "l"), ("worl", "d")]


def bpe(merges=MERGES, *, tokens=None, swap=None, pre_added=(), bos="<s>", eos="</s>",
        prefix_space=False, **kw) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer: the byte alphabet (ids 0..255), then ``tokens`` (default:
    the merge results in merge order), then ``pre_added`` added tokens, then bos/eos."""
    vocab = {ch: i for i, ch in enumerate(ALPHABET)}
    for tok in tokens if tokens is not None else (a + b for a, b in merges):
        vocab.setdefault(tok, len(vocab))
    if swap:
        a, b = swap
        vocab[a], vocab[b] = vocab[b], vocab[a]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=list(merges)))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix_space)
    backend.decoder = decoders.ByteLevel()
    if pre_added:
        backend.add_special_tokens([AddedToken(t, special=True) for t in pre_added])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos, **kw)


def one_line(text: str) -> bool:
    return "\n" not in text and "\r" not in text


# --- compatible ---------------------------------------------------------------------------

def test_identical_tokenizers_are_compatible():
    target, draft = bpe(), bpe()  # built separately: equal content, distinct objects
    report = compare_tokenizers(target, draft)
    assert isinstance(report, VocabReport)
    assert report.compatible and report.problems == [] and report.num_problems == 0
    assert report.shared == report.target_size == report.draft_size == len(target)
    assert report.summary() == f"compatible: {len(target)} shared ids agree"
    require_compatible(target, draft)  # no exception
    assert compare_tokenizers(target, target).compatible


def test_tiny_byte_tokenizer_is_compatible_with_itself():
    from tiny import byte_tokenizer

    assert compare_tokenizers(byte_tokenizer(), byte_tokenizer()).compatible


def test_target_with_extra_added_tokens_is_compatible():
    """Extra ids beyond the shared range (e.g. the target has more added tokens, as padded
    vocabularies do) are fine while the shared ids and the specials agree."""
    target, draft = bpe(), bpe()
    target.add_tokens(["<extra_0>", "<extra_1>"])
    target.add_special_tokens({"additional_special_tokens": ["<|fim_prefix|>"]})
    assert len(target) == len(draft) + 3

    report = compare_tokenizers(target, draft)
    assert report.compatible, report.problems
    assert report.shared == len(draft)
    assert (report.target_size, report.draft_size) == (len(target), len(draft))
    assert report.summary().startswith(f"compatible: {len(draft)} shared ids agree")
    assert compare_tokenizers(draft, target).compatible  # the draft may be the larger one too


def test_draft_declaring_another_eos_is_only_noted():
    """A draft that declares a different eos (a base model drafting for its instruct
    sibling) is compatible when both tokens sit at the same ids on both sides."""
    target = bpe(pre_added=["<|im_end|>"], eos="<|im_end|>")
    draft = bpe(pre_added=["<|im_end|>"], eos="</s>")
    report = compare_tokenizers(target, draft)
    assert report.compatible, report.problems
    assert any("eos" in n and "<|im_end|>" in n for n in report.notes)


# --- incompatible -------------------------------------------------------------------------

def test_swapped_tokens_same_size_are_incompatible():
    target, draft = bpe(), bpe(swap=("he", "ll"))
    assert len(target) == len(draft)
    he, ll = target.convert_tokens_to_ids(["he", "ll"])
    report = compare_tokenizers(target, draft)
    assert not report.compatible
    assert report.differing_ids == 2
    assert report.problems[:2] == [f"id {he} 'he' vs 'll'", f"id {ll} 'll' vs 'he'"]
    summary = report.summary()
    assert summary.startswith(f"incompatible: 2 of {len(target)} ids differ; first: id {he} 'he' vs 'll'")
    assert one_line(summary)


def test_same_vocab_different_merge_order_is_incompatible():
    """Same tokens at the same ids, but merges in another order: "hel" becomes he+l in one
    and h+el in the other. Only the merge list (and the probe text) can tell."""
    tokens = ["he", "el", "ll", "lo"]
    target = bpe([("h", "e"), ("e", "l"), ("l", "l"), ("l", "o")], tokens=tokens)
    draft = bpe([("e", "l"), ("h", "e"), ("l", "l"), ("l", "o")], tokens=tokens)
    assert target.get_vocab() == draft.get_vocab()
    report = compare_tokenizers(target, draft)
    assert not report.compatible
    assert report.differing_ids == 0
    assert "merge #0 differs: target 'h e' vs draft 'e l'" in report.problems
    assert any(p.startswith("probe text encodes differently") for p in report.problems)
    assert report.summary().startswith("incompatible: 2 problems; first: merge #0 differs")


def test_missing_merge_is_incompatible():
    target, draft = bpe(), bpe(MERGES[:-1], tokens=[a + b for a, b in MERGES])
    report = compare_tokenizers(target, draft)
    assert not report.compatible and report.differing_ids == 0
    n = len(MERGES) - 1
    assert f"merge lists differ in length: the first {n} merges agree, then the target has " \
           f"more (merge #{n} 'worl d')" in report.problems


def test_pre_tokenizer_difference_is_caught_by_the_probe_text():
    """Same vocab, same merges, different pre-tokenizer: only encoding text can tell."""
    report = compare_tokenizers(bpe(), bpe(prefix_space=True))
    assert not report.compatible and report.differing_ids == 0
    assert report.problems and all(p.startswith("probe text") for p in report.problems)


def test_different_eos_id_is_incompatible():
    """The draft has one more added token before bos/eos: "</s>" sits one id later."""
    target, draft = bpe(), bpe(pre_added=["<pad>"])
    assert draft.eos_token_id == target.eos_token_id + 1
    report = compare_tokenizers(target, draft)
    assert not report.compatible
    assert f"special token '</s>': target id {target.eos_token_id} vs draft id {draft.eos_token_id}" \
        in report.problems


def test_target_eos_missing_from_draft_is_incompatible():
    target, draft = bpe(), bpe(bos="<s>", eos="<|end|>")
    report = compare_tokenizers(target, draft)
    assert not report.compatible
    assert any(p.startswith("target eos token '</s>'") and "missing from the draft" in p
               for p in report.problems)


def test_special_token_at_different_ids_beyond_shared_range_is_incompatible():
    target, draft = bpe(), bpe()
    target.add_tokens(["<a>", "<b>"])
    target.add_special_tokens({"additional_special_tokens": ["<|fim|>"]})
    draft.add_special_tokens({"additional_special_tokens": ["<|fim|>"]})
    report = compare_tokenizers(target, draft)
    assert not report.compatible and report.differing_ids == 1  # the draft's <|fim|> id
    assert any(p.startswith("special token '<|fim|>'") for p in report.problems)


def test_require_compatible_raises_one_line_value_error():
    with pytest.raises(ValueError) as err:
        require_compatible(bpe(), bpe(swap=("he", "ll")))
    msg = str(err.value)
    assert msg.startswith("draft tokenizer is incompatible with the target: incompatible: 2 of ")
    assert one_line(msg)
    with pytest.raises(ValueError) as err:  # a problem that is not an id: still one line
        require_compatible(bpe(), bpe(prefix_space=True))
    assert one_line(str(err.value)) and "probe text" in str(err.value)


def test_limit_lists_first_problems_and_a_count_line():
    """Unrelated vocabularies: many ids differ; at most `limit` lines plus a count line."""
    target = bpe()
    shuffled = bpe(tokens=[a + b for a, b in reversed(MERGES)])
    report = compare_tokenizers(target, shuffled, limit=4)
    assert not report.compatible
    assert len(report.problems) == 5 and report.problems[-1].startswith("... and ")
    assert report.problems[0].startswith("id 256 ")
    listed = len(report.problems) - 1
    assert f"... and {report.num_problems - listed} more problems" in report.problems[-1]
    assert report.summary().startswith(f"incompatible: {report.differing_ids} of {report.shared} ids differ")
    # non-id problems still get lines when ids differ
    assert any(not p.startswith(("id ", "...")) for p in report.problems)
    assert len(compare_tokenizers(target, shuffled, limit=100).problems) == report.num_problems


# --- slow tokenizers ----------------------------------------------------------------------

def test_slow_tokenizers():
    chars = list("abcdefghijklmnopqrstuvwxyz ?")
    target = char_tokenizer(chars, bos_token="<s>", eos_token="</s>")
    assert not target.is_fast
    assert compare_tokenizers(target, char_tokenizer(chars, bos_token="<s>", eos_token="</s>")).compatible
    swapped = chars[:]
    swapped[0], swapped[1] = swapped[1], swapped[0]
    report = compare_tokenizers(target, char_tokenizer(swapped, bos_token="<s>", eos_token="</s>"))
    assert not report.compatible and report.problems[:2] == ["id 0 'a' vs 'b'", "id 1 'b' vs 'a'"]
    # slow vs fast: nothing in common but the comparison still works
    assert not compare_tokenizers(target, bpe()).compatible


# --- the merge-list locator and speed -----------------------------------------------------

def _serialise(merges, pairs: bool) -> str:
    items = [list(m) for m in merges] if pairs else [" ".join(m) for m in merges]
    return json.dumps(items, ensure_ascii=False, separators=(",", ":")) + "}"


@pytest.mark.parametrize("pairs", [True, False])
def test_first_merge_difference_matches_brute_force(pairs):
    """The regex/prefix locator agrees with a full parse, even with tokens made of JSON
    syntax (quotes, backslashes, brackets, commas)."""
    rng = random.Random(0)
    nasty = ["],[", '"', "\\", '","', "[", "]", ",", '\\"', "a", "b", "Ġ", "日"]
    if not pairs:  # the old "a b" format cannot hold a space or a lone part with one
        nasty = [t for t in nasty if " " not in t]
    for trial in range(300):
        base = [(rng.choice(nasty) + rng.choice(nasty), rng.choice(nasty)) for _ in range(40)]
        other = list(base)
        i = rng.randrange(len(base) + 1)
        if i == len(base):
            other = other[:-rng.randrange(1, 4)]  # a shorter draft
        else:
            while other[i] == base[i]:
                other[i] = (rng.choice(nasty), rng.choice(nasty) + rng.choice(nasty))
        expect = next(j for j in range(len(base) + 1) if j >= len(other) or base[j] != other[j])
        found = _first_merge_difference(_serialise(base, pairs), _serialise(other, pairs))
        assert found is not None, trial
        index, a, b = found
        assert index == expect, (trial, base, other)
        norm = (lambda x: tuple(x) if pairs else tuple(x.split(" ", 1)))
        assert a is not None and norm(a) == base[expect]
        assert (b is None) == (expect >= len(other))


@pytest.fixture(scope="module")
def big_merges():
    """~148k tokens and ~147k merges: the size of real 150k vocabularies (Qwen2.5)."""
    vocab = {ch: i for i, ch in enumerate(ALPHABET)}
    merges = []
    for a in ALPHABET:
        for b in ALPHABET:
            merges.append((a, b))
            vocab[a + b] = len(vocab)
    for a in ALPHABET[:160]:
        for b in ALPHABET:
            for c in ALPHABET[:2]:
                merges.append((a + b, c))
                vocab[a + b + c] = len(vocab)
    return vocab, merges


def _big(vocab, merges):
    backend = Tokenizer(models.BPE(vocab=dict(vocab), merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")


def test_150k_vocabulary_late_merge_difference(big_merges):
    """A real-size vocabulary (speed is the bench's business, not a test's): a swap near the
    end of the merge list is found and named."""
    vocab, merges = big_merges
    late = list(merges)
    late[-5], late[-4] = late[-4], late[-5]  # differ only near the end of the merge list
    target, other = _big(vocab, merges), _big(vocab, late)
    assert len(target) > 147_000
    assert compare_tokenizers(target, target).compatible
    report = compare_tokenizers(target, other)
    assert not report.compatible
    a, b = merges[-5], merges[-4]
    assert report.problems == [f"merge #{len(merges) - 5} differs: target {' '.join(a)!r} "
                               f"vs draft {' '.join(b)!r}"]


def test_probe_text_is_varied():
    assert all(s in PROBE_TEXT for s in ("def ", "\t", "   ", "\r\n", "123", "日本", "😀", "é"))
