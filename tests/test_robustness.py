"""Bad state and bad input: corrupt or incomplete sparsity artifacts and placement caches (with
hypothesis fuzzing), racing artifact builds, GGUF error wording, NaN propagation through the
sparse kernels, the thread bound, and Ctrl-C during model load."""
import json
import math
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers_models import write_tiny_gguf
from helpers_tolerances import assert_close
from powerinfer_jax import cache, ops
from powerinfer_jax.checkpoint import load_checkpoint, registry
from powerinfer_jax.checkpoint.registry import RegistryEntry
from powerinfer_jax.errors import UserError
from powerinfer_jax.ops import nibble_rows
from powerinfer_jax.sparsity import artifact_files as AF
from powerinfer_jax.sparsity import artifacts as A
from powerinfer_jax.sparsity import placement as pl
from powerinfer_jax.sparsity import predictor as PR
from powerinfer_jax.sparsity import profile as P
from powerinfer_jax.runtime.vram_budget import load_or_place

L, D, F, R = 2, 12, 37, 3
SHAPE = {"n_layers": L, "d_model": D, "d_ff": F, "activation": "silu", "gated": True}
FP = {"id": "files:robustness-test", "shape": SHAPE}
CONFIG = SimpleNamespace(**SHAPE)  # all model_fingerprint / model_shape read


