"""Train an EAGLE-3 head for a target model, on whatever machine this runs on, and write it
as SGLang and vLLM load one (``LlamaForCausalLMEagle3``: ``midlayer.*``, ``fc``, ``norm``,
``lm_head`` over a draft vocabulary, ``d2t`` / ``t2d``), so that
``LLM(target, draft=OUT)`` (or ``--method eagle3 --draft OUT``) drafts with it.

    python scripts/train_eagle3.py --target MODEL --out DIR [--text DIR_OR_FILE ...] [--chat N]

Data, in token sequences of ``--seq-len``:
- ``--chat N``: N chat requests built from the docstrings and sources of the Python files
  under ``--text`` (write this function / add type hints to it / explain it), answered by the
  target itself, greedy (self-distillation: the head learns the text it will draft);
- the ``--text`` files themselves, as completion text, up to ``--tokens`` in all.

The target prefills every sequence once (specdec's torch runtime, ``TorchLlama.capture``):
its three tapped hidden states per row (the head's input) and its top ``--topk`` next-token
probabilities (the head's soft labels). The draft vocabulary is the ``--draft-vocab`` ids the
target predicts most often (its top-1 over the data, then the data's own ids).

The head is trained as EAGLE-3 trains one (training-time test): step 0 pairs the target's
feature at row t with token t + 1; step j > 0 feeds row t the head's own output of step j - 1
with token t + 1 + j, attending to step 0's rows up to t and to its own row's earlier steps
(exactly what a chain of drafts sees at inference). Loss: cross-entropy against the target's
probabilities restricted to the draft vocabulary, step j weighted 0.8^j.
"""
from __future__ import annotations

import argparse
import ast
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.runtime.ops import rms_norm, rotate


# ---- data ----------------------------------------------------------------------------------

def python_files(roots: list[str]) -> list[Path]:
    files = []
    for root in roots:
        p = Path(root).expanduser()
        files += sorted(f for f in p.rglob("*.py") if "site-packages" not in f.relative_to(p).parts) \
            if p.is_dir() else [p]
    return [f for f in files if "test" not in f.name and f.stat().st_size < 200_000]


def chat_requests(files: list[Path], n: int, seed: int) -> list[list[dict]]:
    """``n`` single-turn chat requests about the functions in ``files``: write one from its
    signature and docstring, add type hints and a docstring to its source, or explain it."""
    found = []
    for f in files:
        try:
            src = f.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                body = ast.get_source_segment(src, node) or ""
                if 3 <= body.count("\n") <= 30:
                    found.append((node, body))
    rng = random.Random(seed)
    rng.shuffle(found)
    requests = []
    for i, (node, body) in enumerate(found[:n]):
        doc = (ast.get_docstring(node) or "").strip().split("\n")[0]
        args = ", ".join(a.arg for a in node.args.args)
        kind = i % 3 if doc else 1 + i % 2
        if kind == 0:
            text = f"Write a Python function `{node.name}({args})`: {doc}"
        elif kind == 1:
            text = ("Add type hints and a docstring to this function. Return the whole function."
                    f"\n\n```python\n{body}\n```")
        else:
            text = f"Explain briefly what this Python function does.\n\n```python\n{body}\n```"
        requests.append([{"role": "user", "content": text}])
    return requests


def sequences(args, llm) -> list[list[int]]:
    """Token sequences of at most ``--seq-len``: the target's own chat answers, then text."""
    files = python_files(args.text)
    random.Random(args.seed).shuffle(files)
    out: list[list[int]] = []
    if args.chat:
        from specdec import SamplingParams

        requests = chat_requests(files, args.chat, args.seed)
        t0, made = time.time(), 0
        for i in range(0, len(requests), 32):
            for o in llm.chat(requests[i: i + 32], SamplingParams(max_tokens=args.answer_tokens)):
                out.append((list(o.prompt_token_ids) + list(o.outputs[0].token_ids))[: args.seq_len])
                made += len(o.outputs[0].token_ids)
            print(f"chat: {len(out)}/{len(requests)} answers, {made} tokens, {time.time() - t0:.0f} s", flush=True)
    total = sum(map(len, out))
    tok = llm.tokenizer
    for f in files:
        if total >= args.tokens:
            break
        ids = tok(f.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False).input_ids
        for i in range(0, len(ids) - 64, args.seq_len):
            out.append(ids[i: i + args.seq_len])
            total += len(out[-1])
    print(f"data: {len(out)} sequences, {total} tokens", flush=True)
    return out


