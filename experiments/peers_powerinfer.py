"""PowerInfer as a peer: its `main` (SJTU-IPADS/PowerInfer, CPU build) and ours on the same
exported model, same prompt ids, same threads: do the greedy tokens agree, and how fast is each?

Model: SmolLM2-135M with its FFN activation switched to ReLU (ReGLU: relu(gate) * up), the form
PowerInfer's sparse llama graph runs. The switch alone makes it generate nonsense (perplexity in
the thousands, where any rounding moves it by percents): fine for agreement and speed. For
perplexity, pass --model DIR, a ReLU model made by `python -m powerinfer_jax.sparsify --variant
relu` (distilled from SmolLM2; its teacher's GGUF tokenizer is exported with it). Two PowerInfer
GGUFs ("PWRI", F16 weights as its converter writes them) are exported once into the build root:
  dense      all-active predictors (zero fc1/fc2: every output 0 >= threshold 0), so PowerInfer
             runs every neuron through its sparse kernels: the predictor-free path; ours runs
             dense (SparsityConfig mode "dense").
  predictor  bias-free predictors (PowerInfer's fc1 -> ReLU -> fc2) trained here on the ReLU
             model's FFN inputs from --train-text (sparsity/powerinfer_predictor.py), exported on
             the residual; ours runs them in predictor mode (PowerInferPredictor).
Per round and thread count: PowerInfer dense and predictor (one process each, pinned to the same
CPUs, `-t T -tb T --temp 0 --repeat-penalty 1 --ignore-eos`, timings from its own report), then
ours (a child process pinned to the same CPUs: float32 and bfloat16; dense, predictor and exact,
our ReLU sparsity without a predictor: OURS_ONLY; median of 2 timed generations after a compile
run). Rows go to --out; a summary row per (mode, dtype,
threads) gives the median of per-round ratios ours / PowerInfer (this VM drifts 20-30% within
minutes; only ratios from one round are compared).
Agreement (float32 only, the precision closest to PowerInfer's F16 weights): the common prefix of
the two greedy sequences, and teacher-forced agreement: our argmax at each position of
PowerInfer's own sequence vs its next token (one divergence then does not count for every later
token). PowerInfer computes with F16 activations, we with float32: near-ties may flip.

--weights Q4_0: both files are quantized by PowerInfer's own `quantize` (its Q4_0, predictors
included, lm_head Q8_0), PowerInfer runs them, and ours keeps their blocks (dense matrices as
qlinear, FFN rows and predictors as the file stores them). --ppl-chunks N: perplexity of each
mode by llama.cpp's protocol (PowerInfer's `perplexity`: N chunks of 512 tokens of
--ppl-text, the second half of each scored), ours by the same protocol on the same file.

  python -m experiments.peers_powerinfer --powerinfer-src PATH_TO_POWERINFER_GIT [--threads 1 2]
      [--rounds 3] [--prompt-tokens 64] [--new-tokens 64] [--weights F16|Q4_0]
      [--ppl-chunks 16] [--ppl-repeats 3] [--model DIR] [--quick]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from experiments import _common

BUILD_SCRIPT = Path(__file__).with_name("peers_powerinfer_build.sh")
OUT = _common.RESULTS / "peers_powerinfer.jsonl"
MODES = ("dense", "predictor")
# Ours only: "exact" runs the dense file with the true active set (selectors.Oracle at 0: a
# ReLU neuron whose activation is 0 is skipped; its gate/up computed, its down row not read),
# no predictor and no approximation; compared with PowerInfer's sparse (predictor) mode.
OURS_ONLY = {"exact": ("dense", "predictor")}  # mode -> (file it runs, PowerInfer mode compared)
PPL_CTX = 512
DTYPES = ("float32", "bfloat16")


def file_mode(mode: str) -> str:
    """Which export (MODES) a mode of ours runs."""
    return OURS_ONLY[mode][0] if mode in OURS_ONLY else mode


def peer_mode(mode: str) -> str:
    """The PowerInfer mode a mode of ours is compared with."""
    return OURS_ONLY[mode][1] if mode in OURS_ONLY else mode


def build(src: str, root: Path) -> tuple[Path, str]:
    """Build PowerInfer's `main` (cached per commit); returns (binary, commit)."""
    out = subprocess.run(["bash", str(BUILD_SCRIPT), src, str(root)], capture_output=True,
                         text=True)
    if out.returncode != 0:
        raise RuntimeError(f"PowerInfer build: expected exit status 0, got {out.returncode}:\n"
                           f"{out.stderr[-3000:]}")
    binary = Path(out.stdout.strip().splitlines()[-1])
    return binary, (binary.parents[2] / "COMMIT").read_text().strip()


