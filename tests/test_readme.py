"""The README's training snippets run as written (on the CPU: the XLA path)."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import numpy as np

import tbe_jax

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _section_code(title: str) -> list[str]:
    text = README.read_text()
    start = text.index(title)
    end = text.find("\n### ", start + len(title))
    section = text[start: end if end >= 0 else None]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_training_snippets_run():
    """The train_step and apply_gradients blocks, each on its own (a reader copies one)."""
    blocks = _section_code("### Training: `tbe_jax.train_step`")
    blocks += _section_code("### `apply_gradients`, and the kernels behind it")
    assert len(blocks) == 2
    spaces = []
    for code in blocks:
        ns: dict = {}
        exec(compile(code, str(README), "exec"), ns)  # noqa: S102
        spaces.append(ns)
    assert int(spaces[0]["table_state"].count) == 3 and float(spaces[0]["loss"]) > 0
    assert [m.shape for m in spaces[1]["momentum"]] == [(1000,), (500,)]


def test_layer_snippet_runs():
    ns: dict = {}
    (code,) = _section_code("### Layers: Flax Linen, Flax NNX, Haiku")
    exec(compile(code, str(README), "exec"), ns)  # noqa: S102
    assert [t.shape for t in ns["per_table"]] == [(100, 8), (50, 4)]



def test_sharding_snippet_runs():
    ns: dict = {}
    (code,) = _section_code("### Several GPUs: `tbe_jax.shard`")
    exec(compile(code, str(README), "exec"), ns)  # noqa: S102
    assert [t.shape for t in ns["sharded"].get_tables(ns["params"])] == [(1000, 16), (50, 16), (300, 8)]
    assert int(ns["opt_state"].count) == 1 and float(ns["loss"]) > 0


def test_quickstart_and_tt_snippets_run():
    """The quickstart and the TT example also run on their own (no variable from another block)."""
    (code,) = _section_code("## Quickstart")
    ns: dict = {}
    exec(compile(code, str(README), "exec"), ns)  # noqa: S102
    assert ns["out"].shape == (2, 64 + 128 + 128)
    # the inference block continues the quickstart (its emb, params, indices, offsets)
    (inference,) = _section_code("### Inference: quantized rows")
    exec(compile(inference, str(README), "exec"), ns)  # noqa: S102
    assert ns["out"].shape == (2, 64 + 128 + 128) and ns["out"].dtype == ns["jnp"].float16
    assert [r.shape[1] for r in ns["rows"]] == [48, 80]  # int4 rows of D 64 / 128: 32 + 4 -> 48, 64 + 4 -> 80
    (code,) = _section_code("### Tensor-train tables")
    ns = {}
    exec(compile(code, str(README), "exec"), ns)  # noqa: S102
    assert ns["out"].shape == (2, 32)


def test_host_memory_snippet_runs():
    ns: dict = {}
    (code,) = _section_code("### Tables larger than the GPU's memory")
    exec(compile(code, str(README), "exec"), ns)  # noqa: S102
    emb = ns["emb"]
    assert ns["out"].shape == (1, 48) and int(emb.cache_stats(ns["params"])["fills"]) == 2
    dev = tbe_jax.TableBatchedEmbedding([dataclasses.replace(t, location="device") for t in emb.tables])
    ref = dev(dev.set_tables(None, emb.get_tables(ns["params"])), ns["indices"], ns["offsets"])
    np.testing.assert_allclose(np.asarray(ns["out"]), np.asarray(ref), rtol=1e-6, atol=1e-7)
