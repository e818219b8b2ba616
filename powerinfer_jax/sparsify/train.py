"""The distillation loop: the student learns the teacher's next-token distributions under its sparse
FFN, with JAX + optax under one jit per step, resumable orbax checkpoints and a progress bar.

Loss per step: KL(teacher || student) on the logits of every token, plus `l1` (ramped) times the
student's mean |a| and `hidden_mse` times the residual streams' normalized squared error. The
teacher runs in the same step (exact KL over the whole vocabulary). Caching the teacher's top-k
logits instead was measured not worth it here: the teacher's forward is about a fifth of a step.
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
from powerinfer_jax.sparsify.config import DistillConfig

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


def learning_rate(cfg: DistillConfig):
    """Linear warm-up to cfg.lr, then cosine decay to cfg.lr * lr_final_fraction at the last step."""
    warm = min(cfg.warmup_steps, max(cfg.steps - 1, 0))
    decay = optax.cosine_decay_schedule(cfg.lr, max(cfg.steps - warm, 1), cfg.lr_final_fraction)
    if warm == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(cfg.lr / warm, cfg.lr, warm), decay], [warm])


def optimizer(cfg: DistillConfig) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(learning_rate(cfg), weight_decay=cfg.weight_decay))


def l1_coefficient(cfg: DistillConfig, step: int) -> float:
    """cfg.l1 ramped linearly from 0 over the first l1_warmup of the steps."""
    ramp = cfg.l1_warmup * cfg.steps
    return cfg.l1 if ramp <= 0 else cfg.l1 * min(1.0, (step + 1) / ramp)


class Distiller:
    """Owns the split student (trainable / frozen state), the teacher and the jitted step."""

    def __init__(self, student, teacher, cfg: DistillConfig):
        if student.kernels != "xla" or teacher.kernels != "xla":
            raise ValueError("Distiller: expected models built with kernels='xla' (custom calls "
                             "have no gradient), got " f"{student.kernels!r}/{teacher.kernels!r}")
        self.cfg = cfg
        self.student_spec = fw.student_spec(student.config, cfg.variant, cfg.target_sparsity,
                                            mask_by=cfg.mask_by, ste=cfg.ste)
        self.teacher_spec = fw.teacher_spec(teacher.config)
        self.graphdef, self.params, self.frozen = nnx.split(student, trainable(cfg.train), ...)
        self.t_graphdef, self.t_state = nnx.split(teacher)
        self.opt = optimizer(cfg)
        self.opt_state = self.opt.init(self.params)
        self._step = jax.jit(self._make_step(), donate_argnums=(0, 1))

    def _make_step(self):
        cfg, graphdef, t_graphdef = self.cfg, self.graphdef, self.t_graphdef
        s_spec, t_spec, opt = self.student_spec, self.teacher_spec, self.opt
        dtype = jnp.dtype(cfg.compute_dtype)
        mse = cfg.hidden_mse > 0

        def step(params, opt_state, frozen, t_state, tokens_bt, l1_coef):
            t_logits, t_aux = fw.forward(nnx.merge(t_graphdef, t_state), tokens_bt, t_spec,
                                         compute_dtype=dtype, collect_hidden=mse)

            def loss_fn(p):
                s_logits, aux = fw.forward(nnx.merge(graphdef, p, frozen), tokens_bt, s_spec,
                                           compute_dtype=dtype, remat=cfg.remat,
                                           collect_hidden=mse)
                kl = fw.kl_divergence(t_logits, s_logits)
                l1 = jnp.mean(aux["l1"])
                h = fw.hidden_mse(t_aux["hidden"], aux["hidden"]) if mse else jnp.float32(0)
                loss = kl + l1_coef * l1 + cfg.hidden_mse * h
                return loss, {"loss": loss, "kl": kl, "l1": l1, "mse": h,
                              "sparsity": jnp.mean(aux["zero_frac"])}

            grads, metrics = jax.grad(loss_fn, has_aux=True)(params)
            updates, opt_state = opt.update(grads, opt_state, params)
            metrics["grad_norm"] = optax.tree.norm(grads)
            return optax.apply_updates(params, updates), opt_state, metrics

        return step

    def step(self, tokens_bt: np.ndarray, step: int) -> dict:
        """One optimizer step on a batch; returns its metrics as floats."""
        self.params, self.opt_state, m = self._step(
            self.params, self.opt_state, self.frozen, self.t_state, jnp.asarray(tokens_bt),
            jnp.float32(l1_coefficient(self.cfg, step)))
        return {k: float(v) for k, v in m.items()}

    def student(self):
        """The student as a model (sharing the current arrays)."""
        return nnx.merge(self.graphdef, self.params, self.frozen)

    def run(self, batches: Callable[[int], np.ndarray], *, start_step: int = 0,
            stop_step: int | None = None, checkpoints=None, record: dict | None = None,
            save_every: int = 50,
            progress: bool = True, on_step: Callable[[int, dict], None] | None = None,
            eval_every: int = 0, on_eval: Callable[[int], None] | None = None) -> dict:
        """Train steps [start_step, stop_step or cfg.steps). Saves every `save_every` steps, at the
        end, and on an interrupt: Ctrl-C or SIGTERM stop the loop after the running step, save it
        and raise KeyboardInterrupt (a second one stops at once, unsaved). on_step(step, metrics) after each step; on_eval(steps_done) every `eval_every` steps.
        Returns {"steps": steps done in all, "train_s", "first_step_s"}."""
        cfg = self.cfg
        stop = cfg.steps if stop_step is None else min(stop_step, cfg.steps)
        tokens_per_step = cfg.batch * cfg.seq_len
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=cfg.steps, initial=start_step, desc=f"sparsify {cfg.variant}",
                       unit="step", dynamic_ncols=True)
        done = start_step
        wall = {"train_s": 0.0, "first_step_s": None}
        try:
            with StopRequests() as stop_requested:
                for s in range(start_step, stop):
                    t0 = time.perf_counter()
                    m = self.step(batches(s), s)
                    dt = time.perf_counter() - t0
                    if not math.isfinite(m["loss"]):
                        raise FloatingPointError(f"training loss: expected a finite value, got "
                                                 f"{m['loss']} at step {s} (lower --lr)")
                    done = s + 1
                    wall["train_s"] += dt
                    if wall["first_step_s"] is None:
                        wall["first_step_s"] = dt  # includes compilation
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
                        checkpoints.save(done, self.params, self.opt_state, record)
                    if on_eval is not None and eval_every and done % eval_every == 0 \
                            and done < cfg.steps:
                        on_eval(done)
        except KeyboardInterrupt as e:
            if checkpoints is not None and done > start_step and not isinstance(e, ForcedStop):
                checkpoints.save(done, self.params, self.opt_state, record)
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
        if checkpoints is not None and done > start_step:
            checkpoints.save(done, self.params, self.opt_state, record)
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
