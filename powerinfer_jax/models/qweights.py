"""Weights kept in a GGUF block format inside the model (the user's file, computed on as it is
stored), and the one place where their layouts are chosen and converted.

A quantized matrix is a `QWeight`: the file's blocks (uint8), their GGML format (`qtype`, the
file's name: "Q4_0", never a renamed one) and a layout, chosen once for how the kernel that reads
the matrix reads it:
  MATVEC  read whole, y = W x (ops.qlinear): the rows interleaved by 16 where the format has that
          layout (`interleaved`; quants.interleave), else the file's rows. For the FFN's down
          projection: the file's ffn_down [D, F] (blocked along F), computed as a matvec of a.
  ROWS    read one row at a time, a selector's neurons: the file's rows. For the down
          projection: neuron rows [F, D] blocked along D (re-blocked, in `FfnLayout.down_qtype`).
  GROUPS  the down projection only: the file's ffn_down blocks regrouped per 32 neurons
          (quants.down_groups): read per active neuron, nothing re-quantized.
  COLUMNS input-channel-major (quants: the columns layout, cpu_backend/qcolumns.h): a matvec
          that reads only the weights of its input's nonzero channels (input sparsity), nothing
          re-quantized. For the down projection: the file's ffn_down [D, F], its inputs the F
          neurons. A matrix whose format or size has no columns layout stays MATVEC.
The build plan picks each FFN's layouts from its sparsity mode (`FfnLayout`, sparsity/modes.py)
before loading and `arrange` makes them from the file's tensors, once: nothing converts a built
model's layout back (a model configured for a mode its layouts do not serve is refused,
`check_ffn_layout`; load it for that mode). Modules (models/layers.py Linear, models/ffn.py
DownT) take a QWeight as it is and never convert.
ops.qlinear and ops.qsparse_ffn compute on the blocks with 8-bit activations, as llama.cpp does.
The token embedding is looked up by dequantizing only the gathered rows.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np

from powerinfer_jax.checkpoint.base import aligned, aligned_empty
from powerinfer_jax.errors import check_choice, fail

_BLOCK = 32

MATVEC, ROWS, GROUPS, COLUMNS = "matvec", "rows", "groups", "columns"
LAYOUTS = (MATVEC, ROWS, GROUPS, COLUMNS)
DOWN_ROWS_QTYPE = "Q8_0"  # down rows re-blocked per neuron: near-lossless, 8.5 bits a weight


@dataclasses.dataclass(frozen=True)
class QWeight:
    """A matrix in a GGUF block format, arranged for the kernel that reads it (module doc)."""

    blocks: object  # uint8 [rows, row_bytes] (numpy, or the model's array)
    qtype: str  # the blocks' GGML format ("Q4_0", ...)
    layout: str  # MATVEC | ROWS | GROUPS | COLUMNS
    interleaved: bool = False  # MATVEC rows interleaved by 16

    @property
    def kernel_qtype(self) -> str:
        """The type name the custom calls take ("Q4_0x16" for interleaved rows, "Q4_0c64" for
        the columns layout, "Q4_0g32" for down groups)."""
        return kernel_type(self.qtype, self.layout, self.interleaved)


def kernel_type(qtype: str, layout: str, interleaved: bool) -> str:
    """The one map from (format, layout) to the type name the custom calls take."""
    from powerinfer_jax.checkpoint import quants  # lazy: start-up (gguf only for GGUF files)

    if layout == COLUMNS:
        return qtype + quants.COLUMNS_SUFFIX
    if layout == GROUPS:
        return qtype + quants.GROUPS_SUFFIX
    return qtype + quants.INTERLEAVED_SUFFIX if interleaved else qtype


@dataclasses.dataclass(frozen=True)
class FfnLayout:
    """How one FFN's quantized matrices are arranged: gate and up MATVEC (every neuron computed:
    dense, the oracle) or ROWS (a selector's neurons read one by one); down MATVEC (dense),
    GROUPS or ROWS (in `down_qtype`, None: DOWN_ROWS_QTYPE)."""

    gate: str = MATVEC
    up: str = MATVEC
    down: str = MATVEC
    down_qtype: str | None = None
    attention: str = MATVEC  # q, k, v and o: MATVEC or COLUMNS (input sparsity)
    # an MoE layer's stacked experts (models/moe.py Stacked): None, the layouts the experts take
    # for their activation (matvec; a relu expert's up rows and down groups), or COLUMNS
    experts: str | None = None

    def __post_init__(self):
        check_choice("FfnLayout.gate", self.gate, (MATVEC, ROWS, COLUMNS))
        check_choice("FfnLayout.up", self.up, (MATVEC, ROWS, COLUMNS))
        check_choice("FfnLayout.down", self.down, LAYOUTS)
        check_choice("FfnLayout.attention", self.attention, (MATVEC, COLUMNS))
        check_choice("FfnLayout.experts", self.experts, (None, COLUMNS))


DENSE_LAYOUT = FfnLayout()
# A selector's neurons: gate and up rows read one by one, down rows per active neuron.
SELECTED_LAYOUT = FfnLayout(gate=ROWS, up=ROWS, down=GROUPS)
# Input sparsity: every matrix of a block reads only its input's nonzero channels.
INPUTS_LAYOUT = FfnLayout(gate=COLUMNS, up=COLUMNS, down=COLUMNS, attention=COLUMNS,
                          experts=COLUMNS)


def arrange(t, layout: str, *, down_qtype: str | None = None, load: _Load | None = None
            ) -> QWeight:
    """A file tensor (checkpoint.base.QuantTensor) in `layout`: the one conversion from the
    file's blocks. ffn_down as the file stores it (t.transposed) takes MATVEC, GROUPS (where its
    format has down groups, else ROWS) or ROWS (re-blocked per neuron in `down_qtype`); a
    neuron-major tensor (every other matrix, PowerInfer's ffn_down_t) MATVEC or ROWS.
    load: the model's `batched_load`, if any (copies made ahead, file pages dropped at its end)."""
    from powerinfer_jax.checkpoint import quants  # lazy: start-up (gguf only for GGUF files)

    if layout not in LAYOUTS:
        fail("weight layout", f"one of {list(LAYOUTS)}", layout)
    if layout == COLUMNS:
        w = columns(t.blocks, t.qtype, load)
        return w if w is not None else arrange(t, MATVEC, load=load)  # no such layout: whole
    if t.transposed:
        if layout == GROUPS and t.qtype in quants.DOWN_GROUP_TYPES:
            groups = t.down_groups()
            release_later(t.blocks, load)  # the file's ffn_down pages were read once for the copy
            return QWeight(groups, t.qtype, GROUPS)
        if layout in (GROUPS, ROWS):
            rows = t.reblocked(down_qtype or DOWN_ROWS_QTYPE)
            release_later(t.blocks, load)  # the file's ffn_down pages were read once for the copy
            return QWeight(rows.blocks, rows.qtype, ROWS)
    elif layout == GROUPS:  # neuron rows already (a PowerInfer file's ffn_down_t)
        return QWeight(t.blocks, t.qtype, ROWS)
    if layout == MATVEC:
        blocks, qtype = interleaved(t.blocks, t.qtype, load)
        return QWeight(blocks, t.qtype, MATVEC, interleaved=qtype != t.qtype)
    return QWeight(t.blocks, t.qtype, ROWS)


def serves(have: FfnLayout | None, want: FfnLayout) -> bool:
    """Whether an FFN arranged as `have` (FFN.layout; None: float weights) reads its matrices as
    a mode that wants `want` does. Down rows serve where groups were asked for (a format without
    down groups gets rows), and rows in any format serve a mode that names none."""
    if have is None:
        return True  # float weights have no layout

    def reads(h, w):  # a matrix with no columns layout (its format or size) is read whole
        return h == w or (w == COLUMNS and h == MATVEC)

    if not (reads(have.gate, want.gate) and reads(have.up, want.up)):
        return False
    if have.down == ROWS:
        return want.down in (ROWS, GROUPS) and want.down_qtype in (None, have.down_qtype)
    return reads(have.down, want.down)


def check_ffn_layout(ffn, want: FfnLayout, what: str) -> None:
    """Fail unless the built FFN `ffn` is arranged as `want` (`serves`): a model's layouts are
    decided before its weights are read, never converted after (this module's doc)."""
    have = ffn.layout
    if have is not None and ffn.gate is None:  # no gate (a non-gated FFN): nothing to compare
        want = dataclasses.replace(want, gate=have.gate)
    if not serves(have, want):
        fail(f"{what}: the FFN's weight layout", f"gate/up/down {want.gate}/{want.up}/"
             f"{want.down}", f"{have.gate}/{have.up}/{have.down}",
             "load the model for this mode (runtime.session.build, or "
             "models.transformer.from_params(..., ffn_layout=sparsity.modes.ffn_layout(cfg, "
             "config)))")


def host_blocks(blocks) -> jax.Array:
    """Blocks (uint8 [rows, row_bytes]) as the model's array. XLA's CPU client keeps a 64-byte
    aligned host array as it is instead of copying it, so a loaded file's bytes are in memory
    once, not twice (SmolLM2's Q4_1: ~0.05 s less load and ~98 MB less resident). The numpy
    array is made read-only: the model's weights now live in it."""
    view = np.asarray(blocks, np.uint8)
    host = aligned(view)
    if host is not view and view.nbytes >= _RELEASE_MIN:
        # a copy of a file view (an offset off the 64-byte boundary, as in PowerInfer's GGUFs):
        # the file's pages were read once for it. Dropped now, not at the end of the load: the
        # 7B PowerInfer GGUF's in-memory load held 2.6 GB of them beside its 4.0 GB of copies
        # (peak 6.6 GB for a 3.9 GB file), over a memory limit of the file's size.
        from powerinfer_jax.checkpoint.gguf_file import release_mapped_pages  # lazy: start-up

        release_mapped_pages(view)
    host.flags.writeable = False
    return jax.device_put(host, may_alias=True)


_RELEASE_MIN = 1 << 20  # smaller copies' pages are left as they are


class _Load:
    """One model's load (`batched_load`): the file views whose pages leave the resident set at
    the end, and the interleaved copies made ahead on the pool while Python builds the model."""

    def __init__(self):
        self.pending: list = []
        self._ahead: dict[int, tuple] = {}  # id(file blocks) -> (file blocks, copy, its qtype)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.stats = {"ahead": 0, "claimed": 0, "released": 0}

    def interleave_ahead(self, tensors) -> None:
        """Start interleaving (blocks, qtype) pairs on the pool, from a thread whose calls
        (`_pij_ext.interleave_many`, one per tensor) hold no GIL, each file view's pages dropped
        once its copy is made; `interleaved` hands each copy out when asked for it.
        Without quantized tensors it imports nothing: a float model builds without the compiled
        extension (an accelerator without it, e.g. benchmarks/gpu/burst.py)."""
        self.finish()  # one batch on the pool at a time
        jobs = []
        for blocks, qtype in tensors:
            job = _interleave_job(blocks, qtype) if id(blocks) not in self._ahead else None
            if job is not None:
                self._ahead[id(blocks)] = (blocks, job[2], job[3])
                jobs.append(job[:3])
        if not jobs:
            return
        # lazy: start-up (gguf only for GGUF files)
        from powerinfer_jax.checkpoint.gguf_file import file_page_spans, release_spans
        from powerinfer_jax.ops import _ffi  # lazy: optional C++ extension

        self.stats["ahead"] += len(jobs)
        # each file view's pages leave the resident set as soon as its copy is made, not at the
        # end: else the whole file and all the copies are resident together at the load's peak
        # (2.2x a 7B Q4_0 file). The rows are read only for the copy.
        spans = file_page_spans(*(job[0] for job in jobs))

        def run():
            try:
                for job, span in zip(jobs, spans):
                    _ffi._pij_ext.interleave_many([job])
                    if span is not None:
                        release_spans([span])
                        self.stats["released"] += span[1] - span[0]
            except BaseException as e:  # re-raised where a copy is taken
                self._error = e

        self._thread = threading.Thread(target=run, name="pij-interleave", daemon=True)
        self._thread.start()

    def take(self, blocks):
        """(copy, qtype) made ahead for `blocks` (waiting for the pool), or None."""
        entry = self._ahead.get(id(blocks))
        if entry is None or entry[0] is not blocks:
            return None
        del self._ahead[id(blocks)]
        self.finish()
        self.stats["claimed"] += 1  # (its file pages: released by the pool once it was made)
        return entry[1], entry[2]

    def finish(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


@contextlib.contextmanager
def batched_load():
    """One model's load: yields the `_Load` whose `interleave_ahead` starts the copies early;
    given it, `arrange` and `interleaved` take those copies and keep the file rows they read,
    dropping their pages from the resident set once at the end (one read of the process's
    mappings for a whole model; the arrays stay alive until then, so their mappings do too)."""
    # lazy: start-up (gguf only for GGUF files)
    from powerinfer_jax.checkpoint.gguf_file import release_mapped_pages

    load = _Load()
    try:
        yield load
        load.finish()
    finally:
        if load._thread is not None:  # an error left the pool writing: wait for it
            load._thread.join()
        release_mapped_pages(*load.pending)


def release_later(array, load: _Load | None = None) -> None:
    """Drop a file view's pages from the resident set (gguf_file.release_mapped_pages): now, or
    at the end of `load` (a `batched_load`)."""
    # lazy: start-up (gguf only for GGUF files)
    from powerinfer_jax.checkpoint.gguf_file import release_mapped_pages

    if load is None:
        release_mapped_pages(array)
    else:
        load.pending.append(array)


def interleaved(blocks, qtype: str, load: _Load | None = None):
    """(blocks, qtype) with the rows interleaved by 16 where the format and row count allow
    (checkpoint.quants.interleave: ops.qlinear's fastest layout, the same bytes rearranged; the
    type becomes e.g. "Q4_0x16"), else as given. Given a `batched_load`, a copy its
    `interleave_ahead` started is taken, not made again."""
    ready = load.take(blocks) if load is not None else None
    if ready is not None:
        return ready
    job = _interleave_job(blocks, qtype)
    if job is None:
        return blocks, qtype
    from powerinfer_jax.ops import _ffi  # lazy: optional C++ extension

    _ffi._pij_ext.interleave_into(*job[:3])
    release_later(blocks, load)  # the file's rows were read once to build the copy
    return job[2], job[3]


def _interleave_job(blocks, qtype: str):
    """(file rows, type id, empty copy, the copy's qtype) for `_pij_ext.interleave_into`, or None
    where the format or row count has no interleaved layout."""
    from powerinfer_jax.checkpoint import quants  # lazy: start-up (gguf only for GGUF files)

    b = np.asarray(blocks)
    if not quants.can_interleave(qtype, b.shape[0]):
        return None
    out = aligned_empty(b.shape, np.uint8)  # host_blocks keeps it as it is
    return (np.ascontiguousarray(b, np.uint8), quants.type_id(qtype), out,
            qtype + quants.INTERLEAVED_SUFFIX)


def columns(blocks, qtype: str, load: _Load | None = None) -> QWeight | None:
    """The file's rows (uint8 [O, row_bytes], any [O, I] matrix as stored, ffn_down included)
    arranged in the columns layout on the kernels' pool, or None where the format or the row
    count has none (quants.can_columns)."""
    from powerinfer_jax.checkpoint import quants  # lazy: start-up (gguf only for GGUF files)

    b = np.asarray(blocks)
    block, nbytes = quants.block_size(qtype)
    cols = b.shape[1] // nbytes * block
    if not quants.can_columns(qtype, b.shape[0], cols):
        return None
    from powerinfer_jax.ops import _ffi  # lazy: optional C++ extension

    out = aligned_empty((b.shape[0], quants.columns_row_bytes(qtype, b.shape[0], cols)), np.uint8)
    _ffi._pij_ext.arrange_columns(np.ascontiguousarray(b, np.uint8), quants.type_id(qtype), cols,
                                  out)
    release_later(blocks, load)  # the file's rows were read once to build the copy
    return QWeight(out, qtype, COLUMNS)


def gather_rows(table, ids, qtype: str):
    """Rows `ids` of a block table uint8 [O, row_bytes] -> uint8 [..., row_bytes] in the file's
    layout (a table interleaved by 16 gives each id's group, then its lane's bytes)."""
    from powerinfer_jax.checkpoint import quants  # lazy: start-up (gguf only for GGUF files)

    base = quants.interleaved_base(qtype)
    if base is None:
        return table[ids]
    nbytes = quants.block_size(base)[1]
    o, row_bytes = table.shape
    g = quants.INTERLEAVE
    groups = table.reshape(o // g, row_bytes // nbytes, g * nbytes)[ids // g]  # [..., nb, rec]
    lanes = jnp.asarray(quants.interleave_index(base))[ids % g]  # [..., bytes]
    lanes = jnp.broadcast_to(lanes[..., None, :], groups.shape[:-1] + (nbytes,))
    return jnp.take_along_axis(groups, lanes, axis=-1).reshape(ids.shape + (row_bytes,))
