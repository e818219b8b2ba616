"""Plot results/quality_vs_sparsity.jsonl: perplexity vs measured FFN sparsity per mode, and print
a markdown table. `python -m experiments.plot_quality_vs_sparsity [--jsonl F] [--out PNG]`."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--jsonl", default=str(REPO / "results" / "quality_vs_sparsity.jsonl"))
    p.add_argument("--out", default=str(REPO / "results" / "quality_vs_sparsity.png"))
    args = p.parse_args()
    from experiments._common import mode_label

    rows = [json.loads(line) for line in open(args.jsonl) if line.strip()]
    dense = [r for r in rows if r["mode"] == "dense"][-1]
    latest = {}
    for r in rows:  # the last row of each (mode, target) wins
        latest[(mode_label(r), r["target_sparsity"])] = r
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, marker in (("oracle", "o"), ("threshold", "s"), ("predictor (lowrank)", "^"),
                         ("predictor (q4)", "D")):
        pts = sorted((r["ffn_sparsity"], r["ppl"]) for (m, _), r in latest.items() if m == mode)
        if pts:
            ax.plot(*zip(*pts), marker=marker, label=mode)
    ax.axhline(dense["ppl"], color="k", ls="--", lw=1, label=f"dense ({dense['ppl']:.2f})")
    ax.axhline(dense["ppl"] * 1.08, color="gray", ls=":", lw=1, label="1.08x dense")
    ax.set_yscale("log")
    ax.set_xlabel("measured FFN sparsity (fraction of neurons skipped)")
    ax.set_ylabel(f"perplexity, {dense['eval_text']} (ctx {dense['ctx']}, "
                  f"{dense['eval_chunks']} chunks)")
    ax.set_title(f"{dense['model']}: quality vs FFN sparsity")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}\n")
    print("| target | mode | FFN sparsity | ppl | x dense | predictor recall (eval) | held-out recall/precision |")
    print("|---|---|---|---|---|---|---|")
    for (mode, target), r in sorted(latest.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        rec = f"{r['predictor_recall']:.3f}" if "predictor_recall" in r else ""
        held = (f"{r['heldout_recall']:.3f} / {r['heldout_precision']:.3f}"
                if "heldout_recall" in r else "")
        print(f"| {target:.2f} | {mode} | {r['ffn_sparsity']:.3f} | {r['ppl']:.3f} | "
              f"{r['ppl'] / dense['ppl']:.3f} | {rec} | {held} |")


if __name__ == "__main__":
    main()