@torch.inference_mode()
def prefill(rt, seqs: list[list[int]], taps, topk: int):
    """The target's tapped hidden states ``[T, 3 hidden]`` (float16) and top-``topk``
    next-token ids and probabilities ``[T, topk]`` for each sequence."""
    rt.capture(taps)
    data, t0 = [], time.time()
    for n, ids in enumerate(seqs):
        cache = rt.new_cache(1)
        logits = rt.forward(cache, [0], [ids])[0]  # [T, vocab]
        p, i = logits.float().softmax(-1).topk(topk, dim=-1)  # [T, topk]
        data.append((torch.tensor(ids), rt.features[0].half().cpu(), i.int().cpu(), p.half().cpu()))
        if n % 100 == 99:
            done = sum(len(d[0]) for d in data)
            print(f"prefill: {n + 1}/{len(seqs)} sequences, {done / (time.time() - t0):.0f} tok/s", flush=True)
    return data


def draft_vocabulary(data, size: int, vocab: int) -> torch.Tensor:
    """The ``size`` target ids the target predicts most (top-1), then the data's most
    frequent ids: sorted, as ``d2t`` needs."""
    top1 = torch.zeros(vocab, dtype=torch.long)
    seen = torch.zeros(vocab, dtype=torch.long)
    for ids, _, top, _ in data:
        top1 += torch.bincount(top[:, 0].long(), minlength=vocab)
        seen += torch.bincount(ids, minlength=vocab)
    score = top1.double() * 1e9 + seen.double()  # top-1 counts first, ties by the data
    return score.topk(size).indices.sort().values


# ---- the head ------------------------------------------------------------------------------

