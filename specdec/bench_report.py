"""``specdec bench``'s report: its markdown tables (speeds against each baseline, per prompt and
prompt group, the time split and drafts chosen, the n-gram chain bound) and its plot."""
from __future__ import annotations

import statistics
from pathlib import Path


def median(xs):
    """The median of the values that are not None (None when none is)."""
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def prompt_group(prompt_id: str) -> str:
    """``edit-typehints`` -> ``edit``: prompts are grouped by the part before the first dash."""
    return prompt_id.split("-", 1)[0]


def write_plot(path: Path, methods, summary, results, prompts, cost_curve) -> Path | None:
    """One PNG: median tokens/s per method and prompt group; the measured forward cost curve;
    acceptance by draft position. None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    groups = sorted({prompt_group(p["id"]) for p in prompts})
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.5))
    ax = axes[0]
    width = 0.8 / max(len(methods), 1)
    for j, m in enumerate(methods):
        vals = [median(r["tokens_per_s"] for r, p in zip(results[m], prompts) if prompt_group(p["id"]) == g)
                for g in groups]
        ax.bar([i + j * width for i in range(len(groups))], [v or 0 for v in vals], width, label=m)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], groups)
    ax.set_ylabel("tokens/s (median over the group's prompts)")
    ax.set_title("speed per prompt group")
    ax.legend(fontsize=7)
    ax = axes[1]
    for name, secs in cost_curve.items():
        ax.plot(range(1, len(secs) + 1), [t / secs[0] for t in secs], marker="o", label=name)
    ax.set_xlabel("tokens in one forward")
    ax.set_ylabel("time / time of 1 token")
    ax.set_title("measured forward cost")
    ax.grid(alpha=0.3)
    if cost_curve:
        ax.legend()
    ax = axes[2]
    for m in methods:
        by_depth = summary[m].get("acceptance_by_depth")
        if by_depth:
            ax.plot(range(1, len(by_depth) + 1), [a if a is not None else float("nan") for a in by_depth],
                    marker="o", label=m)
    ax.set_xlabel("draft position (tree depth)")
    ax.set_ylabel("P(accepted | drafted that deep)")
    ax.set_ylim(0, 1.05)
    ax.set_title("acceptance by position")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # no method drafted (e.g. n-gram found no match)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# ratios a runner reports, each a count over the counter named here, so draws pool exactly


def bound_table(methods, results, prompts) -> str:
    """Per prompt: the n-gram chain bound next to what each n-gram method measured (relative
    to specdec-plain, same prompt)."""
    plain = results.get("specdec-plain")
    if not plain or "ngram_chain_bound" not in plain[0]:
        return ""
    ms = [m for m in methods if m.startswith(("specdec-ngram", "specdec-hybrid")) and "tree" not in m]
    rows = {"bound, decode": [r["ngram_chain_bound"]["decode"] for r in plain],
            "bound, end to end": [r["ngram_chain_bound"]["end_to_end"] for r in plain]}
    for m in ms:
        for key, what in (("decode_tokens_per_s", "decode"), ("tokens_per_s", "end to end")):
            rows[f"{m}, {what}"] = [ratio(results[m][i][key], plain[i][key]) for i in range(len(prompts))]
    lines = ["| prompt | " + " | ".join(rows) + " |", "|---|" + "---:|" * len(rows)]
    lines += [f"| {p['id']} | " + " | ".join(fmt(v[i]) for v in rows.values()) + " |"
              for i, p in enumerate(prompts)]
    for g in sorted({prompt_group(p["id"]) for p in prompts}):
        idx = [i for i, p in enumerate(prompts) if prompt_group(p["id"]) == g]
        lines.append(f"| **{g}-\\* (median)** | " + " | ".join(
            fmt(median(v[i] for i in idx)) for v in rows.values()) + " |")
    return ("\n\nthe most any n-gram chain policy could gain (the best schedule of draft lengths "
            "for each output, found knowing it; target forwards priced by the cost curve) and what "
            "the n-gram methods measured, relative to specdec-plain (same prompt):\n\n" + "\n".join(lines))


def fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def count(x) -> str:
    """A count as a whole number, or to one decimal where it is a mean over sampled draws."""
    if x is None:
        return "-"
    x = round(float(x), 1)  # a sum of means (47.9999...) prints as the whole number it is
    return f"{x:.0f}" if x.is_integer() else f"{x:.1f}"


def vs_key(baseline: str, how: str) -> str:
    """Summary key of the speed ratio to ``baseline``: ``vs_hf_plain_median`` ..."""
    return f"vs_{baseline.replace('-', '_')}_{how}"


def ratio(a, b):
    return a / b if a and b else None


def tables(methods, summary, results, prompts, baselines) -> str:
    vs = "".join(f" vs {b} |" for b in baselines)
    vs_decode = "".join(f" decode vs {b} |" for b in baselines)
    rows = [f"| method | tok/s (median) | tok/s (total) |{vs} decode tok/s (median) |{vs_decode} tokens "
            "| target fwd | accept rate | mean acc len | nodes/step | accept by depth | diverged from reference |",
            "|---|---:|---:|" + "---:|" * (1 + 2 * len(baselines)) + "---:|---:|---:|---:|---:|---|---|"]
    for m in methods:
        s = summary[m]
        div = ("- (sampled)" if s["reference"] is None else
               "(is the reference)" if m == s["reference"] else f"{s['diverged']} ({s['reference']})")
        if s["diverged"]:
            gaps = s.get("flip_gaps", {})
            div += ": " + ", ".join(f"{k}@{v}" + (f" (gap {gaps[k]:.1e})" if k in gaps else "")
                                    for k, v in s["diverged_first_index"].items())
        ratios = "".join(f" {fmt(s[vs_key(b, 'median')])}x |" for b in baselines)
        decode = "".join(f" {fmt(s[vs_key(b, 'median_decode')])}x |" for b in baselines)
        rows.append(f"| {m} | {fmt(s['median_tokens_per_s'])} | {fmt(s['aggregate_tokens_per_s'])} |{ratios} "
                    f"{fmt(s['median_decode_tokens_per_s'])} |{decode} {count(s['total_tokens'])} | {count(s['target_forwards'])} "
                    f"| {fmt(s.get('acceptance_rate'))} | {fmt(s.get('mean_accepted_length'))} "
                    f"| {fmt(s.get('nodes_per_verify_step'))} "
                    f"| {' '.join(fmt(a) for a in s.get('acceptance_by_depth') or []) or '-'} | {div} |")
    per = ["| prompt | tokens | " + " | ".join(methods) + " |",
           "|---|---:|" + "---:|" * len(methods)]
    for i, p in enumerate(prompts):
        ns = sorted({round(float(n), 1) for m in methods if (n := results[m][i]["generated_tokens"]) is not None})
        tokens = "-" if not ns else "-".join(count(n) for n in dict.fromkeys((ns[0], ns[-1])))  # sampled: a range
        per.append(f"| {p['id']} | {tokens} | " + " | ".join(fmt(results[m][i]["tokens_per_s"]) for m in methods) + " |")
    text = "\n".join(rows) + "\n\nper prompt, tokens/s:\n\n" + "\n".join(per)
    if baselines:  # per prompt and per group, speed relative to the main baseline
        b = baselines[-1]  # llamacpp-plain when present (the llama.cpp bench), else hf-plain
        for key, what in (("tokens_per_s", "speed"), ("decode_tokens_per_s", "decode speed (after the first token)")):
            rel = {m: [ratio(results[m][i][key], results[b][i][key])
                       for i in range(len(prompts))] for m in methods if m != b}
            ms = list(rel)
            lines = ["| prompt | " + " | ".join(ms) + " |", "|---|" + "---:|" * len(ms)]
            lines += [f"| {p['id']} | " + " | ".join(fmt(rel[m][i]) for m in ms) + " |"
                      for i, p in enumerate(prompts)]
            for g in sorted({prompt_group(p["id"]) for p in prompts}):
                idx = [i for i, p in enumerate(prompts) if prompt_group(p["id"]) == g]
                lines.append(f"| **{g}-\\* (median)** | " + " | ".join(
                    fmt(median(rel[m][i] for i in idx)) for m in ms) + " |")
            lines.append("| **lowest** | " + " | ".join(
                fmt(min((x for x in rel[m] if x is not None), default=None)) for m in ms) + " |")
            text += f"\n\nper prompt, {what} relative to {b} (same prompt):\n\n" + "\n".join(lines)
    split = ["| method | prefill s | draft s | verify s | bookkeeping s | chosen k (count for k=0,1,...) "
             "| steps per drafter |", "|---|---:|---:|---:|---:|---|---|"]
    for m in methods:
        t = summary[m].get("time_split_s")
        if t:
            k = summary[m].get("chosen_k")
            steps = summary[m].get("drafter_steps")
            split.append(f"| {m} | " + " | ".join(fmt(t[x]) for x in ("prefill", "draft", "verify", "bookkeeping"))
                         + f" | {' '.join(map(count, k)) if k else '-'} "
                         f"| {', '.join(n + ' ' + count(c) for n, c in steps.items()) if steps else '-'} |")
    return text + "\n\nspecdec time split (summed over prompts, each prompt's mean repeat) and the drafts chosen:\n\n" + "\n".join(split)
