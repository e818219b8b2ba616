"""llama.cpp with -ngl vs our hybrid engine on a GPU, at the same VRAM budgets, interleaved.

Issue 18's baseline is llama.cpp itself (benchmarks/gpu/build_llama_cpp_cuda.sh builds it for
sm_90), on the same synthetic Llama-2-7B-shaped model: random weights at --dtype, llama.cpp's
from a GGUF (benchmarks/gpu/synthetic.py), ours built in memory (hybrid_decode.py).

The budget: as in hybrid_decode.py, our dense parts (attention, norms, embeddings, lm_head, KV
cache at --max-seq-len) plus a fraction of the FFN bytes, in bytes at the stored dtypes
(sparsity/placement.py's `model_bytes`). llama.cpp gets the same number of bytes for its weights
and KV cache on the GPU, arranged its two ways (`llama_cpp_layout`):
  ngl  plain -ngl k, k as large as fits: llama.cpp puts the output layer (lm_head, final norm)
       and the last k-1 whole layers (weights and KV cache) on the GPU; token embeddings stay on
       the host. Layers are added one at a time while the next still fits, as place_layers does.
  ot   -ngl all with -ot 'blk.(j..L-1).ffn_*=CPU': every layer's attention, norms and KV cache
       on the GPU and the FFNs of the first j layers, j as large as fits: the tensors our
       `--offload layers` mode (place_layers) keeps on the device.
Compute buffers (llama.cpp's, XLA's temporaries) are charged to neither side.

Each round times, per budget, back to back: llama.cpp ngl, llama.cpp ot, our hybrid and our
layers_dense (our imitation of -ngl), so the ratios come from one interleaved run (the host drifts).
Host threads: llama-bench -t N and our pool's N. Decode: llama-bench -d P -n G (G tokens after a
P-token context) against our G new tokens after a P-token prompt. Rows go to --out, one per
measurement, with the exact llama-bench command line.

  python -m benchmarks.gpu.llama_cpp_ngl --llama-bin .peers/llama.cpp-cuda \
      --gguf /tmp/llama2-7b.bf16.gguf --budgets 0.1 0.25 --threads 12 --out benchmarks/gpu_hybrid.jsonl
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.gpu import synthetic

REPO = Path(__file__).resolve().parents[2]

KV_ITEM_BYTES = 2  # llama.cpp's default KV cache type: f16
_LAYER = re.compile(r"^blk\.(\d+)\.")
_FFN = re.compile(r"^blk\.\d+\.ffn_(gate|up|down)\.weight$")
# routed experts, as llama.cpp's --n-cpu-moe selects them (common.h LLM_FFN_EXPS_REGEX)
_EXPS = re.compile(r"^blk\.\d+\.ffn_(up|down|gate|gate_up)_(ch|)exps\.")


@dataclasses.dataclass(frozen=True)
class GgufBytes:
    """Bytes of a llama GGUF's tensors as llama.cpp places them."""

    n_layers: int
    layer: tuple[int, ...]  # per layer: every blk.i tensor
    ffn: tuple[int, ...]  # per layer: ffn_gate, ffn_up, ffn_down
    output: int  # output_norm + output.weight (token_embd again when tied: llama.cpp copies it)
    token_embd: int  # stays on the host
    kv_per_token_layer: int  # K and V of one token in one layer, f16
    exps: tuple[int, ...] = ()  # per layer: its routed experts' tensors (MoE; else zeros)

    def kv(self, n_ctx: int) -> int:
        return n_ctx * self.kv_per_token_layer


