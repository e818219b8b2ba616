"""One error vocabulary (issue 37): the same check names the Python API's parameter from the API
(`target_sparsity`) and the flag from a command line (`--target-sparsity`), never an internal
name; every user-fixable API error is a pij.UserError; files named by flags fail in one line that
names the flag and the file; help texts say what each flag does today."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

import powerinfer_jax as pij
from helpers_models import save_hf_llama
from powerinfer_jax import _cli, calibrate, evaluate, generate, serve
from powerinfer_jax.sparsity import corpus

REPO = Path(__file__).resolve().parents[1]
CPUS = min(len(os.sched_getaffinity(0)), 256)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_messages")
    save_hf_llama(d)
    return d


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return pij.load(str(tiny_dir), max_seq_len=96, progress=False)


def api_error(call) -> str:
    with pytest.raises(pij.UserError) as e:
        call()
    return str(e.value)


def cli_error(main, argv) -> str:
    with pytest.raises(pij.UserError) as e:
        main(argv)
    return str(e.value)


def one_line_exit(argv) -> str:
    """Through `python -m`: status 2, one line on stderr, no traceback."""
    r = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, cwd=REPO,
                       timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, r.stderr
    return lines[0]


# ---------------------------------------------------------------------------- one vocabulary
@pytest.mark.parametrize("api_kw,argv,api_msg,cli_msg", [
    (dict(sparsity="threshold", target_sparsity=1.5), ["--sparsity", "threshold",
     "--target-sparsity", "1.5"], "target_sparsity: expected a float in (0, 1), got 1.5",
     "--target-sparsity: expected a float in (0, 1), got 1.5"),
    (dict(max_seq_len=10 ** 6), ["--max-seq-len", str(10 ** 6)],
     "max_seq_len: expected at most 128", "--max-seq-len: expected at most 128"),
    (dict(sparsity="dense", gate_up="q4"), ["--gate-up", "q4"],
     "gate_up: expected 'full' unless sparsity is 'predictor'",
     "--gate-up: expected 'full' unless sparsity is 'predictor' with predictor 'q4' (the q4 "
     "estimate supplies the activations), got 'q4' (--sparsity 'dense', --predictor 'q4')"),
    (dict(decode_block=0), ["--decode-block", "0"], "decode_block: expected an integer in [1, 64]",
     "--decode-block: expected an integer in [1, 64]"),
    # one rule and one message for the thread count (issue 53: the API named an internal
    # function and the pool's cap of 256, the CLI the CPUs available)
    (dict(threads=0), ["--threads", "0"], f"threads: expected an integer in [1, {CPUS}] (the "
     "CPUs this process may run on), got 0", f"--threads: expected an integer in [1, {CPUS}] "
     "(the CPUs this process may run on), got 0"),
    (dict(threads=999), ["--threads", "999"], f"threads: expected an integer in [1, {CPUS}] (the "
     "CPUs this process may run on), got 999", f"--threads: expected an integer in [1, {CPUS}] "
     "(the CPUs this process may run on), got 999"),
])
def test_the_same_check_speaks_the_api_or_the_cli(tiny_dir, api_kw, argv, api_msg, cli_msg):
    msg = api_error(lambda: pij.load(str(tiny_dir), progress=False, **api_kw))
    assert api_msg in msg and "--" not in msg.split(":")[0] and "Config." not in msg
    msg = cli_error(generate.main, ["--model", str(tiny_dir), "--prompt", "x", *argv])
    assert cli_msg in msg and "Config." not in msg


def test_a_flag_error_is_one_line_from_the_command_line(tiny_dir):
    line = one_line_exit(["powerinfer_jax.generate", "--model", str(tiny_dir), "--prompt", "x",
                          "--sparsity", "threshold", "--target-sparsity", "1.5"])
    assert line == "error: --target-sparsity: expected a float in (0, 1), got 1.5"


def test_flag_words():
    flags = {"--target-sparsity", "--max-seq-len", "--devices", "--ctx", "--text"}
    assert _cli.flag_words("target_sparsity: expected x", flags) == "--target-sparsity: expected x"
    assert _cli.flag_words("devices=4: expected a divisor", flags) == \
        "--devices 4: expected a divisor"
    assert _cli.flag_words("prompt: expected fewer (raise max_seq_len)", flags) == \
        "prompt: expected fewer (raise --max-seq-len)"
    assert _cli.flag_words("text: expected 512 tokens (ctx=512) in /a/max_seq_len.txt", flags) == \
        "--text: expected 512 tokens (--ctx 512) in /a/max_seq_len.txt"
    assert _cli.flag_words("top_k: expected x", flags) == "top_k: expected x"  # not a flag here


# ---------------------------------------------------------------------------- API errors
@pytest.mark.parametrize("call,match", [
    (lambda m: m.perplexity("hello world"), "text: expected at least 512 tokens"),
    (lambda m: m.perplexity(b"bytes"), "text: expected a str, got bytes"),
    (lambda m: m.perplexity("x " * 300, ctx=1), "ctx: expected an integer >= 2"),
    (lambda m: m.perplexity("x " * 300, ctx=16, max_chunks=0),
     "max_chunks: expected a positive integer"),
    (lambda m: m.generate(123), "prompt: expected text, a list of token ids .*got int 123"),
    (lambda m: m.generate([1.5, 2]), "prompt: expected text, a list of token ids"),
    (lambda m: m.generate("x", max_new_tokens=0), "max_new_tokens: expected an integer >= 1"),
    (lambda m: m.generate("x", temperature=-1), "temperature: expected a finite float >= 0"),
])
def test_user_fixable_api_errors_are_user_errors(llm, call, match):
    with pytest.raises(pij.UserError, match=match) as e:
        call(llm)
    assert not str(e.value).startswith("--")


def test_dtype_from_the_api_names_the_parameter(tiny_dir):
    msg = api_error(lambda: pij.load(str(tiny_dir), dtype="float16", progress=False))
    assert msg.startswith("dtype: expected one of ['float32', 'bfloat16']")


# ---------------------------------------------------------------------------- max-new-tokens
def test_max_new_tokens_is_at_least_one_everywhere(tiny_dir, llm):
    assert ">= 1" in generate.build_parser().format_help().split("--max-new-tokens")[-1][:200]
    msg = cli_error(generate.main, ["--model", str(tiny_dir), "--prompt", "x",
                                    "--max-new-tokens", "0"])
    assert msg == "--max-new-tokens: expected an integer >= 1, got 0"
    assert "max_new_tokens: expected an integer >= 1, got 0" in api_error(
        lambda: llm.generate("x", max_new_tokens=0))


# ---------------------------------------------------------------------------- files
def test_a_binary_text_file_is_one_line_naming_the_file_and_flag(tiny_dir, tmp_path):
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    line = one_line_exit(["powerinfer_jax.evaluate", "--model", str(tiny_dir), "--text",
                          str(binary)])
    assert line.startswith("error: --text: expected a UTF-8 text file") and str(binary) in line
    msg = cli_error(evaluate.main, ["--model", str(tiny_dir), "--text", str(binary)])
    assert "byte 128 is not UTF-8" in msg
    with pytest.raises(pij.UserError, match="--corpus: expected UTF-8 text files"):
        calibrate.main(["--model", str(tiny_dir), "--corpus", str(binary), "--no-progress"])
    with pytest.raises(pij.UserError, match=r"corpus: expected UTF-8 text files.*weights\.bin"):
        corpus.read_corpus([binary])


@pytest.fixture
def validation(tmp_path, monkeypatch):
    """A project data folder whose validation text is ours."""
    data = tmp_path / "data"
    data.mkdir()
    valid = data / corpus.VALIDATION_NAME
    valid.write_text("".join(f"Validation sentence number {i} about the history of things.\n"
                             for i in range(400)))
    monkeypatch.setattr(corpus, "SHARED_DATA", data)
    corpus._validation_text.cache_clear()
    yield valid
    corpus._validation_text.cache_clear()


def test_the_validation_guard_compares_content_not_names(validation, tmp_path, tiny_dir):
    text = validation.read_text()
    copy = tmp_path / "train_copy.txt"
    copy.write_text(text)
    link = tmp_path / "linked.txt"
    os.symlink(validation, link)
    pasted = tmp_path / "mixed.txt"
    pasted.write_text("Training prose. " * 200 + text[5000:15000] + " More training prose." * 50)
    clean = tmp_path / "train.txt"
    clean.write_text("Training prose about other things entirely. " * 400)
    for f in (copy, link, pasted, validation):
        with pytest.raises(pij.UserError, match="expected training text.*validation file"):
            corpus.read_corpus([f])
    assert corpus.read_corpus([clean]).startswith("Training prose")
    with pytest.raises(pij.UserError, match="--corpus: expected training text"):
        calibrate.main(["--model", str(tiny_dir), "--corpus", str(copy), "--no-progress"])


# ---------------------------------------------------------------------------- help texts
def test_serve_help_lists_only_flags_it_uses():
    text = serve.build_parser().format_help()
    assert "--json" not in text and "--decode-block" not in text
    assert "--warmup" in text and "--parallel" in text
    with pytest.raises(SystemExit):
        serve.parse_args(["--json"])


def test_dtype_help_says_quantized_weights_keep_their_blocks():
    text = " ".join(generate.build_parser().format_help().split())
    assert "weight dtype for matmuls" not in text
    assert "quantized GGUF's matrices keep their 4/8-bit blocks" in text


def test_readme_stream_snippet_ends_its_line():
    readme = (REPO / "README.md").read_text()
    loop = readme.split("for piece in llm.stream(", 1)[1]
    assert loop.splitlines()[1].strip() == 'print(piece, end="", flush=True)'
    assert loop.splitlines()[2].strip() == "print()"


# ---------------------------------------------------------------------------- prompts (issue 53)
BAD_UTF8 = "ab" + b"\xff\xfe".decode("utf-8", "surrogateescape") + "cd"  # as argv decodes it


@pytest.mark.parametrize("call", [
    lambda m: m.generate(BAD_UTF8, max_new_tokens=2),
    lambda m: m.generate(["fine", BAD_UTF8], max_new_tokens=2),
    lambda m: m.encode(BAD_UTF8, chat=True),
    lambda m: list(m.stream(BAD_UTF8, max_new_tokens=2)),
])
def test_invalid_utf8_in_a_prompt_is_one_user_error(llm, call):
    msg = api_error(lambda: call(llm))
    assert msg.startswith("prompt: expected valid UTF-8 text, got byte 0xff at character 2")


def test_invalid_utf8_on_the_command_line_is_one_line_before_the_load(tiny_dir):
    line = one_line_exit(["powerinfer_jax.generate", "--model", str(tiny_dir), "--prompt",
                          b"ab\xff\xfecd"])
    assert line.startswith("error: --prompt: expected valid UTF-8 text, got byte 0xff at "
                           "character 2")


@pytest.fixture(scope="module")
def base_gguf(tmp_path_factory):
    """A model that ships no chat template (a base model)."""
    from helpers_models import gpt2_tokenizer_meta, write_tiny_gguf

    path = tmp_path_factory.mktemp("base") / "base.gguf"
    meta = gpt2_tokenizer_meta()
    del meta["chat_template"]
    write_tiny_gguf(path, tokenizer_meta=meta)
    return path


def test_chat_on_a_base_model_is_refused_unless_a_template_is_named(base_gguf, tmp_path):
    """It silently used ChatML (issue 53): refused in one line, as transformers and vLLM refuse
    it; --chat-template / chat_template= names one."""
    msg = cli_error(generate.main, ["--model", str(base_gguf), "--prompt", "hi", "--chat",
                                    "--max-new-tokens", "2"])
    assert msg.startswith("--chat: expected a model with a chat template (tokenizer.chat_template "
                          "in a GGUF, or the template in a Hugging Face directory's "
                          "tokenizer_config.json), got a model without one")
    assert msg.endswith("(a base model: leave chat off, or name a template: --chat-template "
                        "chatml or a jinja file)")
    llm = pij.load(str(base_gguf), progress=False)
    assert "chat_template=chatml" in api_error(lambda: llm.generate("hi", chat=True))
    named = pij.load(str(base_gguf), progress=False, chat_template="chatml")
    assert named.encode("hi", chat=True) == named.encode(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    missing = tmp_path / "none.jinja"
    assert cli_error(generate.main, ["--model", str(base_gguf), "--prompt", "hi", "--chat",
                                     "--chat-template", str(missing)]) == \
        f"--chat-template: expected \"chatml\" or an existing jinja file, got '{missing}'"