# ------------------------------------------------------------------------------------- exports
def exports(root: Path, model: str, train_text: Path, *, rank: int, train_tokens: int,
            steps: int, weights: str = "F16", quantize: Path | None = None,
            source_config=None) -> dict[str, Path]:
    """The two PowerInfer GGUFs (module docstring), written once into root/exports; with weights
    other than F16, quantized from those by PowerInfer's `quantize` binary. source_config: the
    model's ModelConfig when the caller has it (else read here)."""
    from powerinfer_jax.checkpoint import load_checkpoint
    from powerinfer_jax.checkpoint import powerinfer as pi
    from powerinfer_jax.checkpoint.registry import resolve_model
    from experiments.peers import tokenizer_meta

    d = root / "exports"
    d.mkdir(parents=True, exist_ok=True)
    tag = f"r{rank}-n{train_tokens}-s{steps}"
    src = Path(resolve_model(model))
    if source_config is None:
        source_config = load_checkpoint(src, keep_quantized=True).config
    stem = export_stem(model, src, source_config)
    files = {"dense": d / f"{stem}.dense-r32.powerinfer.gguf",
             "predictor": d / f"{stem}.pred-{tag}.powerinfer.gguf"}
    if not files["dense"].is_file():
        ck = load_checkpoint(src)
        meta = gguf_tokenizer_meta(src, ck.tokenizer)
        cfg = ck.config.replace(activation="relu")
        _log(f"writing {files['dense']}")
        tmp = files["dense"].with_suffix(".tmp")
        pi.write_powerinfer_gguf(tmp, cfg, ck.params, meta, pi.all_active_predictors(cfg))
        tmp.replace(files["dense"])
    if not files["predictor"].is_file():
        ck = load_checkpoint(files["dense"])  # the F16 weights PowerInfer reads
        preds, report = train_predictors(ck, train_text, rank=rank, n_tokens=train_tokens,
                                         steps=steps)
        (d / f"predictor-{tag}.json").write_text(json.dumps(report))
        _log(f"writing {files['predictor']}")
        tmp = files["predictor"].with_suffix(".tmp")
        pi.write_powerinfer_gguf(tmp, ck.config, ck.params, tokenizer_meta(files["dense"]),
                                 preds)
        tmp.replace(files["predictor"])
    if weights == "F16":
        return files
    out = {}
    for mode, f16 in files.items():
        out[mode] = f16.with_name(f16.name.replace(".powerinfer.gguf",
                                                   f".{weights.lower()}.powerinfer.gguf"))
        if not out[mode].is_file():
            _log(f"quantizing {f16.name} to {weights} with PowerInfer's quantize")
            tmp = out[mode].with_suffix(".tmp")
            proc = subprocess.run([str(quantize), str(f16), str(tmp), weights],
                                  capture_output=True, text=True, errors="replace")
            if proc.returncode != 0:
                raise RuntimeError(f"PowerInfer quantize {f16.name}: expected exit status 0, got "
                                   f"{proc.returncode}:\n{proc.stderr[-2000:]}")
            load_checkpoint(tmp, keep_quantized=True)  # our reader accepts it (or says why not)
            tmp.replace(out[mode])
    return out


def export_stem(model: str, src: Path, config) -> str:
    """The exports' file stem: "smollm2-relu" for the default model (SmolLM2 with its FFN switched
    to ReLU), else the model's name and a hash of its files (model_fingerprint), so exports of
    two models (or of a model retrained in place) never share a file."""
    from powerinfer_jax._cli import DEFAULT_MODEL
    from powerinfer_jax.sparsity.artifacts import model_fingerprint

    if model == DEFAULT_MODEL:
        return "smollm2-relu"
    ident = model_fingerprint(model, src, config)["id"]
    return f"{src.name.split('.')[0]}-{hashlib.sha256(ident.encode()).hexdigest()[:10]}"