def gguf_bytes(path) -> GgufBytes:
    """Read tensor sizes and shape metadata from a GGUF (the gguf package's reader)."""
    from gguf import GGUFReader

    r = GGUFReader(str(path))

    def meta(key):
        f = r.fields[key]
        return int(f.parts[f.data[0]][0])

    f = r.fields["general.architecture"]
    arch = bytes(f.parts[f.data[0]]).decode()  # llama, olmoe, qwen3moe, ...
    n_layers = meta(f"{arch}.block_count")
    kv_heads = meta(f"{arch}.attention.head_count_kv")
    head_dim = meta(f"{arch}.embedding_length") // meta(f"{arch}.attention.head_count")
    if f"{arch}.attention.key_length" in r.fields:
        head_dim = meta(f"{arch}.attention.key_length")
    layer, ffn, exps = [0] * n_layers, [0] * n_layers, [0] * n_layers
    output = token_embd = 0
    names = set()
    for t in r.tensors:
        names.add(t.name)
        m = _LAYER.match(t.name)
        if m:
            layer[int(m.group(1))] += int(t.n_bytes)
            if _FFN.match(t.name):
                ffn[int(m.group(1))] += int(t.n_bytes)
            if _EXPS.match(t.name):
                exps[int(m.group(1))] += int(t.n_bytes)
        elif t.name == "token_embd.weight":
            token_embd = int(t.n_bytes)
        else:
            output += int(t.n_bytes)
    if "output.weight" not in names:
        output += token_embd
    return GgufBytes(n_layers, tuple(layer), tuple(ffn), output, token_embd,
                     2 * kv_heads * head_dim * KV_ITEM_BYTES, tuple(exps))


@dataclasses.dataclass(frozen=True)
class Layout:
    """llama.cpp arguments for one budget and the bytes they put on the GPU."""

    kind: str  # "ngl" | "ot" | "ncmoe"
    ngl: int
    cpu_ffn_layers: tuple[int, ...]  # "ot": layers whose FFN stays on the host
    gpu_bytes: int
    n_cpu_moe: int = 0  # "ncmoe": the first layers whose routed experts stay on the host

    def args(self) -> list[str]:
        out = ["-ngl", str(self.ngl)]
        if self.cpu_ffn_layers:
            out += ["-ot", ot_pattern(self.cpu_ffn_layers)]
        if self.kind == "ncmoe":
            out += ["--n-cpu-moe", str(self.n_cpu_moe)]
        return out


def ot_pattern(layers) -> str:
    """llama-bench -ot value keeping these layers' FFN weights in host memory."""
    return r"blk\.(" + "|".join(str(l) for l in layers) + r")\.ffn_(gate|up|down)\.weight=CPU"


def llama_cpp_layout(sizes: GgufBytes, budget: int, n_ctx: int, kind: str) -> Layout | None:
    """The most llama.cpp puts on the GPU within `budget` bytes (see the module docstring);
    None when not even the first unit fits (ot: every non-FFN tensor and the KV cache)."""
    n = sizes.n_layers
    kv = sizes.kv(n_ctx)
    if kind == "ngl":
        used, k = 0, 0
        # k = 1 is the output layer; k = 2.. adds layers L-1, L-2, ... (llama.cpp's i_gpu_start)
        units = [sizes.output] + [sizes.layer[l] + kv for l in reversed(range(n))]
        for cost in units:
            if used + cost > budget:
                break
            used += cost
            k += 1
        return Layout("ngl", k, (), used)
    if kind == "ot":
        used = sizes.output + sum(b - f + kv for b, f in zip(sizes.layer, sizes.ffn))
        if used > budget:
            return None
        j = 0
        while j < n and used + sizes.ffn[j] <= budget:
            used += sizes.ffn[j]
            j += 1
        return Layout("ot", n + 1, tuple(range(j, n)), used)
    if kind == "ncmoe":
        # MoE: -ngl all, --n-cpu-moe N: every tensor but the token embeddings on the GPU except
        # the routed experts of layers 0..N-1 (llama.cpp's own expert offload), N the fewest
        # that fit
        if not any(sizes.exps):
            raise ValueError("layout 'ncmoe': expected a mixture-of-experts GGUF (ffn_*_exps "
                             "tensors), got none")
        used = sizes.output + sum(b + kv for b in sizes.layer)
        for n_cpu in range(n + 1):
            if used <= budget:
                return Layout("ncmoe", n + 1, (), used, n_cpu)
            if n_cpu < n:
                used -= sizes.exps[n_cpu]
        return None
    raise ValueError(f"layout kind: expected 'ngl', 'ot' or 'ncmoe', got {kind!r}")


