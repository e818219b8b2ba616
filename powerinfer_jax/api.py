"""The Python API: `load` a model once, then generate, stream, score and inspect it.

    import powerinfer_jax as pij
    llm = pij.load("smollm2-135m", dtype="bfloat16", sparsity="predictor", max_batch=4)
    print(llm.generate("The capital of France is", max_new_tokens=16).text)
    for piece in llm.stream("Tell me a story", chat=True, temperature=0.7, seed=1):
        print(piece, end="")
    outs = llm.generate(["one", "two", "three"], max_new_tokens=8)   # batched decode steps
    llm.perplexity(open("wiki.valid.txt").read(), ctx=512, max_chunks=4)

Every CLI (generate, evaluate, bench, calibrate) and the server run through this module and
`runtime.session.build`, so a script and a command line give the same tokens.
"""
from __future__ import annotations

import dataclasses
from typing import Iterator, Sequence

import numpy as np

from powerinfer_jax.config import (DEFAULT_MODEL, PlacementConfig, RuntimeConfig,
                                   SamplingParams, SparsityConfig)
from powerinfer_jax.errors import check, raw, shown
from powerinfer_jax.runtime.session import build


@dataclasses.dataclass
class Completion:
    """One generated continuation."""

    text: str
    token_ids: list[int]  # generated ids, the stop token included when one ended it
    prompt_tokens: int
    finish_reason: str  # "stop" (a stop token or stop string) | "length" (max_new_tokens)
    prefill_tok_s: float
    decode_tok_s: float
    first_token_s: float  # compile (when cold) + prefill


def load(model: str = DEFAULT_MODEL, *, dtype: str = "float32", sparsity: str = "dense",
         target_sparsity: float | None = None, predictor: str = "q4", gate_up: str = "full",
         threshold: float = 0.0, vram_budget: float | None = None, offload: str = "hybrid",
         ram_budget: float | None = None, neuron_cache: str = "frequency",
         predictors: str | None = None,
         threads: int | None = None, max_seq_len: int | None = None, max_batch: int = 1,
         kernels: str = "auto", weights: str = "auto", artifacts: str | None = None,
         progress: bool = True, devices: int | None = None,
         decode_block: int = RuntimeConfig.decode_block,
         chat_template: str | None = None) -> "LLM":
    """Load `model` (registry name, .gguf file or Hugging Face directory) ready to run.

    dtype: compute and weight dtype ("float32" or "bfloat16"). sparsity: a registered mode
    (sparsity/modes.py: dense, oracle, threshold, predictor, ...) with its target_sparsity
    (default 0.5 where the mode needs one), predictor ("q4" or "lowrank") and gate_up ("full" or
    "q4"); predictors: the GGUF holding PowerInfer-form predictors (sparsity "powerinfer").
    vram_budget (GiB) and offload place FFN neurons hot/cold. ram_budget (GiB): host memory for
    the model; FFN neurons beyond it are read from disk per token (runtime/offload.py), and of a
    mixture-of-experts model the routed experts (runtime/expert_offload.py), the dynamic part of
    the neuron or expert cache evicting by `neuron_cache` ("score", the router's decayed
    probabilities: experts only). threads: the kernels' thread
    pool (XLA's own pool is sized when JAX starts: pin the process first to limit it, as the CLIs
    do). max_seq_len: KV cache length per sequence; max_batch: sequences decoded together (each
    gets a cache row). weights: "auto" keeps a quantized GGUF's matrices in its block format
    and computes on them; "dtype" dequantizes them to `dtype`. artifacts: where the sparsity
    artifacts live (default: next to the model). devices: tensor parallel over the first N
    devices (attention heads and FFN neurons split, runtime/mesh.py); None: one device.
    decode_block: decode steps per executable call (generate and stream; runtime/decode.py).
    chat_template: "chatml" or a jinja file, for chat=True on a model that ships no template
    (a base model; without one chat is refused) or to replace the model's own.
    """
    from powerinfer_jax.tokenizer import resolve_chat_template  # lazy: start-up

    template = None if chat_template is None else resolve_chat_template(chat_template)
    runtime = RuntimeConfig(dtype=dtype, threads=threads, max_seq_len=max_seq_len,
                            kernels=kernels, weights=weights, devices=devices,
                            decode_block=decode_block)
    sp = SparsityConfig(mode=sparsity, threshold=float(threshold), predictor=predictor,
                        gate_up=gate_up, predictor_file=predictors,
                        target_sparsity=None if target_sparsity is None else float(target_sparsity))
    place = PlacementConfig(vram_budget_gib=vram_budget, offload=offload,
                            ram_budget_gib=ram_budget, neuron_cache=neuron_cache)
    llm = LLM(build(model, runtime, sp, placement=place, artifacts_root=artifacts,
                    max_batch=max_batch, progress=progress))
    if template is not None:
        llm.tokenizer.chat_template = template
    return llm