def gguf_tokenizer_meta(src: Path, tokenizer) -> dict:
    """GGUF tokenizer metadata for an export of `src`: a GGUF's own; for a directory made by
    `python -m powerinfer_jax.sparsify` (which keeps its teacher's tokenizer), its teacher's GGUF,
    checked to give the directory's own token ids on sample text."""
    from powerinfer_jax.checkpoint import load_checkpoint, resolve_model
    from powerinfer_jax.checkpoint.registry import KNOWN_MODELS
    from experiments.peers import tokenizer_meta

    if src.is_file():
        return tokenizer_meta(src)
    record = src / "sparsify.json"
    ident = (json.loads(record.read_text()).get("fingerprint", {}).get("id", "")
             if record.is_file() else "")
    teacher = ident.split(":")[1] if ident.startswith("registry:") else None
    if teacher not in KNOWN_MODELS:
        raise SystemExit(f"--model {src}: expected a GGUF file or a sparsified directory whose "
                         f"sparsify.json names a registry teacher (its GGUF tokenizer is "
                         f"exported), got teacher {ident or 'none'!r}")
    gguf = Path(resolve_model(teacher))
    theirs = load_checkpoint(gguf, keep_quantized=True).tokenizer
    sample = (_common.DATA / "wiki.train.txt").read_text(encoding="utf-8")[:20_000]
    if theirs.encode(sample) != tokenizer.encode(sample):
        raise SystemExit(f"--model {src}: its tokenizer and its teacher's ({gguf.name}) give "
                         f"different ids on wiki.train.txt: cannot export the teacher's")
    return tokenizer_meta(gguf)


def train_predictors(ck, train_text: Path, *, rank: int, n_tokens: int, steps: int):
    """Bias-free predictors for the ReLU model: FFN inputs of its dense forward over the train
    text, masks relu(gate . x) > 0 (ReGLU's active neurons; a FATReLU model's: gate . x above
    its layer's threshold), exported on the residual."""
    import jax.numpy as jnp

    from powerinfer_jax.models.transformer import from_params
    from powerinfer_jax.sparsity import powerinfer_predictor as pp
    from powerinfer_jax.sparsity.profile import collect_ffn_inputs

    model = from_params(ck.config, ck.params, kernels="xla")
    ids = ck.tokenizer.encode(train_text.read_text(encoding="utf-8")[:200_000], add_bos=False)
    chunk = 256
    n = min(n_tokens, len(ids)) // chunk * chunk
    x = collect_ffn_inputs(model, np.asarray(ids[:n], np.int32).reshape(-1, chunk))  # [L, N, D]
    mask = np.stack([np.asarray(jnp.einsum("nd,fd->nf", x[l], layer.ffn.gate.weight[...]))
                     > layer.ffn.gate_floor for l, layer in enumerate(model.layers)])
    _log(f"training PowerInfer-shape predictors: L={x.shape[0]} N={n} R={rank} steps={steps}")
    stack, report = pp.train(x, mask, rank=rank, steps=steps, progress=True)
    _log(f"predictors: recall {report['mean_recall']:.3f} precision "
         f"{report['mean_precision']:.3f} predicted sparsity {report['mean_predicted_sparsity']:.3f}")
    return pp.to_powerinfer(stack, ck.config, ck.params), report


# ---------------------------------------------------------------------------------- PowerInfer
_TIMING = re.compile(r"(prompt eval|\beval) time =\s*([\d.]+) ms /\s*(\d+) (tokens|runs)")
_IDS = re.compile(r"':(\d+)(?=, '| \]$)")  # common/log.h: [ 'piece':id, ... ] (non-printables cut)


def run_powerinfer(binary: Path, model: Path, prompt: str, *, threads: int,
                   new_tokens: int) -> dict:
    """One `main` run pinned to the first `threads` CPUs: its prompt ids, the greedy ids it
    generated (from its log's eval lines) and its own prefill/decode timings."""
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    with tempfile.TemporaryDirectory() as wd:
        (Path(wd) / "prompt.txt").write_text(prompt, encoding="utf-8")
        # taskset pins it like our child (sched_setaffinity); no preexec_fn in a JAX process
        cmd = ["taskset", "-c", ",".join(map(str, cpus)), str(binary), "-m", str(model),
               "-f", "prompt.txt", "-n", str(new_tokens + 1),
               "-t", str(threads), "-tb", str(threads), "--temp", "0", "--repeat-penalty", "1.0",
               "--ignore-eos", "-c", "512", "-b", "512", "--seed", "0"]
        proc = subprocess.run(cmd, cwd=wd, capture_output=True, text=True, errors="replace",
                              timeout=1200)
        if proc.returncode != 0:
            raise RuntimeError(f"PowerInfer main: expected exit status 0, got {proc.returncode}:"
                               f"\n{proc.stderr[-2000:]}")
        log = (Path(wd) / "main.log").read_text(encoding="utf-8", errors="replace").splitlines()
    prompt_ids = [int(i) for i in _IDS.findall(next(l for l in log if "] tokens: [" in l))]
    evals = [l for l in log if "] eval: [" in l]
    gen = [int(i) for l in evals[1:] for i in _IDS.findall(l)]  # evals[0]: the prompt
    t = {m.group(1): (float(m.group(2)), int(m.group(3))) for m in _TIMING.finditer(proc.stderr)}
    (pf_ms, pf_n), (dec_ms, dec_n) = t["prompt eval"], t["eval"]
    return {"prompt_ids": prompt_ids, "tokens": gen[:new_tokens],
            "prefill_tok_s": 1e3 * pf_n / pf_ms, "decode_tok_s": 1e3 * dec_n / dec_ms,
            "prompt_tokens": pf_n, "decode_runs": dec_n}