def our_budget(cfg, dtype: str, frac: float, kv_len: int) -> tuple[int, object]:
    """hybrid_decode's budget: our dense bytes + frac * our FFN bytes (model_bytes on an
    abstract model: no weights are made)."""
    import jax.numpy as jnp
    from flax import nnx

    from powerinfer_jax.models.transformer import Transformer
    from powerinfer_jax.sparsity import placement as pl

    m = nnx.eval_shape(lambda: Transformer(cfg, dtype=jnp.dtype(dtype), kernels="xla"))
    sizes = pl.model_bytes(m, kv_len=kv_len)
    return sizes.dense + int(frac * sizes.ffn), sizes


# ------------------------------------------------------------------------------ llama-bench
def llama_bench_cmd(bin_dir, gguf, layout: Layout, *, threads: int, prompt_tokens: int,
                    new_tokens: int, repeats: int) -> list[str]:
    return [str(Path(bin_dir) / "llama-bench"), "-m", str(gguf), *layout.args(),
            "-t", str(threads), "-p", "0", "-n", str(new_tokens), "-d", str(prompt_tokens),
            "-r", str(repeats), "-o", "jsonl"]


def parse_llama_bench(stdout: str) -> dict:
    """The decode test's row of llama-bench -o jsonl output."""
    rows = [json.loads(l) for l in stdout.splitlines() if l.startswith("{")]
    gen = [r for r in rows if int(r.get("n_gen", 0)) > 0]
    if not gen:
        raise RuntimeError(f"llama-bench: expected a JSON row with n_gen > 0, got {stdout[-500:]!r}")
    return gen[-1]


def run_llama_bench(cmd: list[str], env: dict, timeout: float) -> dict:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"llama-bench exited {r.returncode}: {r.stderr[-1500:]}")
    row = parse_llama_bench(r.stdout)
    offloaded = re.findall(r"offloaded (\d+)/(\d+) layers to GPU", r.stderr)
    return {"decode_tok_s": float(row["avg_ts"]), "decode_stdev_tok_s": float(row["stddev_ts"]),
            "decode_runs": [float(x) for x in row.get("samples_ts", [])],
            "llama_bench": {k: row.get(k) for k in ("build_commit", "build_number", "cpu_info",
                                                    "gpu_info", "backends", "model_type",
                                                    "model_size", "n_gpu_layers", "n_threads",
                                                    "flash_attn", "type_k", "type_v",
                                                    "n_depth", "n_gen", "tensor_buft_overrides",
                                                    "devices")},
            "offloaded": offloaded[-1] if offloaded else None,
            "wall_s": time.perf_counter() - t0}


# ------------------------------------------------------------------------------ the run
def header(args) -> dict:
    from powerinfer_jax import _cli

    machine = _cli.machine_info()
    try:
        import jax

        machine.update(gpu=jax.devices()[0].device_kind, jax=jax.__version__)
    except Exception as e:  # noqa: BLE001 - the llama.cpp rows are still worth writing
        machine["gpu"] = f"unknown ({type(e).__name__})"
    info = Path(args.llama_bin) / "BUILD_INFO"
    return {"experiment": "gpu_llama_cpp_vs_hybrid", "run_id": args.run_id,
            "commit": args.commit or _cli.git_commit(), "machine": machine,
            "threads": args.threads, "dtype": args.dtype, "model": f"{args.shapes} (synthetic)",
            "llama_cpp_build": info.read_text().splitlines() if info.is_file() else None,
            "synthetic": "random weights; our masks sampled from the profile's frequencies "
                         f"({args.profile}); llama.cpp computes every neuron",
            "config": {"prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                       "repeats": args.repeats, "max_seq_len": args.max_seq_len,
                       "kv_ctx_llama_cpp": args.prompt_tokens + args.new_tokens}}