class LLM:
    """A built model (`runtime.session.Session`) with the calls research scripts need."""

    def __init__(self, session):
        self.session = session

    @property
    def tokenizer(self):
        return self.session.tokenizer

    @property
    def config(self):
        return self.session.config

    @property
    def model(self):
        return self.session.model

    # ------------------------------------------------------------------ generation
    def encode(self, prompt: str | Sequence[int], *, chat: bool = False) -> list[int]:
        """Token ids of a prompt (text, or ids passed through); chat wraps text in the model's
        chat template as one user message."""
        if not isinstance(prompt, str):
            ids = prompt.tolist() if isinstance(prompt, np.ndarray) else prompt
            check(isinstance(ids, (list, tuple)) and all(
                isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in ids),
                "prompt", "text, a list of token ids (integers) or, for generate, a list of "
                "such prompts", shown(prompt))
            return [int(t) for t in ids]
        check(bool(prompt), "prompt", "non-empty text", prompt)
        from powerinfer_jax.tokenizer import check_text  # lazy: start-up

        check_text(prompt, "prompt")  # before a chat template moves its characters
        tok = self.tokenizer
        text = tok.apply_chat([{"role": "user", "content": prompt}]) if chat else prompt
        return tok.encode(text, what="prompt")

    def _request(self, prompt, *, max_new_tokens, temperature, top_k, top_p, seed, stop, chat,
                 on_text=None):
        from powerinfer_jax.runtime.scheduler import Request  # lazy: start-up

        ids = self.encode(prompt, chat=chat)
        text = _StopText(self.tokenizer, stop, on_text)
        req = Request(ids, max_new_tokens, SamplingParams(temperature, top_k, top_p), seed,
                      self.tokenizer.eos_ids, text.feed)
        return req, text

    def generate(self, prompt: str | Sequence[int] | list, *, max_new_tokens: int = 64,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 stop: Sequence[str] = (), chat: bool = False, on_text=None
                 ) -> Completion | list[Completion]:
        """Continue `prompt` (text or token ids), or each of a list of prompts (decoded together,
        up to max_batch at a time; prompt i uses seed + i). Stops at the model's EOS tokens,
        at any of the `stop` strings (excluded from the text) or after max_new_tokens.
        on_text(piece), for one prompt: called with each piece of text as soon as it is decoded."""
        many = isinstance(prompt, list) and (not prompt or not isinstance(prompt[0], int))
        prompts = prompt if many else [prompt]
        check(len(prompts) > 0, "prompts", "at least one prompt", prompts)
        check(on_text is None or not many, "on_text", "a single prompt", f"{len(prompts)} prompts")
        jobs = [self._request(p, max_new_tokens=max_new_tokens, temperature=temperature,
                              top_k=top_k, top_p=top_p, seed=seed + i, stop=stop, chat=chat,
                              on_text=on_text)
                for i, p in enumerate(prompts)]
        results = self.session.engine.run([req for req, _ in jobs])
        outs = [_completion(res, text) for res, (_, text) in zip(results, jobs)]
        return outs if many else outs[0]

    def stream(self, prompt: str | Sequence[int], *, max_new_tokens: int = 64,
               temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
               stop: Sequence[str] = (), chat: bool = False) -> Iterator[str]:
        """The continuation of one prompt as text pieces, each yielded as soon as it is decoded
        (a stop string is never yielded, even in part)."""
        from powerinfer_jax.runtime.scheduler import Scheduler  # lazy: start-up

        pieces: list[str] = []
        req, text = self._request(prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                                  top_k=top_k, top_p=top_p, seed=seed, stop=stop, chat=chat,
                                  on_text=pieces.append)
        sched = Scheduler(self.session.engine, block=self.session.engine.decode_block)
        sched.add(req)
        done = False
        while not done:
            done = bool(sched.step())
            if done:
                text.finish()
            yield from pieces
            pieces.clear()

    # ------------------------------------------------------------------ scoring and hooks
    def perplexity(self, text: str, *, ctx: int = 512, max_chunks: int | None = None,
                   progress: bool = False, score: str = "all", bos: bool | None = None) -> dict:
        """Perplexity over non-overlapping ctx-token chunks with the model's sparsity mode;
        also the measured FFN sparsity and, in predictor mode, the predictor's recall of the
        oracle active set. score: "all" (every token of a chunk but its first; every text token
        after a BOS) or "second-half" (as llama.cpp's llama-perplexity: the tokens after the
        first ctx/2 of each chunk); bos: whether each chunk starts with BOS (None: as the
        model's tokenizer says, e.g. a GGUF's tokenizer.ggml.add_bos_token). The result says
        which ("score", "bos"); runtime/perplexity.py has the details."""
        from powerinfer_jax.runtime.perplexity import check_scoring, perplexity  # lazy: start-up

        check(isinstance(text, str), "text", "a str", shown(text))
        check_scoring(ctx, max_chunks, score)
        tok = self.tokenizer
        check(bos is None or isinstance(bos, bool), "bos", "True, False or None (the model's "
              "own flag)", bos)
        check(not bos or tok.bos_id is not None, "bos", "a model with a BOS token",
              raw("a tokenizer without one"))
        use_bos = (tok.add_bos and tok.bos_id is not None) if bos is None else bos
        ids = tok.encode(text, add_bos=False)
        return perplexity(self.model, ids, ctx=ctx, max_chunks=max_chunks,
                          oracle_thresholds=self.session.oracle_thresholds, progress=progress,
                          bos_id=tok.bos_id if use_bos else None, score=score)

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Next-token logits [T, V] (float32) of a token sequence, with the model's mode."""
        return np.asarray(self._forward(token_ids, lambda m, h, sown: m.logits(h))[0])

    def ffn_activations(self, text_or_ids: str | Sequence[int]) -> np.ndarray:
        """Every layer's FFN neuron activations a [L, T, F] (float32, computed densely) on the
        FFN inputs the configured model produces for the text."""
        def acts(m, h, sown):
            import jax.numpy as jnp

            return jnp.stack([layer.ffn.activations(x)[0]
                              for layer, x in zip(m.layers, sown["ffn_in"])])
        return np.asarray(self._forward(self._ids(text_or_ids), acts))

    def active_masks(self, text_or_ids: str | Sequence[int]) -> np.ndarray:
        """Every layer's active set [L, T, F] (bool) as the configured mode selects it (dense:
        every neuron with a non-zero activation)."""
        def masks(m, h, sown):
            import jax.numpy as jnp

            from powerinfer_jax.models.transformer import block_residuals  # lazy: start-up

            out = []
            for layer, x, r in zip(m.layers, sown["ffn_in"], block_residuals(sown, len(m.layers))):
                a = layer.ffn.activations(x)
                sel = layer.ffn.selector
                out.append((a != 0 if sel is None
                            else sel.select_in_block(layer.ffn, x, r).active(a))[0])
            return jnp.stack(out)
        return np.asarray(self._forward(self._ids(text_or_ids), masks))

    def profile(self, corpus_files: Sequence[str] | None = None, *, ctx: int = 512,
                max_tokens: int = 32768, progress: bool = False):
        """Activation statistics of the dense model over a corpus (default: the project's wiki
        training text): sparsity.profile.ActivationProfile (frequencies, histograms)."""
        from powerinfer_jax.sparsity import corpus as corpus_mod  # lazy: start-up
        from powerinfer_jax.sparsity import profile as prof  # lazy: start-up

        files = corpus_mod.default_corpus_files() if corpus_files is None else list(corpus_files)
        ids = self.tokenizer.encode(corpus_mod.read_corpus(files), add_bos=False)
        chunks = corpus_mod.corpus_chunks(ids, min(ctx, self.config.max_seq_len), max_tokens)
        x = prof.collect_ffn_inputs(self.model, chunks, progress=progress)
        return prof.profile_activations(self.model, x, progress=progress)

    def calibrate(self, target_sparsity: float, *, corpus_files: Sequence[str] | None = None,
                  lowrank=False, out: str | None = None, ctx: int = 512,
                  max_tokens: int = 32768, progress: bool = False):
        """Build the sparsity artifacts for `target_sparsity` (thresholds of every mode, the
        profile; low-rank predictors when `lowrank`: True or a sparsity.predictor.TrainConfig)
        into `out` (default: the model's artifact directory, where load(..., sparsity=...) finds
        them; else pass load(..., artifacts=out)). Returns SparsityArtifacts (meta["root"]: the
        directory used)."""
        from powerinfer_jax.sparsity import artifacts as A  # lazy: start-up
        from powerinfer_jax.sparsity.predictor import TrainConfig  # lazy: start-up

        s = self.session
        check(s.sparsity.mode == "dense" and s.placement is None, "calibrate",
              "a dense, unplaced model (load(..., sparsity='dense'))",
              f"sparsity={s.sparsity.mode!r}, placed={s.placement is not None}")
        fp = A.model_fingerprint(s.model_arg, s.source, s.config)
        root = A.artifacts_root(s.model_arg, s.source) if out is None else out
        train = lowrank if isinstance(lowrank, TrainConfig) else TrainConfig() if lowrank else None
        arts = A.build_artifacts(s.model, s.tokenizer, fingerprint=fp, root=root,
                                 target_sparsity=target_sparsity, corpus_files=corpus_files,
                                 ctx=ctx, max_tokens=max_tokens, train=train, progress=progress)
        arts.meta["root"] = str(root)
        return arts

    def _ids(self, text_or_ids) -> list[int]:
        if isinstance(text_or_ids, str):
            return self.tokenizer.encode(text_or_ids, add_bos=False)
        return [int(t) for t in text_or_ids]

    def _forward(self, token_ids, fn):
        """fn(model, h [1, T, D], sown) on one uncached forward pass of token_ids."""
        import jax
        import jax.numpy as jnp
        from flax import nnx

        from powerinfer_jax.models.transformer import capture  # lazy: start-up

        ids = np.asarray(token_ids, np.int32)
        v = self.config.vocab_size
        check(ids.ndim == 1 and ids.size > 0 and ids.min() >= 0 and ids.max() < v, "token ids",
              f"a non-empty sequence of ids in [0, {v})", token_ids)
        check(ids.size <= self.config.max_seq_len, "token ids",
              f"at most {self.config.max_seq_len} tokens (the model's context)", ids.size)
        graphdef, state = nnx.split(self.model)

        @jax.jit
        def run(state, tokens):
            m = nnx.merge(graphdef, state)
            (h, _), sown = capture(lambda m: m.hidden(tokens, jnp.arange(tokens.shape[1])[None]),
                                   m)
            return fn(m, h, sown)

        return run(state, jnp.asarray(ids[None]))


