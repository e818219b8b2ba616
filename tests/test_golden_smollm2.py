"""Golden test on the real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against HF transformers,
which loads the same GGUF itself (dequantized to float32) and scores the same token ids."""
import math
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from powerinfer_jax.checkpoint import load_checkpoint
from powerinfer_jax.checkpoint.registry import resolve_model
from powerinfer_jax.config import SparsityConfig
from powerinfer_jax.runtime.perplexity import chunk_tokens, perplexity
from powerinfer_jax.models.transformer import from_params
from powerinfer_jax.runtime.decode import Engine
from helpers_models import hf_smollm2, with_mode

pytestmark = pytest.mark.slow  # the real SmolLM2 against HF transformers: minutes on 2 cores

VALID = Path(__file__).resolve().parents[2] / "shared" / "data" / "wiki.valid.txt"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def ours():
    ckpt = load_checkpoint("smollm2-135m")  # fetched into the cache on first use
    return ckpt, from_params(ckpt.config, ckpt.params)


@pytest.fixture(scope="module")
def hf_model():
    return hf_smollm2(resolve_model("smollm2-135m"))  # shared with test_checkpoint_gguf


def test_greedy_continuation_matches_hf(ours, hf_model):
    ckpt, model = ours
    ids = ckpt.tokenizer.encode(PROMPT)
    res = Engine(model, max_seq_len=256).generate(ids, max_new_tokens=16)
    with torch.no_grad():
        hf = hf_model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                               min_new_tokens=16)[0, len(ids):].tolist()
    assert res.tokens == hf, (ckpt.tokenizer.decode(res.tokens), ckpt.tokenizer.decode(hf))


@pytest.mark.skipif(not VALID.is_file(), reason=f"{VALID} not present (shared data folder)")
def test_perplexity_within_one_percent_of_hf(ours, hf_model):
    ckpt, model = ours
    ids = ckpt.tokenizer.encode(VALID.read_text(encoding="utf-8"), add_bos=False)
    # 2 chunks (1022 scored tokens, the same for both) keep the suite's budget: 16 took ~4 min
    # on a 2-core AVX2 machine. The 16-chunk comparison over Q4_1, Q4_K_M and Q8_0 files is
    # benchmarks/quant_ppl_vs_hf.py's
    res = perplexity(with_mode(model, SparsityConfig()), ids, ctx=512, max_chunks=2)
    nll = 0.0
    for chunk in chunk_tokens(ids, 512, 2):
        with torch.no_grad():
            logp = torch.log_softmax(hf_model(torch.tensor(chunk[None])).logits[0, :-1], -1)
        nll -= logp.gather(-1, torch.tensor(chunk[1:, None], dtype=torch.long)).sum().item()
    hf_ppl = math.exp(nll / res["tokens_scored"])
    assert res["tokens_scored"] == 2 * 511
    assert 5 < res["ppl"] < 40, res  # sanity: a wrong Q/K layout lands near 180
    assert abs(res["ppl"] / hf_ppl - 1) < 0.01, (res["ppl"], hf_ppl)


@pytest.mark.skipif(not VALID.is_file(), reason=f"{VALID} not present (shared data folder)")
def test_oracle_at_threshold_zero_equals_dense(ours):
    """Oracle sparsity skips only exact zeros at threshold 0: same perplexity and greedy tokens
    as dense, but through the sparse FFN custom call (the dense f32 path here is XLA's)."""
    ckpt, model = ours
    ids = ckpt.tokenizer.encode(VALID.read_text(encoding="utf-8"), add_bos=False)
    dense = perplexity(with_mode(model, SparsityConfig()), ids, ctx=256, max_chunks=1)
    oracle = perplexity(with_mode(model, SparsityConfig(mode="oracle", threshold=0.0)), ids,
                        ctx=256, max_chunks=1)
    assert abs(oracle["ppl"] / dense["ppl"] - 1) < 1e-4, (oracle["ppl"], dense["ppl"])
    prompt = ckpt.tokenizer.encode(PROMPT)
    a = Engine(with_mode(model, SparsityConfig()), max_seq_len=128).generate(
        prompt, max_new_tokens=16)
    b = Engine(with_mode(model, SparsityConfig(mode="oracle")), max_seq_len=128).generate(
        prompt, max_new_tokens=16)
    assert a.tokens == b.tokens