_PPL = re.compile(r"Final estimate: PPL = ([\d.]+)")


def ppl_powerinfer(binary: Path, model: Path, text: Path, *, ctx: int, chunks: int,
                   threads: int) -> float:
    """PowerInfer's `perplexity` on the file (llama.cpp's protocol: `ppl_ours`)."""
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    cmd = ["taskset", "-c", ",".join(map(str, cpus)), str(binary.with_name("perplexity")),
           "-m", str(model), "-f", str(text), "-c", str(ctx), "-b", str(ctx), "--chunks",
           str(chunks), "-t", str(threads), "-tb", str(threads)]
    with tempfile.TemporaryDirectory() as wd:  # it writes llama.log into its directory
        proc = subprocess.run(cmd, cwd=wd, capture_output=True, text=True, errors="replace",
                              timeout=3600)
    m = _PPL.search(proc.stdout)
    if proc.returncode != 0 or m is None:
        raise RuntimeError(f"PowerInfer perplexity: expected exit status 0 and a final estimate, "
                           f"got {proc.returncode}:\n{proc.stderr[-2000:]}")
    return float(m.group(1))


def ppl_ours(model, ids: list[int], *, ctx: int, chunks: int) -> float:
    """llama.cpp's perplexity protocol (examples/perplexity at PowerInfer's commit): the text's
    tokens (no BOS for a BPE vocabulary) in consecutive ctx-token chunks, each run alone; the
    second half of each chunk scored, position j predicting token j + 1 for j in [ctx/2, ctx-1)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, state = nnx.split(model)

    @jax.jit
    def nll(state, tokens):
        logits = nnx.merge(graphdef, state)(tokens)[0, ctx // 2:-1]
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.take_along_axis(logp, tokens[0, ctx // 2 + 1:, None], axis=-1).sum()

    n = min(chunks, len(ids) // ctx)
    total = sum(float(nll(state, jnp.asarray([ids[i * ctx:(i + 1) * ctx]], jnp.int32)))
                for i in range(n))
    return float(np.exp(total / (n * (ctx - ctx // 2 - 1))))


# --------------------------------------------------------------------------------------- ours
def child(args) -> None:
    """One thread count, one round: our engines on both files (rows on stdout)."""
    from powerinfer_jax import _cli

    threads = _cli.configure_threads(args.child_threads)
    import jax.numpy as jnp

    from powerinfer_jax import ops
    from powerinfer_jax.checkpoint import load_checkpoint
    from powerinfer_jax.checkpoint import powerinfer as pi
    from powerinfer_jax.config import SparsityConfig
    from powerinfer_jax.models.qweights import DENSE_LAYOUT, SELECTED_LAYOUT
    from powerinfer_jax.models.transformer import from_params
    from powerinfer_jax.runtime.decode import Engine
    from powerinfer_jax.sparsity import modes
    from powerinfer_jax.sparsity import powerinfer_predictor as pp

    ops.set_num_threads(threads)
    spec = json.loads(Path(args.child_spec).read_text())
    ids, n_new = spec["prompt_ids"], spec["new_tokens"]
    quantized = spec["weights"] != "F16"
    ppl_ids = spec.get("ppl_ids")
    for mode in MODES + tuple(OURS_ONLY):
        path = Path(spec["files"][file_mode(mode)])
        ck = load_checkpoint(path, keep_quantized=quantized)
        # each mode's layouts, decided before the weights are read
        layout = {"predictor": SELECTED_LAYOUT,
                  "exact": modes.ffn_layout(SparsityConfig(mode="oracle"), ck.config)
                  }.get(mode, DENSE_LAYOUT)
        for dtype in DTYPES:
            model = from_params(ck.config, ck.params, dtype=jnp.dtype(dtype), kernels="auto",
                                ffn_layout=layout)
            if mode == "predictor":  # dense: no selector
                pp.attach(model, pi.load_predictors(path, ck.config, keep_quantized=True))
            elif mode == "exact":  # the oracle at 0
                modes.configure(model, SparsityConfig(mode="oracle"))
            eng = Engine(model, max_seq_len=512)
            eng.generate(ids, max_new_tokens=n_new)  # compiles every bucket
            runs = [eng.generate(ids, max_new_tokens=n_new) for _ in range(2)]
            row = {"system": "powerinfer_jax", "mode": mode, "dtype": dtype,
                   "prefill_tok_s": statistics.median(r.prefill_tok_s for r in runs),
                   "decode_tok_s": statistics.median(r.decode_tok_s for r in runs),
                   "tokens": runs[0].tokens, "compiles": eng.compile_count}
            if ppl_ids:
                row["ppl"] = ppl_ours(model, ppl_ids, ctx=spec["ppl_ctx"],
                                      chunks=spec["ppl_chunks"])
            theirs = spec["powerinfer_tokens"].get(mode)
            if dtype == "float32" and theirs:
                row.update(agreement(model, ids, theirs, runs[0].tokens))
                if mode == "predictor" and not quantized:  # how much F16 rounding of the
                    # predictor inputs explains (a question about F16 files)
                    base = teacher_forced(model, ids, theirs)
                    pp.attach(model, pi.load_predictors(path, ck.config), f16_inputs=True)
                    f16 = teacher_forced(model, ids, theirs)
                    row.update(agree_teacher_forced_f16_predictor=float(np.mean(f16 == theirs)),
                               ours_f32_vs_f16_predictor=float(np.mean(f16 == base)))
            _common.emit({**row, "threads": threads})


def teacher_forced(model, ids, theirs) -> np.ndarray:
    """Our argmax after each prefix of prompt + PowerInfer's tokens (one forward pass, with the
    model's selectors)."""
    import jax.numpy as jnp

    seq = np.asarray([ids + theirs], np.int32)
    return np.argmax(np.asarray(model(jnp.asarray(seq))), -1)[0, len(ids) - 1:-1]


