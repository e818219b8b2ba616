"""Suite hooks: slow subprocess tests start in the background when collection ends and run last
(tests/helpers_background.py says why). A test module opts in with
`BACKGROUND = {"test_name": start_function}`."""
import pytest

import helpers_background


def _starter(item):
    hooks = getattr(getattr(item, "module", None), "BACKGROUND", {})  # non-Python items: none
    return hooks.get(getattr(item, "originalname", item.name))


def pytest_configure(config):
    """The folder the run's background jobs share: made here by the controlling process (the
    xdist controller, or a run without workers) before any worker starts; workers inherit it."""
    if not hasattr(config, "workerinput"):
        helpers_background.make_root()


def pytest_collection_modifyitems(session, config, items):
    """Background tests go last, so their commands have the whole suite's time to finish."""
    items.sort(key=lambda item: _starter(item) is not None)  # stable: order kept otherwise


def pytest_collection_finish(session):
    for start in dict.fromkeys(s for s in map(_starter, session.items) if s is not None):
        start()


def pytest_unconfigure(config):
    helpers_background.stop_all()


@pytest.fixture(scope="session")
def families_built(tmp_path_factory):
    """The tiny family models of helpers_families.py, built once per session for
    test_families*.py: each family's HF directory and torch model, its f32 GGUF (llama.cpp's
    converter, one process for all) and its Q4_0 GGUF (llama-quantize), or why they are missing."""
    import helpers_families as fam
    import helpers_llamacpp as llamacpp

    pytest.importorskip("sentencepiece")
    root = tmp_path_factory.mktemp("families")
    names = list(fam.FAMILIES)
    out = {"dirs": {}, "hf": {}, "gguf": {}, "q": {}, "why_gguf": "", "why_q": ""}
    for name in names:
        out["dirs"][name] = root / name
        out["hf"][name] = fam.build(name, root / name)
    src, why = llamacpp.tree()
    if src is None:
        out["why_gguf"] = out["why_q"] = why
        return out
    llamacpp.convert([(root / n, root / f"{n}.gguf", fam.FAMILIES[n].gguf_pre, "f32")
                      for n in names])
    out["gguf"] = {n: root / f"{n}.gguf" for n in names}
    if llamacpp.binary("llama-quantize") is None:
        out["why_q"] = ("no llama-quantize build ($PIJ_LLAMA_CPP_BIN or <cache>/peers/"
                        "llamacpp-cpu-native: benchmarks/build_llama_bench_cpu.sh)")
        return out
    for n in names:
        out["q"][n] = root / f"{n}.q4_0.gguf"
        llamacpp.quantize(out["gguf"][n], out["q"][n], "Q4_0")
    return out
