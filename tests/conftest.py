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
    _share_compiled_programs()


def _share_compiled_programs():
    """Every process of the run (not the subprocesses tests start: those see the environment
    they are given) keeps XLA's compiled programs in the run's shared folder, jax's persistent
    compilation cache: many tests build the same tiny models, and a program one worker compiled
    the other reads back. Measured on the whole suite, -n 2: 1052 s without, 914 s with."""
    import jax

    path = helpers_background.workdir("xla")
    path.mkdir(exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def pytest_collection_modifyitems(session, config, items):
    """Background tests go last, so their commands have the whole suite's time to finish."""
    items.sort(key=lambda item: _starter(item) is not None)  # stable: order kept otherwise


def pytest_collection_finish(session):
    for start in dict.fromkeys(s for s in map(_starter, session.items) if s is not None):
        start()


def pytest_unconfigure(config):
    helpers_background.stop_all()


@pytest.fixture(scope="session")
def families_built():
    """The tiny family models of helpers_families.py, built once per run for every worker
    (helpers_shared.py) for test_families*.py: each family's HF directory and torch model, its
    f32 GGUF (llama.cpp's converter, one process for all) and its Q4_0 GGUF (llama-quantize),
    or why they are missing."""
    import helpers_families as fam

    pytest.importorskip("sentencepiece")
    return fam.built_set("families", fam.FAMILIES, fam.build)


@pytest.fixture(autouse=True)
def _restore_cpu_affinity():
    """The CLIs pin their process to --threads CPUs (_cli.configure_threads), and a CLI test runs
    main() inside the test process: without this, a test asking for 2 threads after one that ran
    `--threads 1` in the same worker is refused (only 1 CPU left to it)."""
    import os

    before = os.sched_getaffinity(0)
    yield
    if os.sched_getaffinity(0) != before:
        os.sched_setaffinity(0, before)