def agreement(model, ids, theirs, ours) -> dict:
    """Common greedy prefix, and our teacher-forced argmax on PowerInfer's sequence."""
    pred = teacher_forced(model, ids, theirs)
    prefix = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b),
                  min(len(theirs), len(ours)))
    return {"agree_prefix": int(prefix), "agree_teacher_forced": float(np.mean(pred == theirs)),
            "compared_tokens": len(theirs)}


# --------------------------------------------------------------------- other families (--families)
FAMILIES = ("bamboo", "falcon-7b", "falcon-40b", "opt")


def family_config(kind: str, vocab: int):
    """A small random model of each family PowerInfer runs (F = 1024: above the 1000 neurons
    below which its kernels switch to their `_head` variants)."""
    from powerinfer_jax.config import ModelConfig

    base = ModelConfig(arch="llama", vocab_size=vocab, d_model=128, n_layers=2, n_heads=4,
                       n_kv_heads=2, head_dim=32, d_ff=1024, max_seq_len=256, activation="drelu",
                       norm_eps=1e-5, rope_theta=10000.0, tie_embeddings=False)
    if kind == "bamboo":
        return base
    if kind.startswith("falcon"):
        return base.replace(arch="falcon", gated=False, norm="layer", activation="relu",
                            parallel_block=True, n_kv_heads=1 if kind == "falcon-7b" else 2)
    return base.replace(arch="opt", gated=False, bias=True, norm="layer", positions="learned",
                        position_offset=2, activation="relu", n_kv_heads=4, max_seq_len=2048,
                        tie_embeddings=True)


