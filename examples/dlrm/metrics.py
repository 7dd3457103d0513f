"""The DLRM demo's measurements: AUC and log loss (`evaluate`), the timing of its jitted steps (`time_calls`,
`measure_device_step`, `measure_emb_share`) and the device's peak memory (`peak_memory`). See
`examples.dlrm.train`."""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from examples.dlrm.checkpoint import TrainState

IN_PLACE_BYTES = 1 << 34  # tables of 16 GiB or more: the demo's timing runs on the state itself, no copies


def allow_most_device_memory(fraction: float = 0.96) -> bool:
    """Let jax's GPU allocator take `fraction` of the device's memory (`XLA_PYTHON_CLIENT_MEM_FRACTION`; jax's
    own default is 0.75): MLPerf's tables in fp32 (97.4 GiB of an H200's 139 GiB) plus a step's temporaries
    (7.5 GiB at batch 65536) need more than 0.75. Sets the variable only when it is unset, and it takes effect
    only if jax has not started its GPU backend yet (the demo calls this first thing in `main`); returns
    whether it set it."""
    if "XLA_PYTHON_CLIENT_MEM_FRACTION" in os.environ:
        return False
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(fraction)
    return True


# -- metrics ---------------------------------------------------------------------------


def auc(scores, labels) -> float:
    """ROC AUC by the rank formula (Mann-Whitney U), tied scores given their average rank."""
    scores = np.asarray(scores, np.float64).ravel()
    labels = np.asarray(labels).ravel() > 0.5
    n_pos = int(labels.sum())
    n_neg = labels.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    _, inverse, counts = np.unique(scores[order], return_inverse=True, return_counts=True)
    avg_rank = np.cumsum(counts) - (counts - 1) / 2.0  # 1-based average rank of each tie group
    ranks = np.empty(scores.size)
    ranks[order] = avg_rank[inverse]
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def log_loss(logits, labels) -> float:
    """Mean binary cross-entropy of labels under sigmoid(logits), in float64."""
    z = np.asarray(logits, np.float64)
    y = np.asarray(labels, np.float64)
    return float(np.mean(y * np.logaddexp(0.0, -z) + (1.0 - y) * np.logaddexp(0.0, z)))


def evaluate(eval_logits, state: TrainState, eval_set) -> dict:
    logits = np.concatenate([np.asarray(eval_logits(state.dense_params, state.emb_params, b)) for b, _, _ in eval_set])
    labels = np.concatenate([y for _, y, _ in eval_set])
    return {"auc": auc(logits, labels), "loss": log_loss(logits, labels)}


# -- timing ----------------------------------------------------------------------------


def _copy(tree):
    return jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), tree)


def time_calls(fn, reps: int, repeats: int = 3) -> float:
    """Median over `repeats` of the mean ms per call of `fn()` run `reps` times back to back."""
    jax.block_until_ready(fn())  # warm-up (compiles)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        r = None
        for _ in range(reps):
            r = fn()
        jax.block_until_ready(r)
        out.append((time.perf_counter() - t0) * 1e3 / reps)
    return float(np.median(out))


def measure_emb_share(model, built, state: TrainState, batch, reps: int, in_place: bool = False) -> dict:
    """ms of a full jitted step vs the embedding lookups + sparse update (`apply_gradients`) alone, same batch.

    Both run on copies of the state (they donate their inputs, so the copies are
    threaded through the repetitions), `reps` calls enqueued back to back and
    blocked once, median of 3 repetitions. `in_place`: on the state itself (no copy of
    the tables; `state` is then consumed): the result's "state" is the state after those steps.
    """
    cp = (lambda x: x) if in_place else _copy
    sp = {"dense": cp(state.dense_params), "opt": cp(state.dense_opt_state),
          "emb": cp(state.emb_params), "es": cp(state.emb_state)}

    def full():
        sp["dense"], sp["emb"], sp["es"], sp["opt"], loss = built.train_step(
            sp["dense"], sp["emb"], sp["es"], sp["opt"], built.emb_opt, batch)
        return loss

    step_ms = time_calls(full, reps)
    b = batch["dense"].shape[0]
    g_out = jax.random.normal(jax.random.key(1), (b, model.num_features * model.config.embedding_dim)) * 1e-3

    def emb_only():
        sp["emb"], sp["es"] = built.emb_step(sp["emb"], sp["es"], built.emb_opt, batch, g_out)
        return sp["es"]

    emb_ms = time_calls(emb_only, reps)
    out = {"step_ms": step_ms, "emb_ms": emb_ms, "share": emb_ms / step_ms}
    if in_place:
        out["state"] = state._replace(dense_params=sp["dense"], dense_opt_state=sp["opt"], emb_params=sp["emb"],
                                      emb_state=sp["es"])
    return out


def measure_device_step(built, state: TrainState, batches, in_place: bool = False):
    """The device step time: ms per training step with the batches already on the device.

    One warm-up step, then `len(batches)` steps enqueued back to back and blocked once at the end,
    on copies of `state` (the step donates the tables: the state itself is left as it is). `in_place`:
    on the state itself (no copy of the tables; `state` is consumed): returns (ms, the state after)."""
    jax.block_until_ready(batches)
    cp = (lambda x: x) if in_place else _copy
    dense, opt, emb, es = (cp(state.dense_params), cp(state.dense_opt_state), cp(state.emb_params),
                           cp(state.emb_state))
    dense, emb, es, opt, loss = built.train_step(dense, emb, es, opt, built.emb_opt, batches[0])
    jax.block_until_ready((dense, emb, es, opt, loss))
    t0 = time.perf_counter()
    for b in batches:
        dense, emb, es, opt, loss = built.train_step(dense, emb, es, opt, built.emb_opt, b)
    jax.block_until_ready((dense, emb, es, opt, loss))
    ms = (time.perf_counter() - t0) * 1e3 / len(batches)
    if in_place:
        return ms, state._replace(dense_params=dense, dense_opt_state=opt, emb_params=emb, emb_state=es)
    return ms


def peak_memory() -> int | None:
    """Peak bytes in use on the first device (`memory_stats()["peak_bytes_in_use"]`), None where not reported."""
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 (not every backend has memory stats)
        return None
    return None if not stats or "peak_bytes_in_use" not in stats else int(stats["peak_bytes_in_use"])
