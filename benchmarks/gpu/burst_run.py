"""The GPU burst's run (the entry point and its reasons: benchmarks/gpu/burst.py).

  load the GGUF teacher -> [refit the down rows] -> teacher samples on the device -> compile the
  scanned step (benchmarks/gpu/burst_scan.py) -> time PROBE_STEPS steps, fix the step count for the budget ->
  train (ProSparse schedule, FATReLU from fatrelu_at) with curve points and a snapshot -> evaluate
  (wiki.valid perplexity and sparsity: plain ReLU, FATReLU, and the model rebuilt from the written
  files) -> write the files (burst_files.py)
"""
from __future__ import annotations

import dataclasses
import json
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from powerinfer_jax.checkpoint import load_checkpoint
from powerinfer_jax.models.transformer import from_params
from benchmarks.gpu import burst_files, burst_scan as scan
from powerinfer_jax.sparsify import samples as smp
from powerinfer_jax.sparsify import forward as fw
from powerinfer_jax.sparsify.recipe import DistillConfig
from powerinfer_jax.sparsify.export import canonical_params
from powerinfer_jax.sparsify.fatrelu import pick_threshold, scan_grid
from powerinfer_jax.sparsify.refit import refit_down_rows
from powerinfer_jax.sparsify.run import check_teacher
from powerinfer_jax.sparsify.schedule import L1Controller, learning_rate
from powerinfer_jax.sparsify.train import Timer

PROBE_STEPS = 5  # steps timed before the step count is fixed
SNAPSHOT_AT = 0.6  # fraction of the steps where a snapshot of the weights is written
LOG_EVERY = 10  # steps between loss-curve points in the log (and host-device syncs)
EVAL_CTX = 512
EVAL_ROWS = 4  # validation chunks per evaluation call
FATRELU_CHUNKS = 4  # training chunks FATReLU's threshold is calibrated on
POST_TRAIN_S = 25.0  # time kept after training for the final evaluation and the files
WIKI_PROMPTS = 256  # wiki.train snippets the teacher continues (besides the chat prompts)


def _step_bytes(compiled) -> int | None:
    """XLA's estimate of a compiled step's device memory (arguments, outputs, temporaries), or
    None where the backend does not say."""
    try:
        m = compiled.memory_analysis()
        return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                   - getattr(m, "alias_size_in_bytes", 0))
    except Exception:  # noqa: BLE001 - an optional report; absent on some backends
        return None


class TokenStream:
    """Deterministic batches [B, T] from a token stream (wiki.train) and sample rows: each pass
    over the stream starts at a fresh offset in [0, T) and takes its chunks in a fresh order;
    samples likewise per pass. Batch `step` is a pure function of (seed, step)."""

    def __init__(self, ids: np.ndarray, samples: np.ndarray, batch: int, seq_len: int,
                 sample_rows: int, seed: int):
        self.ids, self.samples, self.batch, self.t = ids, samples, batch, seq_len
        self.sample_rows = sample_rows if len(samples) else 0
        self.seed = seed
        self.chunks_per_pass = (len(ids) - seq_len) // seq_len
        if self.chunks_per_pass < 1:
            raise ValueError(f"training tokens: expected more than 2 x --seq-len ({seq_len}), "
                             f"got {len(ids)}")
        self._passes: dict = {}

    def _pass(self, stream: int, epoch: int, size: int):
        key = (stream, epoch)
        if key not in self._passes:
            rng = np.random.default_rng([self.seed, stream, epoch])
            self._passes = {k: v for k, v in self._passes.items() if k[1] >= epoch - 1}
            self._passes[key] = (int(rng.integers(self.t)), rng.permutation(size))
        return self._passes[key]

    def __call__(self, step: int) -> np.ndarray:
        rows = []
        n_wiki = self.batch - self.sample_rows
        for j in range(n_wiki):
            epoch, pos = divmod(step * n_wiki + j, self.chunks_per_pass)
            offset, perm = self._pass(0, epoch, self.chunks_per_pass)
            start = offset + int(perm[pos]) * self.t
            rows.append(self.ids[start:start + self.t])
        for j in range(self.sample_rows):
            epoch, pos = divmod(step * self.sample_rows + j, len(self.samples))
            _, perm = self._pass(1, epoch, len(self.samples))
            rows.append(self.samples[int(perm[pos])])
        return np.stack(rows).astype(np.int32)

    def passes(self, steps: int) -> float:
        return steps * (self.batch - self.sample_rows) / self.chunks_per_pass


