"""The distillation loop: the student learns the teacher's next-token distributions under its sparse
FFN, with JAX + optax under one jit per step, resumable orbax checkpoints and a progress bar.

Loss per step: KL(teacher || student) on the logits of every token, plus the L1 coefficient
(schedule.py: a ramp, or ProSparse's stages) times the student's mean |a| or mean gate activation
(`l1_on`), and `hidden_mse` times the residual streams' normalized squared error. With an online
teacher the teacher runs in the same step (exact KL over the whole vocabulary); with a cached one
(teacher_cache.py) the step gets the teacher's top-k log-probabilities and skips the teacher's
forward, about a fifth of a step on 2 cores (benchmarks/sparsify_throughput.jsonl).
"""
from __future__ import annotations

import math
import signal
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from powerinfer_jax.sparsify import forward as fw
from powerinfer_jax.sparsify.recipe import DistillConfig
from powerinfer_jax.sparsify.schedule import L1Controller, learning_rate

_NORMS = ("attn_norm", "ffn_norm", "final_norm")


def trainable(scope: str):
    """An nnx filter selecting the Params a `DistillConfig.train` scope trains."""

    def select(path, value) -> bool:
        if not isinstance(value, nnx.Param):
            return False
        names = {str(p) for p in path}
        if scope == "all":
            return True
        return "ffn" in names or (scope == "ffn+norms" and bool(names & set(_NORMS)))

    return select


def optimizer(cfg: DistillConfig) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(learning_rate(cfg), weight_decay=cfg.weight_decay))


class Timer:
    """Wall time per named part of a run (seconds), for the split the benchmark rows report."""

    def __init__(self, parts=None, counts=None):
        self.parts: dict[str, float] = dict(parts or {})
        self.counts: dict[str, int] = dict(counts or {})  # e.g. "steady_steps" timed in "step"

    def add(self, name: str, seconds: float) -> None:
        self.parts[name] = self.parts.get(name, 0.0) + seconds

    def section(self, name: str):
        timer = self

        class _Section:
            def __enter__(self):
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                timer.add(name, time.perf_counter() - self.t0)
                return False

        return _Section()

    def total(self) -> float:
        return sum(self.parts.values())