def library_env(bin_dir) -> dict:
    """LD_LIBRARY_PATH: the staged binaries' folder first (libllama, libggml*, backends), then
    whatever the caller set (the CUDA runtime and cuBLAS of the GPU machine)."""
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = ":".join(x for x in (str(Path(bin_dir).resolve()),
                                                   env.get("LD_LIBRARY_PATH", "")) if x)
    return env


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-bin", required=True, help="folder with llama-bench and its libraries")
    ap.add_argument("--gguf", required=True,
                    help="the synthetic model's GGUF (written here first when missing)")
    ap.add_argument("--shapes", choices=sorted(synthetic.SHAPES), default="llama2-7b")
    ap.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    ap.add_argument("--budgets", nargs="+", type=float, default=[0.1, 0.25, 0.5, 1.0],
                    help="VRAM budget beyond our dense parts, as fractions of the FFN bytes")
    ap.add_argument("--systems", nargs="+", default=["ngl", "ot", "hybrid", "layers_dense"],
                    choices=["ngl", "ot", "hybrid", "layers", "layers_dense"],
                    help="llama.cpp layouts (ngl, ot) and our hybrid_decode.py modes")
    ap.add_argument("--threads", type=int, default=12)
    ap.add_argument("--profile", default="0.50",
                    help="activation frequencies for our masks and placement (synthetic."
                         "load_profile: PATH, PATH:KEY or a bundled key; default: %(default)s)")
    ap.add_argument("--prompt-tokens", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--max-seq-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300, help="per llama-bench run (s)")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--run-id", default=datetime.datetime.now(datetime.timezone.utc)
                    .strftime("%Y%m%dT%H%M%SZ"))
    ap.add_argument("--dry-run", action="store_true",
                    help="print the budgets, layouts and commands without running anything")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "gpu_hybrid.jsonl"))
    args = ap.parse_args(argv)
    gtype = {"bfloat16": "bf16", "float16": "f16"}[args.dtype]
    cfg = synthetic.SHAPES[args.shapes].replace(max_seq_len=args.max_seq_len)
    if not Path(args.gguf).is_file():
        if args.dry_run:
            sys.exit(f"--dry-run: expected an existing --gguf, got {args.gguf}")
        info = synthetic.write_gguf(args.gguf, cfg, dtype=gtype, seed=args.seed, progress=True)
        print(f"wrote {args.gguf}: {info['bytes'] / 2**30:.2f} GiB in {info['seconds']:.0f} s",
              file=sys.stderr)
    sizes = gguf_bytes(args.gguf)
    if sizes.n_layers != cfg.n_layers:
        sys.exit(f"--gguf: expected {cfg.n_layers} layers ({args.shapes}), got {sizes.n_layers}")
    n_ctx = args.prompt_tokens + args.new_tokens
    plan = []
    for frac in args.budgets:
        budget, ours = our_budget(cfg, args.dtype, frac, args.max_seq_len)
        layouts = {k: llama_cpp_layout(sizes, budget, n_ctx, k) for k in ("ngl", "ot")}
        plan.append((frac, budget, ours, layouts))
        summary = {k: None if v is None else {"ngl": v.ngl, "cpu_ffn_layers": len(
            v.cpu_ffn_layers), "gpu_gib": round(v.gpu_bytes / 2**30, 3)} for k, v in
            layouts.items()}
        print(json.dumps({"budget_ffn_fraction": frac, "budget_gib": round(budget / 2**30, 3),
                          "ours_dense_gib": round(ours.dense / 2**30, 3), **summary}),
              flush=True)
    if args.dry_run:
        for frac, budget, ours, layouts in plan:
            for kind, lay in layouts.items():
                if lay is not None and kind in args.systems:
                    print(" ".join(llama_bench_cmd(args.llama_bin, args.gguf, lay,
                                                   threads=args.threads,
                                                   prompt_tokens=args.prompt_tokens,
                                                   new_tokens=args.new_tokens,
                                                   repeats=args.repeats)))
        return
    run_rounds(args, cfg, plan)


