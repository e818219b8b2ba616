"""The CLIs end to end on a tiny model saved to disk: JSON contract, flags, and clean user errors."""
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from helpers_models import save_hf_llama
from powerinfer_jax import bench, evaluate, generate
from powerinfer_jax import errors as pij_errors

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_llama")
    save_hf_llama(d)
    return d


def last_json(capsys):
    out = capsys.readouterr().out.strip().splitlines()
    return json.loads(out[-1])


@pytest.mark.slow
def test_generate_json_contract(tiny_dir, capsys):
    generate.main(["--model", str(tiny_dir), "--prompt", "the quick brown fox", "--max-new-tokens",
                   "6", "--json", "--threads", "1"])
    row = last_json(capsys)
    assert {"text", "tokens", "prompt_tokens", "prefill_tok_s", "decode_tok_s"} <= set(row)
    assert 1 <= len(row["tokens"]) <= 6 and row["prompt_tokens"] > 0


@pytest.mark.slow
def test_generate_is_deterministic_for_a_seed(tiny_dir, capsys):
    argv = ["--model", str(tiny_dir), "--prompt", "hello world", "--max-new-tokens", "8",
            "--temperature", "0.9", "--top-k", "20", "--seed", "3", "--json"]
    generate.main(argv)
    a = last_json(capsys)["tokens"]
    generate.main(argv)
    assert last_json(capsys)["tokens"] == a


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["xla", "ffi"])
def test_generate_kernels_agree(tiny_dir, capsys, kernels):
    generate.main(["--model", str(tiny_dir), "--prompt", "the dog", "--max-new-tokens", "8",
                   "--json", "--kernels", kernels])
    tokens = last_json(capsys)["tokens"]
    generate.main(["--model", str(tiny_dir), "--prompt", "the dog", "--max-new-tokens", "8",
                   "--json", "--kernels", "xla"])
    assert tokens == last_json(capsys)["tokens"]


