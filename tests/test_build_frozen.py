"""A built model is not changed after its build: modules receive what they compute with at
construction (the build plan's layouts, selector, backend), and the first step assigns no module
attribute. The test walks the model the build returns, runs a first generation, and walks it
again: the same objects in the same places, and no attribute assignment in between."""
import pytest
from flax import nnx

import powerinfer_jax as pij
from helpers_models import tiny_llama_config, write_tiny_gguf

QTYPES = {"tok_embed": "Q8_0"} | {f"layers.{i}.{n}": t for i in range(2) for n, t in (
    ("attn.q.weight", "Q4_0"), ("attn.k.weight", "Q4_0"), ("attn.v.weight", "Q8_0"),
    ("attn.o.weight", "Q4_1"), ("ffn.gate.weight", "Q4_0"), ("ffn.up.weight", "Q4_0"),
    ("ffn.down_t.weight", "Q4_0"))}


def _ours(x) -> bool:
    return isinstance(x, nnx.Module) or (
        hasattr(x, "__dict__") and type(x).__module__.startswith("powerinfer_jax"))


def walk(obj, path="model", seen=None, out=None) -> dict:
    """{attribute path: (id, type name)} of every attribute of every module (and library object
    held by one) reachable from `obj`, through lists, tuples and dicts; `seen` ({id: object})
    collects the objects walked."""
    seen = {} if seen is None else seen
    out = {} if out is None else out
    if id(obj) in seen:
        return out
    seen[id(obj)] = obj
    for k, v in sorted(vars(obj).items()):
        p = f"{path}.{k}"
        out[p] = (id(v), type(v).__name__)
        if isinstance(v, (list, tuple)):
            items = [(f"{p}[{i}]", x) for i, x in enumerate(v)]
        elif isinstance(v, dict):
            items = [(f"{p}[{key!r}]", x) for key, x in v.items()]
        else:
            items = [(p, v)]
        for q, x in items:
            if _ours(x):
                out.setdefault(q, (id(x), type(x).__name__))
                walk(x, q, seen, out)
    return out


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("frozen") / "tiny.Q4_0.gguf"
    write_tiny_gguf(path, tiny_llama_config(activation="relu"), QTYPES)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dense", "oracle"])
def test_the_first_step_changes_no_module(gguf, mode, monkeypatch):
    llm = pij.load(str(gguf), sparsity=mode, progress=False)
    model = llm.session.model
    objects: dict = {}
    before = walk(model, seen=objects)
    assert len(before) > 100  # the walk reached the layers' modules
    walked = set(objects)  # the ids of the modules and library objects walked
    assigned: set[str] = set()

    def recording(original):
        def record(self, name, value):
            if id(self) in walked:
                assigned.add(f"{type(self).__name__}.{name}")
            original(self, name, value)
        return record

    monkeypatch.setattr(nnx.Module, "__setattr__", recording(nnx.Module.__setattr__))
    for cls in {type(x) for x in objects.values()}:  # the library's objects (selectors,
        if not issubclass(cls, nnx.Module):  # backends): their own __setattr__, recorded
            monkeypatch.setattr(cls, "__setattr__", recording(cls.__setattr__))
    out = llm.generate("hello there", max_new_tokens=4)
    assert out.token_ids  # it ran
    monkeypatch.undo()
    assert assigned == set()
    after = walk(model)
    assert {k for k in before if before[k] != after.get(k)} == set()
    assert set(after) == set(before)