def families(binary: Path, root: Path, model: str, prompt_ids: list[int], *,
             new_tokens: int) -> list[dict]:
    """Each family as a PowerInfer GGUF with all-active predictors: does `main` load it, and do its
    greedy tokens agree with ours (float32, teacher-forced)? Random weights (seeded)."""
    import jax.numpy as jnp

    from powerinfer_jax.checkpoint import load_checkpoint
    from powerinfer_jax.checkpoint import powerinfer as pi
    from powerinfer_jax.checkpoint.base import expected_shapes
    from powerinfer_jax.checkpoint.registry import resolve_model
    from powerinfer_jax.models.transformer import from_params
    from experiments.peers import tokenizer_meta

    src = Path(resolve_model(model))
    meta = tokenizer_meta(src)
    tok = load_checkpoint(src).tokenizer
    out = []
    for kind in FAMILIES:
        cfg = family_config(kind, len(meta["tokens"]))
        rng = np.random.default_rng(0)
        params = {n: (1.0 + 0.1 * rng.standard_normal(s) if n.endswith(".scale") else
                      rng.standard_normal(s) * (0.02 if n in ("tok_embed", "pos_embed") else
                                                (1.5 / np.sqrt(s[-1]) if len(s) == 2 else 0.1)))
                  .astype(np.float32) for n, s in expected_shapes(cfg).items()}
        path = root / "exports" / f"tiny-{kind}.powerinfer.gguf"
        pi.write_powerinfer_gguf(path, cfg, params, meta, pi.all_active_predictors(cfg))
        row = {"system": "families", "family": kind, "model_config": repr(cfg)}
        try:
            r = run_powerinfer(binary, path, tok.decode(prompt_ids), threads=1,
                               new_tokens=new_tokens)
        except (RuntimeError, StopIteration, KeyError) as e:
            out.append({**row, "loads": False, "error": str(e)[-500:]})
            _log(f"family {kind}: PowerInfer failed: {str(e)[-300:]}")
            continue
        ck = load_checkpoint(path)
        m = from_params(ck.config, ck.params)
        seq = np.asarray([r["prompt_ids"] + r["tokens"]], np.int32)
        logits = np.asarray(m(jnp.asarray(seq)))
        pred = np.argmax(logits, -1)[0, len(r["prompt_ids"]) - 1:-1]
        row.update(loads=True, tokens=r["tokens"], agree_teacher_forced=float(np.mean(
            pred == r["tokens"])), compared_tokens=len(r["tokens"]))
        if kind == "opt":  # PowerInfer's OPT never reads the file's LayerNorm epsilon: it runs 0
            m0 = from_params(ck.config.replace(norm_eps=1e-30), ck.params)
            p0 = np.argmax(np.asarray(m0(jnp.asarray(seq))), -1)[0, len(r["prompt_ids"]) - 1:-1]
            row["agree_teacher_forced_norm_eps0"] = float(np.mean(p0 == r["tokens"]))
        _log(f"family {kind}: PowerInfer loads it; teacher-forced agreement "
             f"{row['agree_teacher_forced']:.3f} over {len(r['tokens'])} tokens")
        out.append(row)
    return out


# --------------------------------------------------------------------------------------- main
def _load() -> list[float]:
    """The machine's 1/5/15-minute load averages: other users' work shares these 2 cores."""
    return [round(x, 2) for x in os.getloadavg()]


def _log(msg: str) -> None:
    print(f"[peers_powerinfer] {msg}", file=sys.stderr, flush=True)