def test_evaluate_json(tiny_dir, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    evaluate.main(["--model", str(tiny_dir), "--text", str(text), "--ctx", "32", "--max-chunks",
                   "3", "--json", "--no-progress"])
    row = last_json(capsys)
    assert row["tokens_scored"] == 3 * 31 and row["ppl"] > 1 and row["ffn_sparsity"] == 0.0


@pytest.mark.slow
def test_calibrate_then_q4_predictor_mode(tiny_dir, tmp_path, capsys):
    """calibrate writes q4 thresholds; evaluate --sparsity predictor (q4 by default) uses them and
    reports its recall against the oracle set; lowrank without trained predictors is a clear error."""
    from powerinfer_jax import calibrate

    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. a b c d e f g. " * 60)
    root = tmp_path / "arts"
    calibrate.main(["--model", str(tiny_dir), "--corpus", str(text), "--ctx", "32",
                    "--target-sparsity", "0.5", "--out", str(root),
                    "--no-progress", "--json"])
    meta = last_json(capsys)
    assert len(meta["thresholds_q4"]) == 2 and meta["q4"]["mean_recall"] > 0.8
    from powerinfer_jax.runtime.session import build
    from powerinfer_jax.config import RuntimeConfig, SparsityConfig
    from powerinfer_jax.runtime.perplexity import perplexity

    s = build(str(tiny_dir), RuntimeConfig(), SparsityConfig(
        "predictor", target_sparsity=0.5), artifacts_root=root, progress=False)
    ids = s.tokenizer.encode(text.read_text(), add_bos=False)
    res = perplexity(s.model, ids, ctx=32, max_chunks=2, oracle_thresholds=s.oracle_thresholds)
    assert 0.3 < res["ffn_sparsity"] < 0.7 and res["predictor_recall"] > 0.8
    with pytest.raises(ValueError, match="expected trained predictors"):
        build(str(tiny_dir), RuntimeConfig(), SparsityConfig(
            "predictor", target_sparsity=0.5, predictor="lowrank"), artifacts_root=root,
            progress=False)


@pytest.mark.slow
def test_bench_appends_a_row(tiny_dir, tmp_path, capsys):
    out = tmp_path / "b.jsonl"
    bench.main(["--model", str(tiny_dir), "--prompt-tokens", "8", "--new-tokens", "4",
                "--repeats", "1", "--out", str(out)])
    row = json.loads(out.read_text().splitlines()[-1])
    assert row["bench"] == "model" and row["new_tokens"] == 4 and len(row["tokens"]) == 4
    # the median of the timed runs, each a finite positive rate
    assert row["decode_tok_s"] == statistics.median(row["decode_tok_s_runs"]), row
    assert all(0 < v < float("inf") for v in row["decode_tok_s_runs"]), row
    assert {"commit", "machine", "threads", "dtype", "model"} <= set(row)


@pytest.mark.parametrize("argv,match", [
    (["--prompt", ""], "--prompt: expected non-empty text"),
    (["--prompt", "the fox " * 200, "--max-seq-len", "64"], r"prompt: expected fewer than 64 tokens"),
    (["--prompt", "x", "--max-seq-len", "100000"], r"--max-seq-len: expected at most 128"),
    (["--prompt", "x", "--temperature", "-1"], "--temperature: expected a finite float >= 0"),
    (["--prompt", "x", "--decode-block", "65"], r"--decode-block: expected an integer in \[1, 64\]"),
])
def test_generate_user_errors(tiny_dir, argv, match):
    with pytest.raises(ValueError, match=match):
        generate.main(["--model", str(tiny_dir), *argv])


def test_evaluate_user_errors(tiny_dir, tmp_path):
    with pytest.raises(pij_errors.UserError, match="--text: expected an existing file"):
        evaluate.main(["--model", str(tiny_dir), "--text", str(tmp_path / "missing.txt")])
    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(pij_errors.UserError,
                       match=r"--text: expected at least 512 tokens \(one chunk of --ctx 512\)"):
        evaluate.main(["--model", str(tiny_dir), "--text", str(short)])


@pytest.mark.slow
@pytest.mark.parametrize("argv,match", [
    (["--model", "no-such-model", "--prompt", "x"], "no-such-model"),
    (["--dtype", "float16", "--prompt", "x"], "invalid choice: 'float16'"),
])
def test_cli_errors_are_one_clean_line(argv, match):
    """Through `python -m`: exit status 2, the message on stderr, no traceback."""
    r = subprocess.run([sys.executable, "-m", "powerinfer_jax.generate", *argv],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 2
    assert match in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_a_reader_closing_stdout_early_ends_the_command_quietly():
    """`python -m powerinfer_jax.generate ... | head -c 1`: the CLIs' run_main stops with 141
    (128 + SIGPIPE) and no BrokenPipeError traceback once the reader has gone."""
    code = ("import sys; from powerinfer_jax import _cli\n"
            "def main():\n"
            "    for _ in range(10000):\n"
            "        sys.stdout.write('x' * 1000); sys.stdout.flush()\n"
            "_cli.run_main(main)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    assert p.stdout.read(1) == b"x"
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_a_paused_collector_runs_again_after_start_up():
    """run_main(pause_collector=True): the cycle collector is off while main starts, and
    resume_collector turns it back on with start-up's objects frozen (gc.freeze); a second
    resume changes nothing. Without a pause (a test calling main() itself) resume does nothing:
    the process's collector and its frozen set stay as they were."""
    code = ("import gc, sys; from powerinfer_jax import _cli\n"
            "def main():\n"
            "    before = gc.isenabled()\n"
            "    _cli.resume_collector(); frozen = gc.get_freeze_count()\n"
            "    _cli.resume_collector()\n"
            "    print(before, gc.isenabled(), frozen > 0, gc.get_freeze_count() == frozen)\n"
            "_cli.run_main(main, pause_collector=True)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "True", "True", "True"]
    import gc

    from powerinfer_jax import _cli

    enabled, frozen = gc.isenabled(), gc.get_freeze_count()
    _cli.resume_collector()
    assert (gc.isenabled(), gc.get_freeze_count()) == (enabled, frozen)


@pytest.mark.slow
def test_generate_as_a_command_gives_the_tokens_of_main(tiny_dir, capsys):
    """`python -m powerinfer_jax.generate` (collector paused through start-up, then frozen) and
    generate.main() in this process (collector as it is): the same tokens, greedy and sampled."""
    for extra in ([], ["--temperature", "0.8", "--top-k", "20", "--seed", "5"]):
        argv = ["--model", str(tiny_dir), "--prompt", "the quick brown fox", "--max-new-tokens",
                "7", "--json", "--no-stream", "--threads", "1", *extra]
        r = subprocess.run([sys.executable, "-m", "powerinfer_jax.generate", *argv],
                           capture_output=True, text=True, cwd=REPO, timeout=300)
        assert r.returncode == 0, r.stderr
        generate.main(argv)
        assert json.loads(r.stdout.strip().splitlines()[-1])["tokens"] == \
            last_json(capsys)["tokens"]