class Burst:
    def __init__(self, args, *, started: float, stop_wall: float):
        self.args, self.started, self.stop_wall = args, started, stop_wall
        self.out = Path(args.out)
        self.timer = Timer()
        self.log = {"experiment": "sparsify_burst", "args": {k: v for k, v in vars(args).items()},
                    "timing": self.timer.parts, "curve": [], "eval": {}}

    # ----------------------------------------------------------------------------- helpers
    def since_start(self) -> float:
        return time.time() - self.started

    def note(self, msg: str) -> None:
        print(f"[burst {self.since_start():6.1f}s] {msg}", flush=True)

    def cfg(self, steps: int) -> DistillConfig:
        """The run's DistillConfig for `steps` steps (schedules are functions of it)."""
        a = self.args
        return DistillConfig(
            variant=a.variant, tokens=steps * self.batch * a.seq_len, batch=self.batch,
            seq_len=a.seq_len, lr=a.lr, warmup_steps=a.warmup_steps,
            lr_final_fraction=a.lr_final_fraction, weight_decay=a.weight_decay, seed=a.seed,
            l1=0.0, l1_stages=a.l1_stages, l1_on=a.l1_on, fatrelu_kl_rise=a.fatrelu_kl_rise,
            fatrelu_at=a.fatrelu_at, train=a.train, compute_dtype=a.compute_dtype,
            l1_target_sparsity=a.l1_target_sparsity,
            remat=a.remat, refit=a.refit, refit_tokens=max(a.refit_tokens, a.seq_len),
            samples=a.samples, sample_fraction=a.sample_fraction if a.samples else 0.0)

    # ----------------------------------------------------------------------------- stages
    def load(self):
        a = self.args
        with self.timer.section("load"):
            self.ckpt = load_checkpoint(a.teacher)
            check_teacher(self.ckpt.config, a.teacher)
            data = Path(a.data)
            self.train_ids = np.load(data / "train_ids.npy").astype(np.int32)
            valid = data / "valid_ids.npy"
            self.valid_ids = np.load(valid).astype(np.int32) if valid.is_file() else None
        dev = jax.devices()[0]
        self.eval_ctx = min(EVAL_CTX, self.ckpt.config.max_seq_len)
        self.log.update(teacher=a.teacher, teacher_sha256=burst_files.digest(Path(a.teacher)),
                        teacher_config=dataclasses.asdict(self.ckpt.config),
                        device={"platform": dev.platform, "kind": dev.device_kind,
                                "count": jax.device_count(), "jax": jax.__version__,
                                "python": platform.python_version()},
                        train_tokens=int(self.train_ids.size))
        self.note(f"loaded {a.teacher} on {dev.device_kind}; {self.train_ids.size} train tokens")

    def models(self):
        c, p = self.ckpt.config, self.ckpt.params
        with self.timer.section("load"):
            self.teacher = from_params(c, p, kernels="xla")
            self.student = from_params(c, p, kernels="xla")
        self.spec = fw.FFNSpec(self.args.variant)
        a = self.args
        if a.refit:
            n = max(1, a.refit_tokens // a.seq_len)
            chunks = self.train_ids[:(len(self.train_ids) // a.seq_len) * a.seq_len]
            chunks = chunks.reshape(-1, a.seq_len)
            pick = np.sort(np.random.default_rng([a.seed, 3]).permutation(len(chunks))[:n])
            with self.timer.section("refit"):
                rep = refit_down_rows(self.student, self.teacher, chunks[pick], self.spec,
                                      fw.teacher_spec(c), progress=False)
            self.log["refit"] = {k: rep[k] for k in ("before", "after")}
            self.note(f"refit: residual {np.mean(rep['before']):.3f} -> "
                      f"{np.mean(rep['after']):.3f}")

    def samples(self) -> np.ndarray:
        a = self.args
        if not a.samples:
            return np.zeros((0, a.seq_len), np.int32)
        tok = self.ckpt.tokenizer
        rng = np.random.default_rng([a.seed, 5])
        bos = [] if tok.bos_id is None else [tok.bos_id]
        prompts = [tok.encode(t) for t in smp.prompt_texts(tok)]
        for _ in range(WIKI_PROMPTS):  # the teacher continues wiki text in its own words
            n = int(rng.integers(16, 49))
            s = int(rng.integers(0, len(self.train_ids) - n))
            prompts.append(bos + self.train_ids[s:s + n].tolist())
        rows = max(a.sample_batch, a.samples // a.sample_batch * a.sample_batch)
        with self.timer.section("samples"):
            out = smp.generate_samples(self.teacher, tok, n=rows, seq_len=a.seq_len, seed=a.seed,
                                       batch=min(a.sample_batch, rows), progress=False,
                                       prompts=prompts, time_limit=a.samples_seconds)
        self.log["samples"] = {"rows": int(len(out)), "asked": rows,
                               "seconds": self.timer.parts["samples"]}
        self.note(f"{len(out)} teacher samples of {a.seq_len} in "
                  f"{self.timer.parts['samples']:.1f}s")
        return out

    def compile(self):
        a = self.args
        dtype = jnp.dtype(a.compute_dtype)
        self.s_defs, self.params, self.frozen = scan.split(self.student, a.train)
        self.t_defs, self.t_params, self.t_frozen = scan.split(self.teacher, a.train)
        s_defs, t_defs, spec = self.s_defs, self.t_defs, self.spec
        t_spec = fw.teacher_spec(self.ckpt.config)
        l1_key = "l1_gate" if a.l1_on == "gate" else "l1"
        self.tx = optax.chain(optax.clip_by_global_norm(1.0), optax.scale_by_adam(),
                              optax.add_decayed_weights(a.weight_decay))
        tx = self.tx

        def step(params, opt_state, frozen, t_params, t_frozen, tokens, lr, l1_coef, gate):
            t_logits, _ = scan.forward(t_defs, t_params, t_frozen, tokens, t_spec,
                                       compute_dtype=dtype)

            def loss_fn(p):
                s_logits, aux = scan.forward(s_defs, p, frozen, tokens, spec,
                                             compute_dtype=dtype, gate_threshold=gate,
                                             remat=a.remat)
                kl = fw.kl_divergence(t_logits, s_logits)
                l1 = jnp.mean(aux[l1_key])
                return kl + l1_coef * l1, {"kl": kl, "l1": l1,
                                           "sparsity": jnp.mean(aux["zero_frac"])}

            (loss, m), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            updates = jax.tree.map(lambda u: -lr * u, updates)
            grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
            m.update(loss=loss, grad_norm=grad_norm)
            return optax.apply_updates(params, updates), opt_state, m

        def nll(params, frozen, tokens, gate):
            logits, aux = scan.forward(s_defs, params, frozen, tokens, spec, gate_threshold=gate)
            return fw.token_nll(logits, tokens), jnp.mean(aux["zero_frac"])

        def teacher_nll(t_params, t_frozen, tokens):
            logits, _ = scan.forward(t_defs, t_params, t_frozen, tokens, t_spec)
            return fw.token_nll(logits, tokens)

        def kl_at(params, frozen, t_params, t_frozen, tokens, gate):
            t_logits, _ = scan.forward(t_defs, t_params, t_frozen, tokens, t_spec)
            s_logits, aux = scan.forward(s_defs, params, frozen, tokens, spec,
                                         gate_threshold=gate)
            return fw.kl_divergence(t_logits, s_logits), jnp.mean(aux["zero_frac"])

        self.opt_state = tx.init(self.params)
        self._jit_step = jax.jit(step, donate_argnums=(0, 1))
        self.batch = a.batch or self.auto_batch()
        self.compile_step()
        self.nll, self.teacher_nll = jax.jit(nll), jax.jit(teacher_nll)
        self.kl_at = jax.jit(kl_at)

    def auto_batch(self) -> int:
        """--batch 0: 32 sequences where the device has >= 100 GB (H200: ~45-60 GB at peak with
        seq 512), else 16 (an H100's 80 GB)."""
        stats = jax.devices()[0].memory_stats() or {}
        limit = stats.get("bytes_limit", 0)
        return 32 if limit >= 100e9 else 16

    def compile_step(self) -> None:
        """AOT-compile the step for self.batch; halve the batch while XLA's own estimate of the
        step's memory passes 90% of the device's (where the backend reports both)."""
        a = self.args
        f32 = jnp.float32(0)
        while True:
            tokens = jax.ShapeDtypeStruct((self.batch, a.seq_len), jnp.int32)
            with self.timer.section("compile"):
                self.step = self._jit_step.lower(
                    self.params, self.opt_state, self.frozen, self.t_params, self.t_frozen,
                    tokens, f32, f32, f32).compile()
            need, limit = _step_bytes(self.step), (jax.devices()[0].memory_stats() or {}).get(
                "bytes_limit")
            self.log.update(batch=self.batch, step_bytes=need, device_bytes=limit)
            self.note(f"step compiled for batch {self.batch} x {a.seq_len} "
                      f"({self.timer.parts['compile']:.1f}s so far; needs "
                      f"{(need or 0) / 1e9:.1f} GB of {(limit or 0) / 1e9:.1f})")
            if not (need and limit and need > 0.9 * limit and self.batch > 1):
                return
            self.batch //= 2

    def restart_smaller(self) -> None:
        """After running out of device memory in the first step: fresh state (the step donated
        the old), half the batch, compiled again."""
        self.s_defs, self.params, self.frozen = scan.split(self.student, self.args.train)
        self.opt_state = self.tx.init(self.params)
        self.batch //= 2
        self.log.setdefault("oom_restarts", []).append(self.batch)
        self.note(f"out of device memory: restarting with batch {self.batch}")
        self.compile_step()

    def evaluate(self, name: str, params=None, frozen=None, gate: float = 0.0) -> dict | None:
        """wiki.valid perplexity and FFN sparsity of the student (or other params) at `gate`."""
        if self.valid_ids is None:
            return None
        a = self.args
        ctx = self.eval_ctx
        n = min(a.eval_chunks, len(self.valid_ids) // ctx)
        if n == 0:
            return None
        chunks = self.valid_ids[:n * ctx].reshape(n, ctx)
        params = self.params if params is None else params
        frozen = self.frozen if frozen is None else frozen
        t0 = time.perf_counter()
        total, zero = 0.0, []
        for i in range(0, n, EVAL_ROWS):
            x = jnp.asarray(chunks[i:i + EVAL_ROWS])
            s, z = self.nll(params, frozen, x, jnp.float32(gate))
            total, zero = total + float(s), zero + [float(z)] * len(x)
        if "dense" not in self.log["eval"]:
            t_total = sum(float(self.teacher_nll(self.t_params, self.t_frozen,
                                                 jnp.asarray(chunks[i:i + EVAL_ROWS])))
                          for i in range(0, n, EVAL_ROWS))
            self.log["eval"]["dense"] = {"ppl": float(np.exp(t_total / (n * (ctx - 1))))}
        ppl = float(np.exp(total / (n * (ctx - 1))))
        res = {"ppl": ppl, "ppl_x_dense": ppl / self.log["eval"]["dense"]["ppl"],
               "ffn_sparsity": float(np.mean(zero)), "gate_threshold": gate, "chunks": n,
               "ctx": ctx}
        self.timer.add("eval", time.perf_counter() - t0)
        self.log["eval"][name] = res
        self.note(f"eval {name}: ppl {ppl:.3f} ({res['ppl_x_dense']:.3f}x dense), "
                  f"sparsity {res['ffn_sparsity']:.4f}")
        return res

    def calibrate_fatrelu(self, step: int) -> float:
        a = self.args
        with self.timer.section("fatrelu"):
            n = len(self.train_ids) // a.seq_len
            pick = np.sort(np.random.default_rng([a.seed, 4]).permutation(n)[:FATRELU_CHUNKS])
            x = jnp.asarray(np.stack([self.train_ids[i * a.seq_len:(i + 1) * a.seq_len]
                                      for i in pick]))

            def kl_at(t):
                kl, sp = self.kl_at(self.params, self.frozen, self.t_params, self.t_frozen, x,
                                    jnp.float32(t))
                return float(kl), float(sp)

            curve = scan_grid(kl_at, a.fatrelu_kl_rise)
            t = pick_threshold(curve, a.fatrelu_kl_rise)
        self.log["fatrelu"] = {"threshold": t, "step": step, "curve": curve}
        self.note(f"FATReLU threshold {t} at step {step}")
        return t

    def student_params(self) -> dict:
        """The student's canonical float32 params as trained so far."""
        scan.update(self.student, self.s_defs, self.params)
        return canonical_params(self.student)

    def norms(self, params: dict) -> dict | None:
        if self.args.train != "ffn+norms":
            return None
        return {k: v for k, v in params.items() if k.endswith("norm.scale")}

    def write(self, final: bool) -> dict:
        with self.timer.section("write"):
            params = self.student_params()
            self.log.update(final=final, wall_s=self.since_start())
            return burst_files.write(self.out, params, self.ckpt.params,
                                     self.ckpt.config.n_layers, self.log, self.norms(params))

    # ----------------------------------------------------------------------------- the run
    def run(self) -> None:
        a = self.args
        self.load()
        self.models()
        samples = self.samples()
        self.compile()

        def stream():
            return TokenStream(self.train_ids, samples, self.batch, a.seq_len,
                               int(round(self.batch * a.sample_fraction)), a.seed)

        data = stream()
        self.evaluate("start")
        t_train = time.time()
        train_end = min(t_train + a.budget, self.stop_wall)
        self.log.update(training_started_s=self.since_start(),
                        training_budget_s=train_end - t_train)
        steps = 10 ** 6  # until the probe fixes it: the schedule's first steps do not depend on it
        cfg = self.cfg(steps)
        lr = learning_rate(cfg)
        l1 = L1Controller(cfg)
        gate, step_s, s, stopped = 0.0, None, 0, None
        probe, window_t, window_n, pending = [], time.time(), 0, []
        snapshot_at = eval_at = fatrelu_at = None
        while s < steps:
            now = time.time()
            if step_s is not None and now + 1.5 * step_s > train_end:
                stopped = "deadline"
                break
            if s == fatrelu_at and a.fatrelu_kl_rise > 0:
                gate = self.calibrate_fatrelu(s)
            if s == snapshot_at:
                self.write(final=False)
                self.note(f"snapshot written at step {s}")
            if eval_at and s in eval_at:
                self.evaluate(f"step_{s}", gate=gate)
            t0 = time.perf_counter()
            try:
                self.params, self.opt_state, m = self.step(
                    self.params, self.opt_state, self.frozen, self.t_params, self.t_frozen,
                    jnp.asarray(data(s)), jnp.float32(lr(s)), jnp.float32(l1.coefficient(s)),
                    jnp.float32(gate))
                if s < PROBE_STEPS:
                    jax.block_until_ready(m)
            except Exception as e:  # noqa: BLE001 - only the first step's OOM is retried
                if s or self.batch < 2 or "RESOURCE_EXHAUSTED" not in str(e) or \
                        self.log.get("oom_restarts"):
                    raise
                self.restart_smaller()
                data, t_train = stream(), time.time()
                train_end = min(t_train + a.budget, self.stop_wall)
                continue
            if s < PROBE_STEPS:
                probe.append(time.perf_counter() - t0)
            if s % LOG_EVERY == 0:
                pending.append((s, m, float(lr(s)), l1.coefficient(s), gate))
            window_n += 1
            s += 1
            if s == PROBE_STEPS:
                step_s = float(np.median(probe[1:]))
                left = train_end - time.time() - 2 * a.eval_points - 10.0
                steps = max(s + 1, s + int(left / step_s))
                cfg = self.cfg(steps)
                lr = learning_rate(cfg)
                l1 = L1Controller(cfg, l1.state())
                snapshot_at = int(SNAPSHOT_AT * steps)
                fatrelu_at = cfg.fatrelu_step if cfg.fatrelu_step < steps else None
                eval_at = {int(steps * (i + 1) / (a.eval_points + 1))
                           for i in range(a.eval_points)}
                self.log.update(probe_step_s=probe, planned_steps=steps)
                self.note(f"step {step_s * 1e3:.0f} ms ({self.batch * a.seq_len / step_s:.0f} "
                          "tok/s)"
                          f": {steps} steps planned")
                window_t, window_n = time.time(), 0
            if pending or s == steps:  # sync every LOG_EVERY steps: the host stays close
                self._flush(pending)
                last = self.log["curve"][-1]
                l1.update(last["step"], last["sparsity"])  # steers the steps dispatched next
                last["l1_multiplier"] = l1.multiplier
                if window_n:
                    step_s = max(step_s or 0.0, (time.time() - window_t) / window_n)
                window_t, window_n = time.time(), 0
        self._flush(pending)
        self.log["l1_controller"] = l1.state()
        self.timer.add("train_loop", time.time() - t_train)  # evaluations etc. included
        done = s
        if a.fatrelu_kl_rise > 0 and "fatrelu" not in self.log:
            gate = self.calibrate_fatrelu(done)  # stopped before fatrelu_at: applied untrained
        tokens = done * self.batch * a.seq_len
        self.log.update(steps=done, stopped=stopped, tokens_trained=tokens,
                        tok_s=tokens / max(self.timer.parts["train_loop"], 1e-9),
                        corpus_passes=data.passes(done), fatrelu_threshold=gate or None,
                        config=self.cfg(done).to_dict())
        self.note(f"trained {done} steps ({tokens} tokens, {self.log['tok_s']:.0f} tok/s "
                  f"incl. evaluation), stopped: {stopped or 'planned end'}")
        self.evaluate("end_relu", gate=0.0)
        if gate:
            self.evaluate("end_fatrelu", gate=gate)
        log = self.write(final=True)
        if self.stop_wall + POST_TRAIN_S - time.time() > 10 and self.valid_ids is not None:
            self.evaluate_rebuilt(gate)  # what import-burst will see
            (self.out / burst_files.LOG).write_text(json.dumps(
                {**log, "eval": self.log["eval"], "timing": self.timer.parts,
                 "wall_s": self.since_start()}, indent=1))
        self.log.update(tensors=log["tensors"], shards=log["shards"])
        burst_files.check_limits(self.out)

    def _flush(self, pending: list) -> None:
        for s, m, lr, l1c, gate in pending:
            row = {k: float(v) for k, v in jax.device_get(m).items()}
            row.update(step=s, lr=lr, l1_coef=l1c, gate=gate)
            self.log["curve"].append(row)
        if pending and pending[-1][0] % (5 * LOG_EVERY) == 0:
            r = self.log["curve"][-1]
            self.note(f"step {r['step']}: loss {r['loss']:.4f} kl {r['kl']:.4f} "
                      f"sparsity {r['sparsity']:.4f} l1 {r['l1_coef']:.3g}")
        pending.clear()

    def evaluate_rebuilt(self, gate: float) -> None:
        """The student as import-burst rebuilds it from the written files (teacher + Q4_0
        delta), evaluated the same way."""
        params, _ = burst_files.read(self.out, self.ckpt.params, self.ckpt.config.n_layers)
        model = from_params(self.ckpt.config, params, kernels="xla")
        _, p, f = scan.split(model, self.args.train)
        self.evaluate("rebuilt_relu", p, f, 0.0)
        if gate:
            self.evaluate("rebuilt_fatrelu", p, f, gate)
