"""Hostile input, bounded: mutated GGUF and PowerInfer-GGUF files (benchmarks/fuzz_gguf.py), the
tokenizer's input and the CLIs' arguments (benchmarks/fuzz_inputs.py) with hypothesis, each case
ending in a loaded model / a result or a one-line error that names what was wrong, never another
exception. The long runs (>= 10,000 cases, a watched child process that catches crashes and
hangs) are benchmarks/fuzz.py; the regression tests below are what those runs found."""
import struct
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings

from benchmarks import fuzz_gguf as FG
from benchmarks import fuzz_inputs as FI
from helpers_models import write_tiny_gguf
from powerinfer_jax.checkpoint import gguf
from powerinfer_jax.errors import UserError

BOUNDED = settings(max_examples=120, deadline=None, derandomize=True, database=None,
                   phases=[Phase.generate], suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    return FG.write_seeds(tmp_path_factory.mktemp("fuzz_seeds"))


@pytest.mark.parametrize("target,which", [("gguf", 0), ("powerinfer-gguf", 0),
                                          ("powerinfer-gguf", 1)])
def test_mutated_files_load_or_fail_in_one_line(seeds, tmp_path, target, which):
    seed = seeds[target][which]
    data = seed.read_bytes()
    assert FG.check(seed, target)[0] == "ok"
    case = tmp_path / seed.name
    outcomes = []

    @BOUNDED
    @given(FG.mutations(data, FG.layout(data)))
    def fuzz(mutated):
        case.write_bytes(mutated)
        kind, detail = FG.check(case, target)
        assert kind != "finding", detail
        outcomes.append(kind)

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")  # NaN scales in mutated blocks: numpy's warnings
        fuzz()
    assert "error" in outcomes  # the mutations do reach the checks


# ------------------------------------------------------------------------------------------------
# What the long runs found (each a regression test)
# ------------------------------------------------------------------------------------------------

def _nested_array_file(path, depth: int):
    key = b"a.b"
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
    path.write_bytes(head + struct.pack("<I", 9) + FG.nest(depth) + struct.pack("<IQ", 4, 0))


def test_deeply_nested_metadata_arrays_are_a_format_error(tmp_path):
    """Found: arrays of arrays 100,000 deep overflowed Python's stack (RecursionError)."""
    path = tmp_path / "nested.gguf"
    _nested_array_file(path, 100_000)
    with pytest.raises(UserError, match=r"nested.gguf.*expected arrays nested at most 8 deep"):
        gguf.read_config(path)
    _nested_array_file(path, 3)  # shallow nesting still parses (then fails on the model)
    with pytest.raises(ValueError, match="nested.gguf.*general.architecture"):
        gguf.read_config(path)


@pytest.mark.parametrize("key,value,rule", [
    ("llama.block_count", [1, 2], "an integer"),                 # TypeError in int()
    ("tokenizer.ggml.tokens", "abc", "a list of strings"),       # a str iterated as tokens
    ("tokenizer.ggml.merges", [1, 2], "a list of strings"),      # AttributeError .split
    ("tokenizer.ggml.model", [3], "a string"),                   # unhashable list
    ("llama.rope.freq_base", "x", "a number"),                   # float() of a str
])
def test_metadata_of_the_wrong_type_names_key_and_file(tmp_path, key, value, rule):
    from helpers_gguf_edit import rewrite

    src = tmp_path / "good.gguf"
    write_tiny_gguf(src)
    bad = rewrite(src, tmp_path / "bad.gguf", drop_keys=(key,), set_keys={key: value})
    with pytest.raises(UserError) as e:
        gguf.load_gguf(bad)
    msg = str(e.value)
    assert "bad.gguf" in msg and key in msg and f"expected {rule}" in msg and "\n" not in msg


def test_a_block_count_past_the_files_tensors_fails_at_once(tmp_path):
    """Found: block_count 2**32 - 1 built a per-layer layout of billions of entries (a
    MemoryError after a minute under a 4 GiB limit; without a limit, the machine's memory)."""
    from helpers_gguf_edit import rewrite

    src = tmp_path / "good.gguf"
    write_tiny_gguf(src)
    bad = rewrite(src, tmp_path / "many.gguf", set_keys={"llama.block_count": 2 ** 32 - 1})
    with pytest.raises(UserError, match=r"many.gguf': metadata llama.block_count: expected at "
                                        r"most \d+ \(the file's tensors"):
        gguf.load_gguf(bad)


def test_config_and_tokenizer_errors_name_the_file(tmp_path):
    """Found: ModelConfig's and the tokenizer's own checks ("ModelConfig.n_heads: expected a
    positive integer, got 0") did not say which file held the value."""
    from helpers_gguf_edit import rewrite

    src = tmp_path / "good.gguf"
    write_tiny_gguf(src)
    zero = rewrite(src, tmp_path / "zero_heads.gguf", set_keys={"llama.attention.head_count": 0})
    with pytest.raises(UserError, match=r"zero_heads.gguf.*n_heads: expected a positive"):
        gguf.load_gguf(zero)
    empty = rewrite(src, tmp_path / "no_tokens.gguf", drop_keys=("tokenizer.ggml.tokens",))
    with pytest.raises(UserError, match=r"no_tokens.gguf.*tokenizer.ggml.tokens"):
        gguf.load_gguf(empty)


# ------------------------------------------------------------------------------------------------
# The tokenizer's input and the CLIs' arguments
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz_tok") / "tiny.gguf"
    write_tiny_gguf(path)
    return gguf.load_gguf(path, keep_quantized=True).tokenizer


def test_tokenizer_takes_any_text(tiny_tokenizer):
    @BOUNDED
    @given(FI.texts(), FI.messages())
    def fuzz(text, messages):
        kind, detail = FI.check_tokenizer(tiny_tokenizer, text, messages)
        assert kind != "finding", detail

    fuzz()


@pytest.mark.parametrize("cli", sorted(FI.CLIS))
def test_cli_arguments_parse_or_fail_in_one_line(cli):
    @settings(BOUNDED, max_examples=60)
    @given(FI.argv(cli))
    def fuzz(argv):
        kind, detail = FI.check_cli_args(cli, argv)
        assert kind != "finding", (argv, detail)

    fuzz()