def make_artifacts(seed: int = 0, predictor: bool = True):
    rng = np.random.default_rng(seed)
    thr = tuple(float(t) for t in rng.uniform(0.01, 1.0, L))
    stack = PR.PredictorStack.from_arrays({
        "w_in_ldr": rng.standard_normal((L, D, R)).astype(np.float32),
        "b_in_lr": rng.standard_normal((L, R)).astype(np.float32),
        "w_out_lrf": rng.standard_normal((L, R, F)).astype(np.float32),
        "b_out_lf": rng.standard_normal((L, F)).astype(np.float32)}) if predictor else None
    meta = {"target_sparsity": 0.5, "thresholds_contribution": list(thr),
            "thresholds_gate": list(thr), "thresholds_q4": list(thr), "predictor": {}, "q4": {}}
    arts = A.SparsityArtifacts(0.5, thr, thr, thr, stack, meta)
    profile = P.ActivationProfile(
        n_tokens=64, activation="silu", thresholds=np.asarray(thr),
        hist_contribution=rng.integers(0, 5, (L, P.N_BINS)),
        hist_gate=rng.integers(0, 5, (L, P.N_BINS)), counts=rng.integers(0, 65, (L, F)))
    return arts, profile


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A valid artifacts directory (with a predictor), built once; tests work on copies."""
    d = tmp_path_factory.mktemp("pristine") / "target_0.50"
    arts, profile = make_artifacts()
    A.save_artifacts(d, arts, profile, FP)
    return d, arts


def copy_of(pristine, tmp_path):
    d = tmp_path / "target_0.50"
    shutil.copytree(pristine[0], d)  # copy2 keeps mtimes: the record still matches
    return d


def assert_names_file_and_fix(err, path):
    msg = str(err)
    assert str(path) in msg, msg
    assert "python -m powerinfer_jax.calibrate" in msg, msg
    assert "\n" not in msg


# ------------------------------------------------------------------------------------------------
# artifacts: incomplete, truncated, corrupt
# ------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_saved_artifacts_round_trip_with_record(pristine, tmp_path):
    d = copy_of(pristine, tmp_path)
    assert (d / cache.DIR_RECORD).is_file() and cache.check_dir(d) is None
    got = A.load_artifacts(d, fingerprint=FP, need_predictor=True)
    assert got.thresholds_q4 == pristine[1].thresholds_q4
    for k, v in pristine[1].predictors.arrays().items():
        np.testing.assert_array_equal(got.predictors.arrays()[k], v)
    saved_in = pristine[0].parent  # no temporary or old directories left beside it
    assert sorted(p.name for p in saved_in.iterdir()) == [".target_0.50.lock", "target_0.50"]


@pytest.mark.parametrize("key", ["thresholds_q4", "target_sparsity", "has_predictor",
                                 "fingerprint"])
def test_meta_missing_key(pristine, tmp_path, key):
    d = copy_of(pristine, tmp_path)
    meta = json.loads((d / "meta.json").read_text())
    del meta[key]
    (d / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=r"meta.json is (of size \d+, recorded|changed since)") as e:
        A.load_artifacts(d, fingerprint=FP, need_predictor=False)  # the record catches it first
    assert_names_file_and_fix(e.value, d / "meta.json")
    cache.write_dir_record(d)  # as if written that way: the keys themselves are checked
    with pytest.raises(UserError) as e:
        A.load_artifacts(d, fingerprint=FP, need_predictor=False)
    assert_names_file_and_fix(e.value, d / "meta.json")
    assert key in str(e.value) or (key == "fingerprint" and "shape" in str(e.value))


def test_truncated_profile(pristine, tmp_path):
    d = copy_of(pristine, tmp_path)
    path = d / "profile.npz"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(UserError, match=r"profile.npz is of size \d+, recorded") as e:
        A.load_artifacts(d, fingerprint=FP, need_predictor=False)
    assert_names_file_and_fix(e.value, path)
    (d / cache.DIR_RECORD).unlink()  # an entry from before records: the file itself is checked
    with pytest.raises(UserError, match="profile.npz: expected a readable activation profile") as e:
        A.load_artifacts(d, fingerprint=FP, need_predictor=False)
    assert_names_file_and_fix(e.value, path)


def test_profile_of_wrong_shape(pristine, tmp_path):
    d = copy_of(pristine, tmp_path)
    _, profile = make_artifacts()
    bad = P.ActivationProfile(profile.n_tokens, profile.activation, profile.thresholds,
                              profile.hist_contribution, profile.hist_gate, profile.counts[:, :-1])
    bad.save(d / "profile.npz")
    cache.write_dir_record(d)
    with pytest.raises(UserError, match=rf"profile.npz array 'counts': expected \[{L}, {F}\]") as e:
        A.load_artifacts(d, fingerprint=FP, need_predictor=False)
    assert_names_file_and_fix(e.value, d / "profile.npz")


def test_corrupt_predictor_file(pristine, tmp_path):
    d = copy_of(pristine, tmp_path)
    files = sorted(p for p in (d / "predictor").rglob("*") if p.is_file() and p.stat().st_size)
    for f in files:
        f.write_bytes(b"\x00" * f.stat().st_size)
    cache.write_dir_record(d)
    with pytest.raises(UserError, match="predictor: expected restorable predictor weights") as e:
        A.load_artifacts(d, fingerprint=FP, need_predictor=True)
    assert_names_file_and_fix(e.value, d / "predictor")
    A.load_artifacts(d, fingerprint=FP, need_predictor=False)  # not needed: not read


def test_ensure_artifacts_user_model_error_registry_model_rebuilds(tmp_path, monkeypatch, capsys):
    arts, profile = make_artifacts(predictor=False)
    # A user's GGUF: bad artifacts are an error that names the file and the fix.
    gguf = tmp_path / "mine.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    fp = A.model_fingerprint(str(gguf), gguf, CONFIG)
    d = A.target_dir(A.artifacts_root(str(gguf), gguf), 0.5)
    A.save_artifacts(d, arts, profile, fp)
    model = SimpleNamespace(config=CONFIG)
    assert A.ensure_artifacts(str(gguf), gguf, model, None, 0.5, need_predictor=False,
                              progress=False).thresholds_q4 == arts.thresholds_q4
    (d / "profile.npz").write_bytes(b"not a zip")
    with pytest.raises(UserError) as e:
        A.ensure_artifacts(str(gguf), gguf, model, None, 0.5, need_predictor=False,
                           progress=False)
    assert_names_file_and_fix(e.value, d / "profile.npz")

    # A registry model: missing -> built, good -> reused, bad -> rebuilt with a note.
    monkeypatch.setenv("POWERINFER_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(registry.KNOWN_MODELS, "fake", RegistryEntry(
        package="p", version="1", member="p/m.gguf", size=1, sha256="ab" * 32, description="x"))
    builds = []

    def fake_build(model, tokenizer, *, fingerprint, root, target_sparsity, train, progress):
        builds.append(train)  # None: no predictors asked for
        A.save_artifacts(A.target_dir(root, target_sparsity), arts, profile, fingerprint)

    monkeypatch.setattr(A, "build_artifacts", fake_build)
    run = lambda: A.ensure_artifacts("fake", "unused", model, None, 0.5,  # noqa: E731
                                     need_predictor=False, progress=False)
    assert run().thresholds_q4 == arts.thresholds_q4 and builds == [None]
    assert run().thresholds_q4 == arts.thresholds_q4 and builds == [None]
    d = A.target_dir(A.artifacts_root("fake", "unused"), 0.5)
    meta = json.loads((d / "meta.json").read_text())
    del meta["thresholds_gate"]
    (d / "meta.json").write_text(json.dumps(meta))
    capsys.readouterr()
    assert run().thresholds_q4 == arts.thresholds_q4 and len(builds) == 2
    err = capsys.readouterr().err  # says why and that it rebuilds them, never asks the user to
    assert "cannot be used" in err and "meta.json" in err and "rebuilding them now" in err
    assert "delete" not in err and "calibrate" not in err


@pytest.mark.slow
def test_racing_artifact_builds_both_succeed_once(tmp_path):
    """Two processes need the same registry model's artifacts (with an orbax predictor, which
    is where a shared build directory used to fail): one builds, the other waits and reuses."""
    log = tmp_path / "builds.log"
    code = textwrap.dedent(f"""
        import time
        from test_robustness import make_artifacts, CONFIG
        from types import SimpleNamespace
        from powerinfer_jax.checkpoint import registry
        from powerinfer_jax.checkpoint.registry import RegistryEntry
        from powerinfer_jax.sparsity import artifacts as A
        registry.KNOWN_MODELS["fake"] = RegistryEntry(
            package="p", version="1", member="p/m.gguf", size=1, sha256="ab" * 32,
            description="x")
        def fake_build(model, tokenizer, *, fingerprint, root, target_sparsity, train, progress):
            with open({str(log)!r}, "a") as f:
                f.write("build\\n")
            time.sleep(1.0)
            arts, profile = make_artifacts()
            A.save_artifacts(A.target_dir(root, target_sparsity), arts, profile, fingerprint)
        A.build_artifacts = fake_build
        arts = A.ensure_artifacts("fake", "unused", SimpleNamespace(config=CONFIG), None, 0.5,
                                  need_predictor=True, progress=False)
        print(arts.predictors.shape)
    """)
    env = {**__import__("os").environ, "POWERINFER_JAX_CACHE": str(tmp_path / "cache")}
    # run in tests/ (`python -c` imports from its working directory): test_robustness imports
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env,
                              cwd=__file__.rsplit("/", 1)[0]) for _ in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    assert [o[0].strip() for o in outs] == [str((L, D, R, F))] * 2
    assert log.read_text().count("build") == 1


# ------------------------------------------------------------------------------------------------
# fuzzing: load never raises anything but UserError and never returns garbage
# ------------------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10**6) | st.floats(allow_nan=True)
    | st.text(max_size=8), lambda inner: st.lists(inner, max_size=4), max_leaves=6)


def _mutate(d, data):
    files = sorted(p for p in d.rglob("*") if p.is_file())
    kind = data.draw(st.sampled_from(["bytes", "truncate", "json", "delete"]))
    if kind == "json":
        path = d / "meta.json"
        meta = json.loads(path.read_text())
        key = data.draw(st.sampled_from(sorted(meta) + ["format_version", "thresholds_q4"]))
        op = data.draw(st.sampled_from(["delete", "set", "element"]))
        if op == "delete":
            meta.pop(key, None)
        elif op == "element" and isinstance(meta.get(key), list) and meta[key]:
            meta[key][data.draw(st.integers(0, len(meta[key]) - 1))] = data.draw(json_values)
        else:
            meta[key] = data.draw(json_values)
        path.write_text(json.dumps(meta))
        return
    path = data.draw(st.sampled_from(files))
    if kind == "delete":
        path.unlink()
    elif kind == "truncate":
        size = path.stat().st_size
        with open(path, "r+b") as f:
            f.truncate(data.draw(st.integers(0, max(size - 1, 0))))
    else:
        blob = bytearray(path.read_bytes())
        at = data.draw(st.integers(0, max(len(blob) - 1, 0)))
        new = data.draw(st.binary(min_size=1, max_size=16))
        blob[at:at + len(new)] = new
        path.write_bytes(bytes(blob))


def _check_sane(arts, need_predictor):
    for thr in (arts.thresholds_contribution, arts.thresholds_gate, arts.thresholds_q4):
        assert len(thr) == L and all(math.isfinite(t) and t >= 0 for t in thr)
    assert 0 <= arts.target_sparsity < 1
    if need_predictor:
        n_layers, d, _, f = arts.predictors.shape
        assert (n_layers, d, f) == (L, D, F)
        assert all(np.isfinite(a).all() for a in arts.predictors.arrays().values())


# orbax, handed a corrupt predictor, leaves an asyncio callback that fails after its loop closed
# ("Event loop is closed", reported as unraisable): its noise, not a result of this test.
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@settings(max_examples=100, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_artifact_files(pristine, tmp_path_factory, data):
    d = copy_of(pristine, tmp_path_factory.mktemp("fuzz"))
    _mutate(d, data)
    rerecord = data.draw(st.booleans())  # a consistent but wrong entry: the files are checked
    if rerecord:
        cache.write_dir_record(d)
    need = data.draw(st.booleans())
    try:
        arts = A.load_artifacts(d, fingerprint=FP, need_predictor=need)
    except UserError as e:
        assert str(d) in str(e) and "\n" not in str(e), str(e)
        return
    _check_sane(arts, need)
    if not rerecord:  # only the record was touched (or nothing that matters): the original
        want = pristine[1]
        assert arts.thresholds_q4 == want.thresholds_q4
        assert arts.thresholds_gate == want.thresholds_gate
        if need:
            for k, v in want.predictors.arrays().items():
                np.testing.assert_array_equal(arts.predictors.arrays()[k], v)


# ------------------------------------------------------------------------------------------------
# placement cache
# ------------------------------------------------------------------------------------------------

def _sizes():
    return pl.ModelBytes(global_dense=100, layer_dense=(24, 24), neuron_bytes=(24, 24),
                         d_ff=(F, F))


@pytest.mark.parametrize("edit", ["index_out_of_range", "repeated_index", "hot_too_large",
                                  "order_too_short", "garbage"])
def test_bad_placement_cache_is_recomputed(tmp_path, capsys, edit):
    freqs = [np.linspace(0, 1, F)] * 2
    key = "k1"
    calls = []

    def compute():
        calls.append(1)
        return pl.place_neurons(freqs, _sizes(), 600)

    good, hit = load_or_place(tmp_path, key, compute)
    assert not hit
    path = tmp_path / "placement.json"
    stored = json.loads(path.read_text())
    order = stored["placement"]["order"]
    if edit == "index_out_of_range":
        order[1][3] = F + 5
    elif edit == "repeated_index":
        order[0][0] = order[0][1]
    elif edit == "hot_too_large":
        stored["placement"]["hot"][0] = F + 1
    elif edit == "order_too_short":
        order[0].pop()
    if edit == "garbage":
        path.write_bytes(b"\x00{garbage")
    else:
        path.write_text(json.dumps(stored))
    capsys.readouterr()
    again, hit = load_or_place(tmp_path, key, compute)
    assert not hit and again == good and len(calls) == 2
    assert f"ignoring the placement cache {path}" in capsys.readouterr().err
    assert load_or_place(tmp_path, key, compute) == (good, True) and len(calls) == 2


# ------------------------------------------------------------------------------------------------
# GGUF errors: the fix depends on whose file it is
# ------------------------------------------------------------------------------------------------

def test_gguf_errors_name_the_file_and_a_fix_that_applies(tmp_path, monkeypatch):
    good = tmp_path / "mine.gguf"
    write_tiny_gguf(good)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:60])
    with pytest.raises(UserError) as e:
        load_checkpoint(cut)
    msg = str(e.value)
    assert str(cut) in msg and "truncated or corrupt" in msg and "your own file" in msg
    assert "fetch it again" not in msg and "download it again" not in msg.split("your own")[0]
    other = tmp_path / "notes.gguf"
    other.write_text("hello, not a model\n" * 10)
    with pytest.raises(UserError, match="not a GGUF file.*your own file"):
        load_checkpoint(other)

    # The registry's cached copy (verified against its record, broken where samples miss it).
    monkeypatch.setenv("POWERINFER_JAX_CACHE", str(tmp_path / "cache"))
    data = cut.read_bytes()
    import hashlib

    monkeypatch.setitem(registry.KNOWN_MODELS, "fake", RegistryEntry(
        package="p", version="1", member="p/cut.gguf", size=len(data),
        sha256=hashlib.sha256(data).hexdigest(), description="x"))
    dest = registry.model_path("fake")
    dest.parent.mkdir(parents=True)
    dest.write_bytes(data)
    with pytest.raises(UserError, match="registry model's cached copy: delete it and run again "
                                        "to fetch it again") as e:
        load_checkpoint("fake")
    assert str(dest) in str(e.value)


# ------------------------------------------------------------------------------------------------
# NaN propagation and the thread bound (C++)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", ["ffi", "reference"])
@pytest.mark.parametrize("criterion", ["oracle", "scores", "activations"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_input_reaches_sparse_ffn_output(impl, criterion, bad):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, D)).astype(np.float32)
    w_gate, w_up, w_down = (rng.standard_normal((F, D)).astype(np.float32) for _ in range(3))
    scores = None
    if criterion == "oracle":
        x[1, 4] = bad
    elif criterion == "scores":  # a predictor fed a NaN input scores NaN
        scores = np.abs(rng.standard_normal((3, F))).astype(np.float32)
        x[1, 4] = bad
        scores[1] = np.nan
    else:  # the activations themselves (one non-finite neuron)
        scores = rng.standard_normal((3, F)).astype(np.float32)
        scores[1, 5] = bad
    y, n = ops.sparse_ffn(x, w_up, w_down, w_gate=w_gate, scores=scores, threshold=0.5,
                          criterion=criterion, impl=impl)
    y = np.asarray(y)
    assert not np.isfinite(y[1]).all() and np.isfinite(y[[0, 2]]).all()
    ref, _ = ops.sparse_ffn(x, w_up, w_down, w_gate=w_gate, scores=scores, threshold=0.5,
                            criterion=criterion, impl="reference")
    assert_close(y[[0, 2]], np.asarray(ref)[[0, 2]], "other_path")


@pytest.mark.parametrize("impl", ["ffi", "reference"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_input_reaches_q4_outputs(impl, bad):
    rng = np.random.default_rng(2)
    dim = 76  # two Q8 blocks and a partial third
    x = rng.standard_normal((3, dim)).astype(np.float32)
    x[1, 40] = bad
    w_gate, w_up, w_down = (rng.standard_normal((F, dim)).astype(np.float32) for _ in range(3))
    q, dm = nibble_rows.quantize(np.stack([w_gate, w_up], axis=1))
    scores = np.asarray(ops.q4_scores(x, q, dm, impl=impl))
    assert np.isnan(scores[1]).all() and np.isfinite(scores[[0, 2]]).all()
    y, n = ops.q4_sparse_ffn(x, q, dm, w_down, threshold=0.1, impl=impl)
    y, n = np.asarray(y), np.asarray(n)
    assert np.isnan(y[1]).all() and np.isfinite(y[[0, 2]]).all() and n[1] == F


def test_thread_count_is_bounded():
    from powerinfer_jax.ops import _ffi

    top = _ffi.max_threads()
    assert top >= 256
    before = _ffi.get_num_threads()
    for n in (5000, top + 1, 0, -3, 2.5, True):
        with pytest.raises(UserError, match=rf"set_num_threads: n: expected an integer in \[1, {top}\]"):
            ops.set_num_threads(n)
    with pytest.raises(ValueError, match=rf"expected an integer in \[1, {top}\].*got 5000"):
        _ffi._pij_ext.set_num_threads(5000)  # the C++ check, without the Python one
    with pytest.raises(ValueError, match="pool_stress: threads"):
        _ffi._pij_ext.pool_stress(5000, 1, 1)
    assert _ffi.get_num_threads() == before  # a refused request changes nothing


# ------------------------------------------------------------------------------------------------
# Ctrl-C during model load
# ------------------------------------------------------------------------------------------------

# A job a non-interactive shell starts in the background (`pytest ... &`, nohup) ignores SIGINT,
# and its children inherit that: Ctrl-C cannot reach them, and _interrupt.install() leaves an
# ignored SIGINT alone on purpose. (`timeout` resets it, which is why `timeout pytest ... &` runs
# these tests.)
needs_sigint = pytest.mark.skipif(
    signal.getsignal(signal.SIGINT) is signal.SIG_IGN,
    reason="SIGINT is ignored in this process (a background job); its children inherit that")


@pytest.mark.slow
@needs_sigint
def test_sigint_during_load_interrupts(tmp_path):
    """jax's Python gc callback used to swallow a KeyboardInterrupt that landed in it; with a gc
    after nearly every allocation (gc.set_threshold(1)) nearly every Ctrl-C lands there."""
    gguf = tmp_path / "m.gguf"
    write_tiny_gguf(gguf)
    code = textwrap.dedent(f"""
        import gc
        import powerinfer_jax
        import jax  # registers jax's gc callback
        from powerinfer_jax.checkpoint import load_checkpoint
        load_checkpoint({str(gguf)!r})
        gc.set_threshold(1)
        print("loading", flush=True)
        while True:
            load_checkpoint({str(gguf)!r})
    """)
    for _ in range(3):
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "loading"
        time.sleep(0.3)
        p.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        try:
            _, err = p.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            pytest.fail("Ctrl-C was swallowed: the child kept loading for 20 s")
        assert time.monotonic() - t0 < 10
        assert p.returncode == -signal.SIGINT, err[-2000:]
        assert "Exception ignored" not in err and err.rstrip().endswith("KeyboardInterrupt"), err


@needs_sigint
def test_sigint_in_cli_exits_130_with_one_line(tmp_path):
    gguf = tmp_path / "m.gguf"
    write_tiny_gguf(gguf)
    p = subprocess.Popen([sys.executable, "-m", "powerinfer_jax.generate", "--model", str(gguf),
                          "--prompt", "hello", "--max-new-tokens", "2"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)  # importing jax, loading, compiling: seconds
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 130, err[-2000:]
    # One line: _cli.run_main's, or _interrupt's when Ctrl-C comes before run_main (imports),
    # after any progress lines ("powerinfer_jax: compiling ...")
    lines = [ln for ln in err.strip().splitlines()
             if not ln.startswith("powerinfer_jax: compiling")]
    assert lines in (["interrupted"], ["powerinfer_jax: interrupted"]), err[-2000:]


# --------------------------------------------------------------- XLA's compilation cache
def _generate(gguf, cache_root):
    env = {**__import__("os").environ, "POWERINFER_JAX_CACHE": str(cache_root)}
    p = subprocess.run([sys.executable, "-m", "powerinfer_jax.generate", "--model", str(gguf),
                        "--prompt", "hello", "--max-new-tokens", "4", "--json"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_corrupt_compilation_cache_entry_recompiles(tmp_path):
    """Compiled steps under <cache>/executables (and jax's own entries under <cache>/xla)
    overwritten with garbage: the next run compiles afresh and gives the same tokens (no
    traceback, no crash), and the run after it loads the steps that run stored again."""
    gguf = tmp_path / "m.gguf"
    write_tiny_gguf(gguf)
    cache = tmp_path / "cache"
    first = _generate(gguf, cache)
    steps = list((cache / "executables").glob("*/*.exe"))
    assert len(steps) == 2  # the first run stored its prefill and decode steps
    for e in steps + list((cache / "xla").glob("*-cache")):
        e.write_bytes(b"\x00garbage" * 7)
    again = _generate(gguf, cache)
    assert again["tokens"] == first["tokens"]
    done = again["startup"]["executables"]  # the garbage was read in the background, refused
    assert (done["loaded"], done["compiled"]) == (0, 2)
    third = _generate(gguf, cache)
    assert third["tokens"] == first["tokens"] and third["startup"]["executables"]["loaded"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("case", ["unwritable", "off", "on"])
def test_compilation_cache_location_and_switch(tmp_path, case):
    """An unwritable cache root runs without the cache (no error); POWERINFER_JAX_XLA_CACHE=0
    turns it off; otherwise it is <cache>/xla."""
    root = tmp_path / "root"
    if case == "unwritable":
        root.write_text("a file where the cache directory would be")
    env = {**__import__("os").environ, "POWERINFER_JAX_CACHE": str(root),
           "POWERINFER_JAX_XLA_CACHE": "0" if case == "off" else "1"}
    code = ("import jax; from powerinfer_jax.runtime.host import use_compilation_cache; "
            "use_compilation_cache(); print(jax.config.jax_compilation_cache_dir)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    want = str(root / "xla") if case == "on" else "None"
    assert p.stdout.strip().splitlines()[-1] == want