class Head(torch.nn.Module):
    """EAGLE-3's one decoder layer, as SGLang and vLLM run it, over a batch of sequences."""

    def __init__(self, cfg: dict, embed: torch.Tensor, lm_head: torch.Tensor, norm: torch.Tensor):
        super().__init__()
        h, H, KV = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.cfg, self.H, self.KV, self.D = cfg, H, KV, h // H
        self.eps = cfg["rms_norm_eps"]
        self.register_buffer("embed", embed)  # the target's, frozen

        def lin(o, i):
            return torch.nn.Linear(i, o, bias=False)

        self.fc = lin(h, 3 * h)
        self.q, self.k, self.v = lin(H * self.D, 2 * h), lin(KV * self.D, 2 * h), lin(KV * self.D, 2 * h)
        self.o = lin(h, H * self.D)
        I = cfg["intermediate_size"]
        self.gate, self.up, self.down = lin(I, h), lin(I, h), lin(h, I)
        self.input_norm, self.hidden_norm, self.post_norm = (torch.nn.Parameter(torch.ones(h)) for _ in range(3))
        self.norm = torch.nn.Parameter(norm.clone())
        self.lm_head = torch.nn.Parameter(lm_head.clone())  # [draft vocab, hidden]
        inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, self.D, 2).float() / self.D))
        self.register_buffer("inv_freq", inv)

    def rope(self, x, pos):  # x [B, heads, R, D], pos [R]
        ang = pos.float()[:, None] * self.inv_freq
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        return rotate(x, cos, sin)

    def forward(self, tokens, features, steps: int):
        """``tokens`` [B, T], ``features`` [B, T, 3 hidden]: the draft logits [B, T - 1, draft
        vocab] of each step (row t of step j at position t + j, fed token t + 1 + j; rows past
        the sequence are fed id 0 and must be masked out of the loss)."""
        B, T = tokens.shape
        R = T - 1
        H, KV, D = self.H, self.KV, self.D
        hid = self.fc(features[:, :R])  # [B, R, hidden]
        keys, values, out = [], [], []
        causal = torch.ones(R, R, dtype=torch.bool, device=tokens.device).tril()
        for j in range(steps):
            ids = F.pad(tokens[:, 1 + j:], (0, j))  # [B, R]
            pos = torch.arange(R, device=tokens.device) + j
            normed = rms_norm(hid, self.hidden_norm, self.eps)
            a = torch.cat([rms_norm(F.embedding(ids, self.embed), self.input_norm, self.eps), normed], -1)  # [B, R, 2h]
            q = self.rope(self.q(a).view(B, R, H, D).transpose(1, 2), pos)  # [B, H, R, D]
            k = self.rope(self.k(a).view(B, R, KV, D).transpose(1, 2), pos).repeat_interleave(H // KV, 1)
            v = self.v(a).view(B, R, KV, D).transpose(1, 2).repeat_interleave(H // KV, 1)
            keys.append(k)
            values.append(v)
            scores = (q @ keys[0].transpose(-1, -2)).masked_fill(~causal, float("-inf"))  # [B, H, R, R]
            own = [(q * kk).sum(-1, keepdim=True) for kk in keys[1:]]  # this row's earlier steps, [B, H, R, 1]
            p = (torch.cat([scores, *own], -1) / math.sqrt(D)).softmax(-1)
            o = p[..., :R] @ values[0]
            for i, vv in enumerate(values[1:]):
                o = o + p[..., R + i: R + i + 1] * vv
            h = hid + self.o(o.transpose(1, 2).reshape(B, R, H * D))
            m = rms_norm(h, self.post_norm, self.eps)
            h = h + self.down(F.silu(self.gate(m)) * self.up(m))
            out.append(F.linear(rms_norm(h, self.norm, self.eps), self.lm_head))
            hid = h
        return out

    def named(self) -> dict:
        """The weights under SGLang's and vLLM's EAGLE-3 names."""
        m = "midlayer."
        return {"fc.weight": self.fc.weight, m + "self_attn.q_proj.weight": self.q.weight,
                m + "self_attn.k_proj.weight": self.k.weight, m + "self_attn.v_proj.weight": self.v.weight,
                m + "self_attn.o_proj.weight": self.o.weight, m + "mlp.gate_proj.weight": self.gate.weight,
                m + "mlp.up_proj.weight": self.up.weight, m + "mlp.down_proj.weight": self.down.weight,
                m + "input_layernorm.weight": self.input_norm, m + "hidden_norm.weight": self.hidden_norm,
                m + "post_attention_layernorm.weight": self.post_norm, "norm.weight": self.norm,
                "lm_head.weight": self.lm_head}

    def save(self, out: Path, kept: torch.Tensor) -> None:
        """Write the head to ``out`` as an EAGLE-3 checkpoint drafting the target ids ``kept``."""
        from safetensors.torch import save_file

        vocab = self.cfg["vocab_size"]
        w = {k: v.detach().cpu().contiguous().clone() for k, v in self.named().items()}
        w["d2t"] = kept - torch.arange(len(kept))  # draft id + d2t = target id
        w["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill(0, kept, True)
        out.mkdir(parents=True, exist_ok=True)
        save_file(w, str(out / "model.safetensors"))
        cfg = dict(self.cfg, architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                   hidden_act="silu", tie_word_embeddings=False, draft_vocab_size=len(kept), torch_dtype="float32")
        (out / "config.json").write_text(json.dumps(cfg, indent=2))

    @classmethod
    @torch.no_grad()
    def load(cls, path: Path, embed: torch.Tensor) -> "Head":
        """A head ``save`` wrote (to train further, or to check), on the target's ``embed``."""
        from safetensors.torch import load_file

        w = load_file(str(path / "model.safetensors"))
        head = cls(json.loads((path / "config.json").read_text()), embed, w["lm_head.weight"], w["norm.weight"])
        for name, param in head.named().items():
            param.copy_(w[name])
        head.kept = w["d2t"] + torch.arange(len(w["d2t"]))  # the target ids it drafts
        return head


def feature_taps_of(rt) -> tuple[int, ...]:
    """The target hidden states an EAGLE-3 head reads by default (SGLang's and vLLM's)."""
    from specdec.runtime.eagle import feature_taps

    return feature_taps("eagle3", None, rt.num_layers)


def batches(data, to_draft, size: int, rng: random.Random):
    order = list(range(len(data)))
    rng.shuffle(order)
    order.sort(key=lambda i: len(data[i][0]))  # similar lengths together, then shuffled batches
    groups = [order[i: i + size] for i in range(0, len(order), size)]
    rng.shuffle(groups)
    for g in groups:
        T = max(len(data[i][0]) for i in g)
        tokens = torch.zeros(len(g), T, dtype=torch.long)
        feats = torch.zeros(len(g), T, data[g[0]][1].shape[-1])
        top = torch.full((len(g), T, data[g[0]][2].shape[-1]), -1, dtype=torch.long)
        prob = torch.zeros(len(g), T, data[g[0]][2].shape[-1])
        for b, i in enumerate(g):
            ids, f, t, p = data[i]
            n = len(ids)
            tokens[b, :n], feats[b, :n], top[b, :n], prob[b, :n] = ids, f.float(), to_draft[t.long()], p.float()
        yield tokens, feats, top, prob


def step_loss(logits, top, prob, j):
    """Cross-entropy of step ``j``'s logits [B, T - 1, dv] against the target's top
    probabilities at the positions they predict (row t: position t + 1 + j), restricted to
    the draft vocabulary and renormalised; rows with none of those ids drop out. Also how
    often the head's argmax is the target's top-1."""
    R = logits.shape[1]
    top, prob = top[:, 1 + j:], prob[:, 1 + j:]  # [B, R - j, topk]
    logits = logits[:, : R - j]
    prob = prob * (top >= 0)
    mass = prob.sum(-1)  # [B, R - j]
    ok = mass > 0
    logp = logits.log_softmax(-1).gather(-1, top.clamp(min=0))
    loss = -((prob / mass.clamp(min=1e-9)[..., None]) * logp).sum(-1)
    hit = (logits.argmax(-1) == top[..., 0]) & (top[..., 0] >= 0)
    return loss[ok].mean(), hit[ok].float().mean()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True,
                    help=".gguf file, HF model dir or hub id (run on specdec's torch runtime)")
    ap.add_argument("--out", required=True, help="directory for the head")
    ap.add_argument("--text", nargs="*", default=[], help="Python files or directories (e.g. the stdlib's)")
    ap.add_argument("--chat", type=int, default=0, help="chat requests the target answers for the data")
    ap.add_argument("--answer-tokens", type=int, default=192, help="most tokens per answer")
    ap.add_argument("--tokens", type=int, default=200_000, help="data tokens in all (answers, then text)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--topk", type=int, default=8, help="target probabilities kept per row as labels")
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--intermediate-size", type=int, default=None, help="the head's MLP (default the target's)")
    ap.add_argument("--steps", type=int, default=3, help="training-time-test steps")
    ap.add_argument("--epochs", type=float, default=1.0)
    ap.add_argument("--batch", type=int, default=4, help="sequences per optimiser step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--data", nargs="*", default=[],
                    help="files of prefilled data: those that exist are read; the data --chat and --text build "
                         "is added and written to the first that does not (to train again without prefilling)")
    ap.add_argument("--init", default=None, help="a head this script wrote, to train further (its draft vocabulary)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from specdec import LLM
    from specdec.runtime.loading import Weights, resolve

    llm = LLM(args.target, device=args.device, dtype="float32")
    rt, tcfg = llm.target.runtime, llm.target.config.get_text_config().to_dict()
    data = []
    for f in (Path(f) for f in args.data if Path(f).is_file()):
        data += torch.load(f)
        print(f"data: {len(data)} sequences with {f}", flush=True)
    if args.chat or args.text:
        new = prefill(rt, sequences(args, llm), feature_taps_of(rt), args.topk)
        data += new
        for f in (Path(f) for f in args.data if not Path(f).is_file()):
            torch.save(new, f)
            break
    vocab = rt.vocab_size
    w = Weights(resolve(args.target))
    embed = w["model.embed_tokens.weight"].float()
    if args.init:
        head = Head.load(Path(args.init), embed)
        kept = head.kept
    else:
        kept = draft_vocabulary(data, min(args.draft_vocab, vocab), vocab)  # [dv] target ids
    to_draft = torch.full((vocab + 1,), -1, dtype=torch.long)  # index -1 (no label) stays -1
    to_draft[kept] = torch.arange(len(kept))
    lm = (w["lm_head.weight"] if "lm_head.weight" in w else w["model.embed_tokens.weight"]).float()
    cfg = {k: tcfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                                "max_position_embeddings", "bos_token_id", "eos_token_id") if k in tcfg}
    cfg["vocab_size"] = vocab
    cfg.update(intermediate_size=args.intermediate_size or tcfg["intermediate_size"],
               rope_theta=(tcfg.get("rope_parameters") or {}).get("rope_theta", tcfg.get("rope_theta", 10000.0)))
    if not args.init:
        head = Head(cfg, embed, lm[kept], w["model.norm.weight"].float())
    head = head.to(rt.device)  # trained where the target ran (its features and labels are kept on the CPU)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    total = max(1, math.ceil(len(data) / args.batch * args.epochs))
    def rate(s):  # 20 warm-up steps, then a cosine to zero
        return min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / total))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, rate)
    rng, step, t0 = random.Random(args.seed), 0, time.time()
    while step < total:
        for batch in batches(data, to_draft, args.batch, rng):
            tokens, feats, top, prob = (x.to(rt.device) for x in batch)
            out = head(tokens, feats, args.steps)
            parts = [step_loss(logits, top, prob, j) for j, logits in enumerate(out)]
            loss = sum(0.8 ** j * l for j, (l, _) in enumerate(parts))
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % 10 == 0 or step == total:
                acc = " ".join(f"{a:.2f}" for _, a in parts)
                print(f"step {step}/{total} loss {loss.item():.3f} top-1 by step {acc} "
                      f"{(time.time() - t0) / step:.2f} s/step", flush=True)
            if step >= total:
                break
    out = Path(args.out)
    head.save(out, kept)
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
