"""PNG figures from the experiments' JSONL files (the latest run of each), one message per figure.

  python -m experiments.plots [--results results]

Writes <results>/<experiment>.png for power_law, ablation, peers, cost_breakdown and
prompt_length; quality_vs_sparsity's figure is experiments.plot_quality_vs_sparsity's.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from experiments import _common
from experiments.report import ABLATION_STEPS, _ok, load


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _subtitle(rows) -> str:
    r = rows[0]
    m = r.get("machine") or {}
    q = ", quick settings" if r.get("quick") else ""
    return f"{r['model']}, {m.get('cpu', '?')}, commit {r.get('commit')}{q}"


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _plt().close(fig)
    return path


def plot_power_law(rows, path: Path):
    """Message: how concentrated activity is (sorted frequency per layer)."""
    rows = _ok(rows)
    target = min({r["config"]["target_sparsity"] for r in rows})
    rows = [r for r in rows if r["config"]["target_sparsity"] == target]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    cmap = plt.get_cmap("viridis")
    n = max(r["layer"] for r in rows) + 1
    for r in rows:
        ax.plot(np.asarray(r["curve_rank_fraction"]) * 100, r["curve_frequency"],
                color=cmap(r["layer"] / max(n - 1, 1)), lw=0.9)
    fig.colorbar(plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(0, n - 1)), ax=ax,
                 label="layer")
    med = float(np.median([r["neurons_for_80pct"] for r in rows]))
    ax.axvline(med * 100, color="k", ls="--", lw=1,
               label=f"median: {med:.0%} of neurons cover 80% of activations")
    ax.set_xlabel("neuron rank (% of FFN neurons, most frequent first)")
    ax.set_ylabel("activation frequency (fraction of tokens)")
    ax.set_ylim(0, 1)
    ax.set_title(f"Sorted activation frequency per layer (target sparsity {target:.2f})\n"
                 + _subtitle(rows), fontsize=9)
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_ablation(rows, path: Path):
    """Message: decode tokens/s gained (or lost) by each step, per dtype and threads."""
    rows = _ok(rows)
    configs = sorted({(r["threads"], r["dtype"]) for r in rows})
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / max(len(configs), 1)
    x = np.arange(len(ABLATION_STEPS))
    for i, (t, dt) in enumerate(configs):
        v = {r["config"]["step"]: r["decode_tok_s"] for r in rows
             if r["threads"] == t and r["dtype"] == dt}
        ax.bar(x + i * width, [v.get(s, 0.0) for s in ABLATION_STEPS], width,
               label=f"{dt}, {t} thread{'s' if t > 1 else ''}")
    ax.set_xticks(x + width * (len(configs) - 1) / 2)
    ax.set_xticklabels(ABLATION_STEPS)
    ax.set_ylabel("decode tokens/s")
    ax.set_title("Ablation: decode speed per added component (missing bar: not run)\n"
                 + _subtitle(rows), fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def plot_peers(rows, path: Path):
    """Message: our decode speed next to llama.cpp and HF at each precision and thread count."""
    rows = [r for r in _ok(rows) if "decode_tok_s" in r]  # not the head-to-head summary rows
    labels = sorted({(r["system"], r["weights"], r.get("sparsity", "dense")) for r in rows})
    threads = sorted({r["threads"] for r in rows})
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(labels) * len(threads) + 1.5))
    y, ticks = 0, []
    colors = {"powerinfer_jax": "tab:blue", "llama.cpp": "tab:orange",
              "hf_transformers": "tab:green"}
    for t in threads:
        for system, weights, sp in labels:
            v = [r["decode_tok_s"] for r in rows if r["threads"] == t and r["system"] == system
                 and r["weights"] == weights and r.get("sparsity", "dense") == sp]
            if v:
                ax.barh(y, v[0], color=colors.get(system, "gray"))
                ax.text(v[0], y, f" {v[0]:.1f}", va="center", fontsize=7)
                ticks.append((y, f"{system} {weights} {sp if sp != 'dense' else ''} ({t}t)"))
                y += 1
        y += 0.5
    ax.set_yticks([a for a, _ in ticks])
    ax.set_yticklabels([b for _, b in ticks], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("decode tokens/s (greedy, same prompt ids)")
    ax.set_title("Decode speed vs peers on the same machine and model file\n" + _subtitle(rows),
                 fontsize=9)
    ax.grid(alpha=0.3, axis="x")
    return _save(fig, path)


COST_PARTS = (("attention_ms", "attention"), ("predictor_ms", "predictor"),
              ("ffn_hot_ms", "FFN hot"), ("ffn_cold_ms", "FFN cold"),
              ("lm_head_ms", "lm_head"), ("overhead_ms", "other (step - parts)"))


def plot_cost_breakdown(rows, path: Path):
    """Message: where a decode token's time goes, per config (stacked ms)."""
    rows = sorted(_ok(rows), key=lambda r: (r["threads"], r["dtype"], r["sparsity"]))
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9.5, 4.5))
    x = np.arange(len(rows))
    bottom = np.zeros(len(rows))
    for key, label in COST_PARTS:
        v = np.maximum([r[key] for r in rows], 0.0)  # negative overhead: parts overlap
        ax.bar(x, v, bottom=bottom, label=label)
        bottom += v
    ax.plot(x, [r["step_ms"] for r in rows], "k_", ms=30, mew=2, label="whole step (measured)")
    ax.set_xticks(x)
    ax.set_xticklabels([f"{r['dtype']}\n{r['sparsity']}\n{r['threads']}t" for r in rows],
                       fontsize=8)
    ax.set_ylabel("ms per decode token")
    ax.set_title("Decode time per component (jitted separately at decode shapes)\n"
                 + _subtitle(rows), fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def plot_prompt_length(rows, path: Path):
    """Message: how sparse vs dense prefill and decode speed change with prompt length."""
    rows = _ok(rows)
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, what in ((axes[0], "prefill_tok_s", "prefill"),
                          (axes[1], "decode_tok_s", "decode")):
        for (t, mode) in sorted({(r["threads"], r["sparsity"]) for r in rows}):
            pts = sorted((r["prompt_tokens"], r[key]) for r in rows
                         if r["threads"] == t and r["sparsity"] == mode)
            ax.plot(*zip(*pts), marker="o", label=f"{mode}, {t} thread{'s' if t > 1 else ''}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel(f"{what} tokens/s")
        ax.set_title(f"{what} speed vs prompt length", fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle(f"{rows[0]['dtype']}: " + _subtitle(rows), fontsize=9)
    return _save(fig, path)


PLOTS = {"power_law": plot_power_law, "ablation": plot_ablation, "peers": plot_peers,
         "cost_breakdown": plot_cost_breakdown, "prompt_length": plot_prompt_length}


def make_all(results: Path) -> list[Path]:
    """Every figure whose experiment has ok rows; a failing plot is reported, not raised."""
    out = []
    for name, fn in PLOTS.items():
        rows = load(results, name)
        if not _ok(rows):
            continue
        try:
            out.append(fn(rows, Path(results) / f"{name}.png"))
        except Exception as e:  # one bad figure must not cost the report
            print(f"plots: {name}: {type(e).__name__}: {e}")
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=str(_common.RESULTS))
    args = p.parse_args(argv)
    for path in make_all(Path(args.results)):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