class Distiller:
    """Owns the split student (trainable / frozen state), the teacher and the jitted step.

    teacher: the dense model (kernels="xla"); None with cfg.teacher == "cached", where each step
    gets the teacher's top-k log-probabilities with its batch instead of running the teacher.
    gate_threshold: FATReLU's threshold for relu/drelu students (0: plain ReLU), an argument of
    the jitted step (setting it does not recompile).
    """

    def __init__(self, student, teacher, cfg: DistillConfig):
        kinds = (student.kernels, "xla" if teacher is None else teacher.kernels)
        if kinds != ("xla", "xla"):
            raise ValueError("Distiller: expected models built with kernels='xla' (custom calls "
                             f"have no gradient), got {kinds[0]!r}/{kinds[1]!r}")
        if (teacher is None) != (cfg.teacher == "cached"):
            raise ValueError(f"Distiller: expected a teacher model exactly when --teacher is "
                             f"online, got teacher={type(teacher).__name__} with {cfg.teacher!r}")
        self.cfg = cfg
        self.student_spec = fw.student_spec(student.config, cfg.variant, cfg.target_sparsity,
                                            mask_by=cfg.mask_by, ste=cfg.ste)
        self.teacher_spec = fw.teacher_spec(student.config)
        self.graphdef, self.params, self.frozen = nnx.split(student, trainable(cfg.train), ...)
        self.t_graphdef, self.t_state = (None, None) if teacher is None else nnx.split(teacher)
        self.opt = optimizer(cfg)
        self.opt_state = self.opt.init(self.params)
        self.gate_threshold = 0.0
        self.l1 = L1Controller(cfg)  # its state goes into the record saved with checkpoints
        self.timer = Timer()
        self._step = jax.jit(self._make_step(), donate_argnums=(0, 1))

    def _make_step(self):
        cfg, graphdef, t_graphdef = self.cfg, self.graphdef, self.t_graphdef
        s_spec, t_spec, opt = self.student_spec, self.teacher_spec, self.opt
        dtype = jnp.dtype(cfg.compute_dtype)
        mse = cfg.hidden_mse > 0
        l1_key = "l1_gate" if cfg.l1_on == "gate" else "l1"

        def step(params, opt_state, frozen, t_state, batch, l1_coef, gate_threshold):
            tokens_bt = batch["tokens"]
            if t_state is not None:
                t_logits, t_aux = fw.forward(nnx.merge(t_graphdef, t_state), tokens_bt, t_spec,
                                             compute_dtype=dtype, collect_hidden=mse)

            def loss_fn(p):
                s_logits, aux = fw.forward(nnx.merge(graphdef, p, frozen), tokens_bt, s_spec,
                                           compute_dtype=dtype, remat=cfg.remat,
                                           collect_hidden=mse, gate_threshold=gate_threshold)
                if t_state is None:
                    kl = fw.topk_kl(batch["ids"], batch["logp"], s_logits)
                else:
                    kl = fw.kl_divergence(t_logits, s_logits)
                l1 = jnp.mean(aux[l1_key])
                h = fw.hidden_mse(t_aux["hidden"], aux["hidden"]) if mse else jnp.float32(0)
                loss = kl + l1_coef * l1 + cfg.hidden_mse * h
                return loss, {"loss": loss, "kl": kl, "l1": l1, "mse": h,
                              "sparsity": jnp.mean(aux["zero_frac"])}

            grads, metrics = jax.grad(loss_fn, has_aux=True)(params)
            updates, opt_state = opt.update(grads, opt_state, params)
            metrics["grad_norm"] = optax.tree.norm(grads)
            return optax.apply_updates(params, updates), opt_state, metrics

        return step

    def step(self, batch, step: int) -> dict:
        """One optimizer step on a batch (tokens [B, T], or a dict with "tokens" and, for a cached
        teacher, its "ids" and "logp" [B, T, k]); returns its metrics as floats."""
        batch = {"tokens": batch} if not isinstance(batch, dict) else batch
        if self.cfg.teacher == "cached" and not {"ids", "logp"} <= set(batch):
            raise ValueError("Distiller.step: expected the teacher's top-k ('ids', 'logp') with "
                             f"--teacher cached, got {sorted(batch)}")
        coef = self.l1.coefficient(step)
        self.params, self.opt_state, m = self._step(
            self.params, self.opt_state, self.frozen, self.t_state,
            {k: jnp.asarray(v) for k, v in batch.items()}, jnp.float32(coef),
            jnp.float32(self.gate_threshold))
        out = {k: float(v) for k, v in m.items()}
        out["l1_coef"] = coef
        self.l1.observe(step, out["sparsity"])
        return out

    def student(self):
        """The student as a model (sharing the current arrays)."""
        return nnx.merge(self.graphdef, self.params, self.frozen)

    def run(self, batches: Callable[[int], object], *, start_step: int = 0,
            stop_step: int | None = None, checkpoints=None, record: dict | None = None,
            save_every: int = 50, progress: bool = True,
            on_step: Callable[[int, dict], None] | None = None, eval_every: int = 0,
            on_eval: Callable[[int], None] | None = None,
            before_step: Callable[[int], None] | None = None,
            on_pause: Callable[[int], None] | None = None,
            deadline: float | None = None) -> dict:
        """Train steps [start_step, stop_step or cfg.steps). Saves every `save_every` steps, at the
        end, and on an interrupt: Ctrl-C or SIGTERM stop the loop after the running step, save it
        and raise KeyboardInterrupt (a second one stops at once, unsaved). Saves run in the
        background (checkpoints.save(..., wait=False)) and are finished before the next one and
        before this returns. before_step(step) runs before each step (FATReLU's calibration);
        on_step(step, metrics) after each; on_eval(steps_done) every `eval_every` steps;
        on_pause(steps_done) when it stops before the last step (not interrupted), before the
        final save (so what it adds to the record is saved).
        deadline: a time.monotonic() value: no step starts that would end past it (judged by the
        slowest step so far) and the run stops there, saved, as a budgeted piece of a longer run;
        the call's first step runs whatever the deadline, so that a piece whose set-up (load,
        refit, evaluation) took its whole budget still saves what it did and the next piece
        does not start over.
        Time goes to self.timer: "data" (batches, teacher cache), "first_step" (the first step
        of the call, compilation included), "step" (the others; counted in
        timer.counts["steady_steps"]), "checkpoint", "fatrelu" (before_step).
        Returns {"steps": steps done in all, "train_s", "first_step_s", "stopped"}."""
        cfg = self.cfg
        stop = cfg.steps if stop_step is None else min(stop_step, cfg.steps)
        tokens_per_step = cfg.batch * cfg.seq_len
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=cfg.steps, initial=start_step, desc=f"sparsify {cfg.variant}",
                       unit="step", dynamic_ncols=True)
        done = start_step
        wall = {"train_s": 0.0, "first_step_s": None, "stopped": None}
        slowest = 0.0
        timer = self.timer

        def save(wait: bool) -> None:
            if record is not None:
                record["l1_controller"] = self.l1.state()
            with timer.section("checkpoint"):
                checkpoints.save(done, self.params, self.opt_state, record, wait=wait)

        try:
            with StopRequests() as stop_requested:
                for s in range(start_step, stop):
                    if before_step is not None:
                        with timer.section("fatrelu"):
                            before_step(s)
                    t0 = time.perf_counter()
                    if (deadline is not None and s > start_step
                            and time.monotonic() + slowest > deadline):
                        wall["stopped"] = "deadline"
                        break
                    teacher_s = timer.parts.get("teacher", 0.0)  # a cache fill counts there
                    batch = batches(s)
                    t1 = time.perf_counter()
                    m = self.step(batch, s)
                    dt = time.perf_counter() - t1
                    timer.add("data", t1 - t0 - (timer.parts.get("teacher", 0.0) - teacher_s))
                    if wall["first_step_s"] is None:  # compiles (once per call of run)
                        timer.add("first_step", dt)
                    else:
                        timer.add("step", dt)
                        timer.counts["steady_steps"] = timer.counts.get("steady_steps", 0) + 1
                    if not math.isfinite(m["loss"]):
                        raise FloatingPointError(f"training loss: expected a finite value, got "
                                                 f"{m['loss']} at step {s} (lower --lr)")
                    done = s + 1
                    wall["train_s"] += dt
                    if wall["first_step_s"] is None:
                        wall["first_step_s"] = dt  # includes compilation
                    else:
                        slowest = max(slowest, time.perf_counter() - t0)
                    m["tok_s"] = tokens_per_step / dt
                    if bar is not None:
                        bar.set_postfix(loss=f"{m['loss']:.4f}", kl=f"{m['kl']:.4f}",
                                        sparsity=f"{m['sparsity']:.3f}",
                                        tok_s=f"{m['tok_s']:.0f}")
                        bar.update(1)
                    if on_step is not None:
                        on_step(s, m)
                    if stop_requested():
                        raise KeyboardInterrupt
                    if checkpoints is not None and done % save_every == 0 and done < stop:
                        save(wait=False)
                    if on_eval is not None and eval_every and done % eval_every == 0 \
                            and done < cfg.steps:
                        on_eval(done)  # its own time is the caller's to count
        except KeyboardInterrupt as e:
            if checkpoints is not None and done > start_step and not isinstance(e, ForcedStop):
                save(wait=True)
                msg = (f"interrupted: saved step {done} to {checkpoints.directory}; rerun with "
                       "--resume to continue")
                if bar is not None:
                    bar.write(msg)
                else:
                    print(msg, file=sys.stderr, flush=True)
            raise
        finally:
            if bar is not None:
                bar.close()
        if on_pause is not None and start_step < done < cfg.steps:
            on_pause(done)
        if checkpoints is not None and done > start_step:
            save(wait=True)
        return {"steps": done, **wall}


class ForcedStop(KeyboardInterrupt):
    """A second Ctrl-C/SIGTERM: stop at once, without saving (a step may be half applied)."""


class StopRequests:
    """Within the block, the first SIGINT/SIGTERM only records a request, which the training loop
    honours between steps (a step's new weights are assigned before its results are read, so an
    exception in the middle would save weights one step ahead of the step count); a second one
    raises ForcedStop. Calling the object says whether a stop was requested. Off the main thread
    (no signal handlers there) it never is."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.requested = False
        self._previous = {}

    def __call__(self) -> bool:
        return self.requested

    def _handle(self, signum, frame):
        if self.requested:
            raise ForcedStop
        self.requested = True

    def __enter__(self):
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, previous in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        return False
