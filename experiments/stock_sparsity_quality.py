"""Quality of training-free sparsity on the real SmolLM2-135M (a stock SwiGLU model, its Q4_1 file):
perplexity on wiki.valid and teacher-forced greedy agreement with the dense model, against the
model-wide sparsity (the share of the blocks' matrix bytes a token skips), for three rules:
  magnitude  input sparsity, TEAL's rule (|x_j| below a per-site threshold)
  weighted   input sparsity, WINA's rule (|x_j| * ||W[:, j]|| below a per-site threshold)
  threshold  our CATS-style mode (|silu(gate_i)| below a per-layer threshold skips neuron i's up
             and down rows; the gate is read whole), at the FFN sparsity whose share of the
             blocks' bytes is the target (unreachable targets are skipped: it can skip at most
             up's and down's bytes)
Thresholds are calibrated on wiki.train (input sparsity: the loss-guided allocation, one
sparsity per site kind); wiki.valid is only scored. Perplexity scores all but the first token of
each chunk (not llama-perplexity's second half). Greedy agreement: the share of positions where
the sparse model's top token equals the dense model's, on the same text (teacher-forced).

    python -m experiments.stock_sparsity_quality [--quick] [--out results/stock_sparsity_quality.jsonl]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from experiments import _common

MODEL = "smollm2-135m"
TARGETS = (0.0, 0.25, 0.4, 0.5, 0.6)
RULES = ("magnitude", "weighted", "threshold")


def _scorer(model, chunks):
    """(nll sum, top-1 tokens) of the model over the chunks, one compiled forward for any masks
    (their thresholds are state)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, _ = nnx.split(model)

    @jax.jit
    def run(state, tokens_bt):
        logits = nnx.merge(graphdef, state)(tokens_bt)[:, :-1].astype(jnp.float32)
        lp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(lp, tokens_bt[:, 1:, None], axis=-1).sum()
        return nll, jnp.argmax(logits, axis=-1)

    def score():
        state = nnx.state(model)
        total, tops = 0.0, []
        for c in chunks:
            nll, top = run(state, jnp.asarray(c[None]))
            total += float(nll)
            tops.append(np.asarray(top))
        return float(np.exp(total / (chunks.shape[0] * (chunks.shape[1] - 1)))), np.stack(tops)

    return score


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 chunks, targets 0.25 and 0.4")
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--targets", default=",".join(map(str, TARGETS)))
    ap.add_argument("--rules", default=",".join(RULES))
    ap.add_argument("--out", default=str(_common.RESULTS / "stock_sparsity_quality.jsonl"))
    args = ap.parse_args(argv)
    if args.quick:
        args.chunks, args.targets = 4, "0.0,0.25,0.4"
    targets = [float(t) for t in args.targets.split(",")]
    rules = args.rules.split(",")

    import powerinfer_jax as pij
    from powerinfer_jax import _cli
    from powerinfer_jax.sparsity import corpus as corpus_mod
    from powerinfer_jax.sparsity import input_sparsity as isp

    t0 = time.perf_counter()
    llm = pij.load(MODEL, sparsity="input_magnitude", target_sparsity=0.0, progress=False)
    model, tok = llm.model, llm.tokenizer
    valid = corpus_mod._validation_text(str(corpus_mod.SHARED_DATA / "wiki.valid.txt"))
    chunks = corpus_mod.corpus_chunks(tok.encode(valid), args.ctx, args.chunks * args.ctx)
    train = corpus_mod.read_corpus(corpus_mod.default_corpus_files())
    calib = corpus_mod.corpus_chunks(tok.encode(train), isp.DEFAULT_CTX,
                                     isp.DEFAULT_SAMPLE_TOKENS * 4)
    commit = _cli.git_commit()
    text = f"wiki.valid, {chunks.shape[0]} chunks of {args.ctx} tokens"
    rows = []

    def row(rule, target, measured, ppl, top):
        r = {"model": MODEL, "rule": rule, "target_sparsity": target,
             "measured_sparsity": round(measured, 4), "ppl": ppl, "ppl_dense": dense_ppl,
             "ppl_over_dense": ppl / dense_ppl,
             "greedy_agreement": float(np.mean(top == dense_top)), "text": text,
             "commit": commit}
        rows.append(r)
        print(r, file=sys.stderr, flush=True)

    isp.install(model, isp.zero_thresholds(model))
    score = _scorer(model, chunks)
    dense_ppl, dense_top = score()
    inputs = isp.collect_inputs(model, calib, sample_tokens=isp.DEFAULT_SAMPLE_TOKENS)
    for rule in [r for r in rules if r in isp.RULES]:
        path = None
        for target in targets:
            if target == 0.0:
                row(rule, 0.0, 0.0, dense_ppl, dense_top)
                continue
            if path is None:  # one loss-guided path per rule serves every target
                path = isp.allocation_path(model, calib, rule=rule, target=max(targets),
                                           inputs=inputs)
            arts = isp.calibrate(model, calib, rule=rule, target=target, inputs=inputs,
                                 how="loss", path=path)
            measured = arts.model_sparsity(isp.measure(model, arts, chunks[:2]))
            ppl, top = score()  # the masks `measure` left installed: same graph, no recompile
            row(rule, target, measured, ppl, top)
    if "threshold" in rules:
        _cats_rows(targets, chunks, row, tok)
    _common.append_rows(args.out, rows)
    print(f"stock_sparsity_quality: {len(rows)} rows in {time.perf_counter() - t0:.0f} s -> "
          f"{args.out}", file=sys.stderr)
    return 0


def _cats_rows(targets, chunks, row, tok) -> None:
    """The threshold mode at the FFN sparsity whose byte share is each model-wide target."""
    import powerinfer_jax as pij
    from powerinfer_jax.models.transformer import capture
    from powerinfer_jax.sparsity import input_sparsity as isp

    probe = pij.load(MODEL, sparsity="dense", progress=False)
    layer = probe.model.layers[0]
    sizes = {s: sum(isp.matrix_bytes(m) for m in mats)
             for s, mats in isp.site_matrices(layer).items()}
    skippable = (isp.matrix_bytes(layer.ffn.up) + isp.matrix_bytes(layer.ffn.down_t)) / sum(
        sizes.values())
    for target in targets:
        if target == 0.0:
            continue
        ffn_target = target / skippable
        if ffn_target >= 0.95:
            print(f"threshold mode: model-wide {target} needs FFN sparsity {ffn_target:.2f}: "
                  "beyond what skipping up and down rows can reach; skipped", file=sys.stderr)
            continue
        llm = pij.load(MODEL, sparsity="threshold", target_sparsity=round(ffn_target, 3),
                       progress=False)
        score = _scorer(llm.model, chunks)
        ppl, top = score()
        import jax.numpy as jnp

        _, sown = capture(lambda m: m(jnp.asarray(chunks[:2])), llm.model)
        active = float(np.asarray(sown["n_active"]).mean()) / llm.config.d_ff
        row("threshold", target, (1.0 - active) * skippable, ppl, top)


if __name__ == "__main__":
    sys.exit(main())