def _prompt_text(path: Path, n_tokens: int, tokenizer) -> str:
    text = path.read_text(encoding="utf-8")
    ids = tokenizer.encode(" ".join(text.split()[:4 * n_tokens]), add_bos=False)[:n_tokens]
    return tokenizer.decode(ids)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _common.add_common_args(p, threads_default=None)
    p.add_argument("--powerinfer-src", default=os.environ.get("POWERINFER_SRC"),
                   help="a SJTU-IPADS/PowerInfer git directory (clone or mirror); its HEAD is "
                        "built (default: $POWERINFER_SRC)")
    p.add_argument("--build-root", type=Path, default=None,
                   help="builds and exports (default: the model cache's peers/ directory)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-text", type=Path, default=_common.DATA / "wiki.valid.txt")
    p.add_argument("--train-text", type=Path, default=_common.DATA / "wiki.train.txt")
    p.add_argument("--rank", type=int, default=128)
    p.add_argument("--train-tokens", type=int, default=8192)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--families", action=argparse.BooleanOptionalAction, default=False,
                   help="also run small random bamboo/falcon/opt models through PowerInfer")
    p.add_argument("--speed", action=argparse.BooleanOptionalAction, default=True,
                   help="the SmolLM2 agreement and timing rounds")
    p.add_argument("--weights", choices=("F16", "Q4_0"), default="F16",
                   help="the files' weights: F16 as our export writes them, or Q4_0 by "
                        "PowerInfer's quantize (module docstring)")
    p.add_argument("--ppl-chunks", type=int, default=0,
                   help="perplexity of each mode on both sides over this many 512-token chunks "
                        "of --ppl-text (round 0; 0: none)")
    p.add_argument("--ppl-repeats", type=int, default=1,
                   help="PowerInfer perplexity runs per mode (its figure varies run to run; "
                        "the median is compared)")
    p.add_argument("--ppl-text", type=Path, default=_common.DATA / "wiki.valid.txt")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--child-spec", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_threads is not None:
        return child(args)
    if args.ppl_chunks < 0 or args.ppl_repeats < 1:
        raise SystemExit(f"--ppl-chunks / --ppl-repeats: expected >= 0 / >= 1, got "
                         f"{args.ppl_chunks} / {args.ppl_repeats}")
    if not args.powerinfer_src:
        raise SystemExit("--powerinfer-src: expected a PowerInfer git directory, got none "
                         "(or set $POWERINFER_SRC)")
    if args.quick:
        args.rounds, args.new_tokens, args.prompt_tokens = 1, 16, 32
        args.train_tokens, args.steps = min(args.train_tokens, 1024), min(args.steps, 50)
    from powerinfer_jax.checkpoint import cache_dir, load_checkpoint, resolve_model

    root = args.build_root or cache_dir() / "peers"
    binary, pi_commit = build(args.powerinfer_src, root)
    _log(f"PowerInfer {pi_commit[:12]}: {binary}")
    source_config = load_checkpoint(resolve_model(args.model), keep_quantized=True).config
    files = exports(root, args.model, args.train_text, rank=args.rank,
                    train_tokens=args.train_tokens, steps=args.steps, weights=args.weights,
                    quantize=binary.with_name("quantize"), source_config=source_config)
    tok = load_checkpoint(files["dense"], keep_quantized=True).tokenizer
    source_relu = source_config.activation == "relu"
    ppl_ids = None
    if args.ppl_chunks:
        text = args.ppl_text.read_text(encoding="utf-8")
        need = args.ppl_chunks * PPL_CTX
        ppl_ids = tok.encode(text[:need * 8], add_bos=False)  # a prefix: BPE cuts at words
        if len(ppl_ids) < need + 1:
            raise SystemExit(f"--ppl-text: expected at least {need + 1} tokens, got "
                             f"{len(ppl_ids)}")
        ppl_ids = ppl_ids[:need]
    prompt = _prompt_text(args.prompt_text, args.prompt_tokens, tok)
    threads = args.threads or _common.available_threads()
    config = {"prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
              "rounds": args.rounds, "rank": args.rank, "train_tokens": args.train_tokens,
              "steps": args.steps, "files": {k: v.name for k, v in files.items()},
              "powerinfer_weights": args.weights,
              "activation": "relu (its own)" if source_relu else "relu (switched)",
              "ppl": {"chunks": args.ppl_chunks, "ctx": PPL_CTX, "text": args.ppl_text.name,
                      "powerinfer_repeats": args.ppl_repeats,
                      "protocol": "llama.cpp perplexity: second half of each chunk"}}
    rows = []
    if args.families:
        ids = tok.encode(prompt, add_bos=False)
        for r in families(binary, root, args.model, ids, new_tokens=args.new_tokens):
            rows.append({**_common.header("peers_powerinfer", threads=1, dtype="float32",
                                          model=f"tiny-{r['family']}", config=config,
                                          quick=args.quick),
                         "powerinfer_commit": pi_commit, **r})
    for rnd in range(args.rounds if args.speed else 0):
        for t in threads:
            theirs = {m: run_powerinfer(binary, files[m], prompt, threads=t,
                                        new_tokens=args.new_tokens) for m in MODES}
            ppl_now = ppl_ids is not None and rnd == 0 and t == threads[-1]
            if ppl_now:
                for m in MODES:  # PowerInfer's figure moves between runs (ours does not):
                    # --ppl-repeats runs, their median compared
                    runs = [ppl_powerinfer(binary, files[m], args.ppl_text, ctx=PPL_CTX,
                                           chunks=args.ppl_chunks, threads=t)
                            for _ in range(args.ppl_repeats)]
                    theirs[m]["ppl"], theirs[m]["ppl_runs"] = statistics.median(runs), runs
                    _log(f"PowerInfer {m}: perplexity {theirs[m]['ppl']:.3f} (runs {runs})")
            ids = theirs["dense"]["prompt_ids"]
            for m in MODES:
                r = theirs[m]
                rows.append({**_common.header("peers_powerinfer", threads=t, dtype=args.weights,
                                              model=args.model, config=config, quick=args.quick),
                             "system": "powerinfer", "mode": m, "round": rnd, "loadavg": _load(),
                             "powerinfer_commit": pi_commit,
                             "prompt_ids_match": r["prompt_ids"] == tok.encode(prompt, add_bos=False),
                             **{k: r[k] for k in ("prefill_tok_s", "decode_tok_s", "tokens",
                                                  "prompt_tokens", "ppl", "ppl_runs")
                                    if k in r}})
                _log(f"round {rnd} t={t} PowerInfer {m}: prefill {r['prefill_tok_s']:.1f} "
                     f"decode {r['decode_tok_s']:.1f} tok/s")
            with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
                json.dump({"prompt_ids": ids, "new_tokens": args.new_tokens,
                           "weights": args.weights, "ppl_ids": ppl_ids if ppl_now else None,
                           "ppl_ctx": PPL_CTX, "ppl_chunks": args.ppl_chunks,
                           "files": {k: str(v) for k, v in files.items()},
                           "powerinfer_tokens": {m: theirs[m]["tokens"] for m in MODES}}, f)
            ours = _common.run_children("experiments.peers_powerinfer", [t],
                                        ["--child-spec", f.name])
            os.unlink(f.name)
            for r in ours:
                rows.append({**_common.header("peers_powerinfer", threads=t, dtype=r["dtype"],
                                              model=args.model, config=config, quick=args.quick),
                             "round": rnd, "loadavg": _load(), "powerinfer_commit": pi_commit,
                             **r})
                _log(f"round {rnd} t={t} ours {r['mode']} {r['dtype']}: prefill "
                     f"{r['prefill_tok_s']:.1f} decode {r['decode_tok_s']:.1f} tok/s"
                     + (f" perplexity {r['ppl']:.3f}" if "ppl" in r else "")
                     + (f" agree prefix {r['agree_prefix']} tf {r['agree_teacher_forced']:.3f}"
                        if "agree_prefix" in r else ""))
    if args.speed:
        rows += summary(rows, args, config, pi_commit)
    _common.append_rows(args.out, rows)
    _log(f"{len(rows)} rows -> {args.out}")


