"""Profiling: counts equal a direct numpy count; power law, histograms, plot; corpus errors."""
import bz2
from xml.sax.saxutils import escape

import numpy as np
import pytest
from flax import nnx

from helpers_models import tiny_llama_config
from powerinfer_jax.models.transformer import Transformer
from powerinfer_jax.sparsity import corpus as C
from powerinfer_jax.sparsity import profile as P


def _silu(v):
    return v / (1.0 + np.exp(-v))


@pytest.fixture(scope="module")
def tiny():
    cfg = tiny_llama_config(d_model=48, head_dim=12, d_ff=37 * 3)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    chunks = np.random.default_rng(0).integers(0, cfg.vocab_size, (3, 40)).astype(np.int32)
    return model, P.collect_ffn_inputs(model, chunks, progress=False)


def _numpy_activations(ffn, x_nd):
    g = x_nd @ np.asarray(ffn.gate.weight[...]).T
    u = x_nd @ np.asarray(ffn.up.weight[...]).T
    return _silu(g) * u


@pytest.mark.slow
def test_collect_shapes(tiny):
    model, x = tiny
    assert x.shape == (model.config.n_layers, 120, model.config.d_model)


def test_counts_equal_numpy(tiny):
    model, x = tiny
    thr = (0.05, 0.02)
    prof = P.profile_activations(model, x, thr, progress=False)
    for l, layer in enumerate(model.layers):
        a = _numpy_activations(layer.ffn, x[l].astype(np.float64))
        want = (np.abs(a) > thr[l]).sum(axis=0)
        near = np.abs(np.abs(a) - thr[l]) < 1e-5  # f32 vs f64 rounding right at the threshold
        diff = np.abs(prof.counts[l] - want)
        assert (diff <= near.sum(axis=0)).all() and diff.sum() <= max(1, near.sum())
        assert prof.hist_contribution[l].sum() == a.size
    assert prof.counts.sum() > 0 and prof.n_tokens == 120


def test_masks_match_counts(tiny):
    model, x = tiny
    thr = (0.05, 0.02)
    prof = P.profile_activations(model, x, thr, progress=False)
    masks = P.active_masks(model, x, thr, progress=False)
    np.testing.assert_array_equal(masks.sum(axis=1), prof.counts)


def test_power_law_on_planted_counts():
    counts = np.zeros((1, 10), np.int64)
    counts[0, :2] = 40  # two neurons carry 80 of 100 activations
    counts[0, 2:] = 2.5 * 2
    counts[0, 2:6] = 5
    counts[0, 6:] = 0
    prof = P.ActivationProfile(100, "silu", np.zeros(1), np.zeros((1, P.N_BINS), np.int64),
                               np.zeros((1, P.N_BINS), np.int64), counts)
    assert prof.power_law(0.8)[0] == pytest.approx(0.2)
    assert prof.power_law(0.81)[0] == pytest.approx(0.3)


def test_save_load_and_plot(tiny, tmp_path):
    model, x = tiny
    prof = P.profile_activations(model, x, progress=False)
    prof.save(tmp_path / "p.npz")
    back = P.ActivationProfile.load(tmp_path / "p.npz")
    np.testing.assert_array_equal(back.counts, prof.counts)
    np.testing.assert_array_equal(back.hist_gate, prof.hist_gate)
    P.plot_frequency(prof, tmp_path / "f.png")
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"


def test_corpus_errors(tmp_path):
    with pytest.raises(ValueError, match="at least one text file"):
        C.read_corpus([])
    empty = tmp_path / "e.txt"
    empty.write_text("  \n")
    with pytest.raises(ValueError, match="non-empty text"):
        C.read_corpus([empty])
    valid = tmp_path / "wiki.valid.txt"
    valid.write_text("text")
    with pytest.raises(ValueError, match="validation file"):
        C.read_corpus([valid])
    with pytest.raises(ValueError, match="at least one context of 512 tokens, got 100"):
        C.corpus_chunks(list(range(100)), 512)
    assert C.corpus_chunks(list(range(100)), 8, max_tokens=32).shape == (4, 8)


def test_wiki_xml_to_text():
    long = "The quick brown fox jumps over the lazy dog again and again, it is said."
    body = escape(f"{{{{Infobox|a=b}}}}\n'''Fox''' is [[Canidae|a canid]].<ref>x</ref> {long}\n"
                  "== History ==\nshort\n")  # dumps escape markup inside <text>
    xml = (f"<mediawiki><page><title>Fox</title><revision><text>{body}"
           f"</text></revision></page><page><title>Gone</title><revision><text>{long}</text>"
           "</revision></page></mediawiki>").encode()
    text = C.wiki_xml_to_text(bz2.decompress(bz2.compress(xml)), skip_last=1)
    assert text.startswith("= Fox =\nFox is a canid. The quick")
    assert "Gone" not in text and "Infobox" not in text and "History" not in text