class _StopText:
    """Detokenizes a sequence as it grows and ends it at the first stop string: pieces go to
    `on_text` as soon as no stop string can still begin inside them."""

    def __init__(self, tokenizer, stop: Sequence[str], on_text=None):
        from powerinfer_jax.tokenizer import StreamDecoder  # lazy: start-up

        if isinstance(stop, str):
            stop = [stop]
        for s in stop:
            check(isinstance(s, str) and s != "", "stop", "non-empty strings", s)
        self.stream = StreamDecoder(tokenizer)
        self.eos = set(tokenizer.eos_ids)
        self.stop = list(stop)
        self.on_text = on_text
        self.text = ""  # everything decoded so far (up to a stop string)
        self.sent = 0  # characters already handed to on_text
        self.stopped = False

    def feed(self, token: int) -> bool:
        """Take one generated token; True when a stop string ended the text."""
        if token not in self.eos:
            self.text += self.stream.feed(token)
        self._cut()
        self._emit(final=self.stopped)
        return self.stopped

    def finish(self) -> None:
        if not self.stopped:
            self.text += self.stream.flush()
            self._cut()
        self._emit(final=True)

    def _cut(self) -> None:
        hits = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True

    def _emit(self, final: bool) -> None:
        hold = 0 if final else max((len(s) - 1 for s in self.stop), default=0)
        end = max(self.sent, len(self.text) - hold)
        if self.on_text is not None and end > self.sent:
            self.on_text(self.text[self.sent:end])
        self.sent = end


def _completion(res, text: _StopText) -> Completion:
    text.finish()
    reason = "stop" if text.stopped or res.stop_reason == "eos" else "length"
    return Completion(text=text.text, token_ids=res.tokens, prompt_tokens=res.prompt_tokens,
                      finish_reason=reason, prefill_tok_s=res.prefill_tok_s,
                      decode_tok_s=res.decode_tok_s, first_token_s=res.first_token_s)