def summary(rows, args, config, pi_commit) -> list[dict]:
    """Per (mode, dtype, threads): median over rounds of ours / PowerInfer, decode and prefill."""
    out = []
    keys = {(r["mode"], r["dtype"], r["threads"]) for r in rows if r["system"] == "powerinfer_jax"}
    for mode, dtype, t in sorted(keys):
        ratios = {"decode": [], "prefill": []}
        for rnd in range(args.rounds):
            pi = [r for r in rows if r["system"] == "powerinfer" and r["mode"] == peer_mode(mode)
                  and r["threads"] == t and r["round"] == rnd]
            us = [r for r in rows if r["system"] == "powerinfer_jax" and r["mode"] == mode
                  and r["dtype"] == dtype and r["threads"] == t and r["round"] == rnd]
            if pi and us:
                for k in ratios:
                    ratios[k].append(us[0][f"{k}_tok_s"] / pi[0][f"{k}_tok_s"])
        out.append({**_common.header("peers_powerinfer", threads=t, dtype=dtype,
                                     model=args.model, config=config, quick=args.quick),
                    "system": "summary", "mode": mode, "powerinfer_mode": peer_mode(mode),
                    "powerinfer_commit": pi_commit,
                    **_ppls(rows, mode, dtype),
                    "decode_ratio_median": statistics.median(ratios["decode"]),
                    "prefill_ratio_median": statistics.median(ratios["prefill"]),
                    "decode_ratios": ratios["decode"], "prefill_ratios": ratios["prefill"]})
        _log(f"summary {mode} {dtype} t={t}: ours/PowerInfer decode "
             f"{out[-1]['decode_ratio_median']:.2f}x prefill {out[-1]['prefill_ratio_median']:.2f}x")
    return out


def _ppls(rows, mode, dtype) -> dict:
    """The perplexities measured for (mode, dtype), ours and PowerInfer's, when --ppl-chunks."""
    ours = [r["ppl"] for r in rows if r["system"] == "powerinfer_jax" and r["mode"] == mode
            and r["dtype"] == dtype and "ppl" in r]
    theirs = [r for r in rows if r["system"] == "powerinfer"
              and r["mode"] == peer_mode(mode) and "ppl" in r]
    if not (ours and theirs):
        return {}
    return {"ppl_ours": ours[0], "ppl_powerinfer": theirs[0]["ppl"],
            "ppl_powerinfer_runs": theirs[0].get("ppl_runs", [theirs[0]["ppl"]])}


if __name__ == "__main__":
    main()
