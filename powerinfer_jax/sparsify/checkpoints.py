"""Resumable training state on disk (orbax): the trainable weights, the optimizer state and the
step, with a JSON record of the model and run they belong to.

The state is saved as flat lists of arrays (the pytrees' leaves in a fixed order); the caller
restores them into the structure it rebuilt from the same config. A checkpoint of another model
(fingerprint) or another run config is refused with the difference named.
"""
from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from powerinfer_jax.errors import fail

# Fields of the run record that may differ on resume: how and how often the run reports and
# saves does not change what it computes.
_FREE_FIELDS = ("progress",)


class TrainCheckpoints:
    """The checkpoints of one run in `directory`; only the latest is kept."""

    def __init__(self, directory: str | Path):
        import orbax.checkpoint as ocp

        self.directory = Path(directory).resolve()
        self._ocp = ocp
        self._manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=1, create=True))

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, params, opt_state, record: dict, *, wait: bool = True) -> None:
        """Save `step`. wait=False returns once the arrays are copied to host memory (~1 s for
        SmolLM2's FFN and AdamW state, ~1 GB) and writes them in the background (~6 s here);
        the next save, restore or close waits for it. The copies are made here because the
        training step donates (frees) the arrays it is given."""
        ocp = self._ocp
        self._manager.wait_until_finished()
        state = {"params": _leaves(params, copy=True), "opt": _leaves(opt_state, copy=True)}
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), record=ocp.args.JsonSave({**record,
                                                                          "step": step})),
                           force=True)
        if wait:
            self._manager.wait_until_finished()

    def read_record(self, step: int) -> dict:
        ocp = self._ocp
        self._manager.wait_until_finished()
        return self._manager.restore(step, args=ocp.args.Composite(
            record=ocp.args.JsonRestore()))["record"]

    def restore(self, step: int, params_like, opt_like, record: dict):
        """(params, opt_state) of `step`, shaped like the given pytrees, after checking that the
        saved record matches `record` (same model fingerprint and run config)."""
        ocp = self._ocp
        saved = self.read_record(step)
        check_record(saved, record, self.directory)
        abstract = {"params": _leaves(params_like, abstract=True),
                    "opt": _leaves(opt_like, abstract=True)}
        got = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract)))["state"]
        return _unflatten(params_like, got["params"]), _unflatten(opt_like, got["opt"])

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def check_record(saved: dict, want: dict, directory: Path) -> None:
    """The saved run must be of the same model and config (except reporting fields)."""
    if saved.get("fingerprint") != want.get("fingerprint"):
        fail(f"--resume checkpoint {directory}", f"one of model {want.get('fingerprint')}",
             saved.get("fingerprint"), "it was trained from another model: pass --no-resume "
             "with --force to start over, or another --out")
    a = {k: v for k, v in saved.get("config", {}).items() if k not in _FREE_FIELDS}
    b = {k: v for k, v in want.get("config", {}).items() if k not in _FREE_FIELDS}
    diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    if diff:
        fail(f"--resume checkpoint {directory}", "the same run config",
             {k: (a.get(k), b.get(k)) for k in diff},
             "(saved, asked) differ; rerun with the saved settings or --force to start over")


def _leaves(tree, abstract: bool = False, copy: bool = False) -> dict:
    leaves = jax.tree.leaves(tree)
    if abstract:
        return {f"{i:05d}": jax.ShapeDtypeStruct(np.shape(x), x.dtype) for i, x in enumerate(leaves)}
    if copy:
        return {f"{i:05d}": np.array(x, copy=True) for i, x in enumerate(leaves)}
    return {f"{i:05d}": x for i, x in enumerate(leaves)}


def _unflatten(like, flat: dict):
    treedef = jax.tree.structure(like)
    return jax.tree.unflatten(treedef, [flat[k] for k in sorted(flat)])