def run_rounds(args, cfg, plan) -> None:
    from benchmarks.gpu import hybrid_decode  # lazy: jax and flax, only for the rounds

    freq_src, label = synthetic.load_profile(args.profile)
    freq = synthetic.frequencies(freq_src, cfg)
    head = header(args)
    head["config"]["profile"] = label
    head["config"]["mean_active_fraction"] = float(freq.mean())
    env = library_env(args.llama_bin)
    ours_args = argparse.Namespace(dtype=args.dtype, seed=args.seed, max_seq_len=args.max_seq_len,
                                   prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                                   repeats=args.repeats, overlap=False, threads=args.threads)
    from powerinfer_jax.ops import _ffi

    _ffi.set_num_threads(args.threads)
    for rnd in range(args.rounds):
        for frac, budget, ours, layouts in plan:
            for system in args.systems:
                row = {**head, "time": datetime.datetime.now(datetime.timezone.utc)
                       .isoformat(timespec="seconds"), "round": rnd,
                       "budget_ffn_fraction": frac, "budget_bytes": budget}
                try:
                    if system in layouts:
                        lay = layouts[system]
                        if lay is None:
                            raise RuntimeError(f"budget {budget} bytes is below what llama.cpp "
                                               f"layout {system!r} needs before any FFN")
                        cmd = llama_bench_cmd(args.llama_bin, args.gguf, lay,
                                              threads=args.threads,
                                              prompt_tokens=args.prompt_tokens,
                                              new_tokens=args.new_tokens, repeats=args.repeats)
                        row.update(system="llama.cpp", mode=system, ngl=lay.ngl,
                                   cpu_ffn_layers=list(lay.cpu_ffn_layers),
                                   bytes_device=lay.gpu_bytes, command=" ".join(cmd),
                                   **run_llama_bench(cmd, env, args.timeout))
                    else:
                        row.update(system="powerinfer_jax",
                                   **hybrid_decode.run_mode(ours_args, cfg, freq, system, frac))
                except Exception as e:  # one failure must not lose the other rows
                    row.update(system=row.get("system", "llama.cpp" if system in layouts
                                              else "powerinfer_jax"), mode=system,
                               error=f"{type(e).__name__}: {e}"[:2000])
                with open(args.out, "a", encoding="utf-8") as f:
                    f.write(json.dumps(row) + "\n")
                print(json.dumps({k: row.get(k) for k in (
                    "round", "budget_ffn_fraction", "system", "mode", "ngl", "decode_tok_s",
                    "bytes_device", "error")}), flush=True)
    print_ratios(args.out, args.run_id)


def print_ratios(path, run_id) -> None:
    """Per budget: our hybrid's decode tok/s over each llama.cpp layout's, medians over rounds
    of the same run."""
    rows = [json.loads(l) for l in open(path, encoding="utf-8")]
    rows = [r for r in rows if r.get("run_id") == run_id and "decode_tok_s" in r]
    by = {}
    for r in rows:
        by.setdefault((r["budget_ffn_fraction"], r["mode"]), []).append(r["decode_tok_s"])
    for frac in sorted({k[0] for k in by}):
        hyb = by.get((frac, "hybrid"))
        for base in ("ngl", "ot", "layers_dense"):
            if hyb and by.get((frac, base)):
                ratio = statistics.median(hyb) / statistics.median(by[(frac, base)])
                print(f"budget {frac}: hybrid / {base} = {ratio:.2f}x "
                      f"({statistics.median(hyb):.1f} vs {statistics.median(by[(frac, base)]):.1f}"
                      " tok/s)", flush=True)


if __name__ == "__main__":
    main()
