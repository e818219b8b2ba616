"""benchmarks/decode_profile.py's charging of perf samples to the parts of a decode step (the
perf run itself needs perf and a symbol build: not here)."""
from benchmarks.decode_profile import classify, parse_perf_script

SCRIPT = """python 
\t  b08b0 pij::(anonymous namespace)::InterleavedRows<pij::qfmt::Q4_0>
\t  e7b2e pij::ThreadPool::CallFn<pij::QLinearMany(...)::{lambda(long, int)#2} const>

pij-pool 
\t  154f06 pij::qkern::DotTile<pij::qfmt::Q4_0, 4, 1, 0l>
\t  12ec09 pij::qsparse::NeuronDots<pij::qfmt::Q4_0, 2, ...>
\t  13897d pij::(anonymous namespace)::RunPiece

pij-pool 
\t  138a3c pij::(anonymous namespace)::RunPiece
\t  143b2d pij::ThreadPool::CallFn<pij::QSparseFfn(...)::{lambda(long, int)#1} const>

pij-pool 
\t  11aa pij::ThreadPool::WorkerLoop

python 
\t  22bb pij::(anonymous namespace)::KvHeadGroup<8, 1, unsigned short>

python 
\t  33cc [unknown]
"""


def test_samples_are_charged_to_their_part():
    assert parse_perf_script(SCRIPT) == {"dense_matvec": 1, "sparse_gate_up": 1,
                                         "sparse_down": 1, "pool_wait": 1, "attention": 1,
                                         "other": 1}


def test_a_dot_tile_under_the_sparse_ffn_is_not_a_matvec():
    # the same tile serves both; the stack decides
    assert classify(["pij::qkern::DotTile<Q4_0, 4, 1, 0l>", "pij::qsparse::NeuronDots<...>"]) \
        == "sparse_gate_up"
    assert classify(["pij::qkern::DotTile<Q4_0, 4, 1, 0l>", "pij::QLinearMany"]) == \
        "dense_matvec"
    # waiting counts only where the thread is idle, not for work a worker runs
    assert classify(["pij::(anonymous namespace)::RunPiece", "pij::ThreadPool::WorkerLoop"]) \
        == "sparse_down"
    assert classify([]) == "other"


def test_a_missing_extension_is_one_line_error(tmp_path):
    import pytest

    from benchmarks.decode_profile import main

    with pytest.raises(SystemExit, match="--extension: expected a built _pij_ext .so file, got"):
        main(["--model", "smollm2-135m", "--extension", str(tmp_path / "nope.so")])
