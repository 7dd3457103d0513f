"""Train the DLRM demo on synthetic click logs: one jitted `tbe_jax.train_step` per batch.

    python -m examples.dlrm.train [--size tiny|small|gpu|mlperf] [--model dlrm|dcnv2] [--steps N]
                                 [--batch-size B] [--seed S] [--lr LR] [--emb-lr LR] [--eval-batches K]
                                 [--dense-opt adam|adagrad] [--emb-dtype float32|float16] [--matmul-precision P]
                                 [--tt-tables K [--tt-rank R] [--tt-lr LR] [--tt-opt rowwise_adagrad|adagrad]]
                                 [--ckpt-dir DIR [--ckpt-every N] [--resume]] [--emb-share] [--no-progress]
                                 [--devices N] [--data device|host [--workers W]] [--time-steps K]

Each step is one `jax.jit` call of `tbe_jax.train_step` (`DLRM.train_step`): the TBE
lookup, the gradient of the loss with respect to the dense MLPs and to the pooled
embeddings (never to the tables), then exact row-wise Adagrad on the looked-up rows
(`emb.apply_gradients` with `tbe_jax.RowwiseAdagrad`; tables and accumulators are
donated); optax Adam updates the dense MLPs from `res.grads`. The embedding optimizer
is an ordinary (traced) argument of the jitted step: its learning rate is a value, so
another `--emb-lr` does not recompile. On a CPU the TBE runs its XLA path
(`impl="auto"`), whose update is the dense reference (work proportional to the
tables); on a GPU the Pallas kernels.

MLPerf DLRMv2 (`--model dcnv2`): the interaction is DCN v2's low-rank cross network
(`examples.dlrm.dcn`: x0 = [bottom, 26 pooled] `[B, 27*D]`, 3 cross layers `x0 * (U (V^T x) + b) + x` of
rank 512, then the top MLP; MLPerf's sizes at `--size gpu` / `mlperf`, narrower at `tiny` / `small`), every
dense matmul at `--matmul-precision` (default `tensorfloat32`; the dlrm model's default is `default`, XLA's
choice), the dense part trained by `optax.adagrad(lr, initial_accumulator_value=0, eps=1e-8)`
(`--dense-opt adagrad`, `G += g^2; w -= lr * g / sqrt(G + eps)`) and the data MLPerf's fixed bag sizes
(`data.DataConfig.preset(size, fixed_bags=True)`). `--size mlperf`: MLPerf's 26 tables (204,184,588 rows, one
97.4 GiB fp32 buffer at D=128; `--emb-dtype float16` halves it), batch 65536; the tables are drawn in
place (`TableBatchedEmbedding.init`, in blocks), and tables of 16 GiB or more are timed in place (the timing
steps continue training the state instead of copying it). The run prints and returns the build time (model,
data, jitted functions), the init time (tables and optimizer states on the device, compile included) and the
peak device memory (None where `memory_stats()` has none).

TT tables (`--tt-tables K`): the K largest tables are tensor-train tables
(`tt_jax.TTEmbeddingBag`, inner ranks `--tt-rank`, shapes from `TTSpec`'s defaults)
and the rest stay in the TBE; the step is one `tbe_jax.train_step` over a dict of two
lookups `{"tbe": ..., "tt": ...}`, and the TT cores are trained by row-wise Adagrad
(`tt_jax.RowwiseAdagrad`, one accumulator per core slice; `--tt-opt adagrad`:
element-wise `tt_jax.Adagrad`) on the touched core slices. Batches are split on the
host (`DLRM.split_batch`), or with `--data device` on the device (`data.select_features`). The run prints the embedding parameters' memory (the TBE's
tables plus the TT cores, against all tables dense) and the summary line says
`tables: X MiB (TT saves Y%)`; the data and the dense init depend only on the seed, so
a run with and one without `--tt-tables` (same seed and steps) compare like for like
(the TBE tables they share start equal too).

Several devices (`--devices N`, default 1): the tables are sharded over a 1-D mesh of
the first N devices (`tbe_jax.shard` with its default planner: whole tables placed on
the least loaded device, tables larger than a fair share split by rows); each step's
batch of B examples is split on the host into N local batches of B/N in the sharded
input format (`indices [N, cap]`, `offsets [N, F*(B/N)+1]`, ids zero-padded as the
one-device run pads them; `DLRM.shard_batch`), the dense features and labels are
split by rows over the same devices, and the dense MLPs run data parallel under `jit`
(parameters and Adam state replicated; XLA partitions the MLPs by the batch and sums
their gradients). The step is the same `tbe_jax.train_step`, its lookup the sharded
embedding's (ids to their tables' devices by all_to_all, the row-wise Adagrad update
on the owners). With `--data device` (the default) each device instead draws its own local
batch of B/N examples (`shard_map`; the same format, other examples than the one-device
run's). The tables start from the sharded embedding's own draw (the same
distribution as the one-device run, other values). On a CPU, make N devices with
`XLA_FLAGS=--xla_force_host_platform_device_count=N` set before Python starts (before
jax is imported; the demo also asks jax for N CPU devices itself when it can). With
`--tt-tables` the TT tables run data parallel over the same mesh (`tt_jax.shard`: the
cores and their state replicated on every device, each device looking up its own local
batch, the update on the whole batch's gradient); each local batch is split by features
into the TBE's and the TT tables' ids. Checkpoints hold the tables and their state in
the one-device format (`ShardedTableBatchedEmbedding.to_unsharded`; the TT cores as they
are), and run.json the device count.

Data (`--data`): `device` (the default) draws every batch on the device, in a jitted
function (`data.DeviceClickLog`, `data.draw`: jax.random from the key
`fold_in(fold_in(key(seed), stream), step)`, the host generator's hidden model copied to
the device once; one static id capacity, ids zero-padded past `offsets[-1]`), so the
training loop only enqueues work and never waits on the host; `host` is the NumPy
generator (`data.ClickLogGenerator`) on `--workers` threads, its batches copied to the
device (the data of the versions before `--data`). Both have the same feature
cardinalities, bag-length distributions, Zipf ids and label model, from other random
numbers: the two modes' batches (and their ceilings) differ. A `--data device` run's
run.json says `"data": "device"`; a checkpoint without it holds a host-data run and
resumes with `--data host`.

Timing: the wall time per step (from the second step, checkpoint saves left out) and
examples/s; then (`--time-steps K`, default 20; 0 skips it) the device step time: K
training steps on batches already on the device, enqueued back to back and blocked once
(`measure_device_step`, on copies of the state), and the device share = device step /
wall step (1.0: the device never waits for the host).

Evaluation: AUC (rank formula, ties averaged) and log loss on held-out batches,
before and after training, next to the hidden model's own ("oracle") AUC.

Checkpoints (`--ckpt-dir DIR`): `DIR/<step>/` is an orbax-checkpoint
`StandardCheckpointer` directory holding one pytree
`{"step", "dense_params", "dense_opt_state", "emb_params", "emb_state"}`
(step: int32 scalar; dense_params: `{"bottom"|"top": [{"w", "b"}, ...]}`;
dense_opt_state: optax Adam's state; emb_params: the TBE's `{"d{D}": [rows, D]}`;
emb_state: `tbe_jax.RowwiseAdagradState(momentum, count)` with `{"d{D}": [rows]}`
accumulators and the optimizer's int32 step count; with TT tables, emb_params is
`{"tbe": <that>, "tt": {"cores": per TT table group, per core}}` (`tt_jax.params`) and emb_state
`{"tbe": <that>, "tt": tt_jax.RowwiseAdagradState (or AdagradState)}`), and
`DIR/run.json` the settings that must match on resume (size, seed, batch size,
learning rates; with TT tables also tt_tables, tt_rank, tt_lr, tt_opt). Restoring
reads the arrays into the structure of a freshly initialised state
(`jax.eval_shape`), so NamedTuples come back as NamedTuples; a checkpoint written
before the optimizer states had a `count` restores too (its count is set to the
checkpoint's step). `--resume` continues from the newest `DIR/<step>` up to `--steps`
total; batches depend only on (seed, step) (in both data modes), so the result is bitwise
what a straight run gives.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import sys
import time
from typing import Any, Callable, NamedTuple

import jax
import numpy as np
import optax

import tbe_jax
import tt_jax
from examples.dlrm import data as data_lib
from examples.dlrm.checkpoint import (TrainState, per_embedding, placed, portable, latest_checkpoint,  # noqa: F401
                                      restore_checkpoint, save_checkpoint)
from examples.dlrm.model import DLRM, DLRMConfig
from examples.dlrm.metrics import (IN_PLACE_BYTES, allow_most_device_memory, auc, evaluate,  # noqa: F401
                                   log_loss, measure_device_step, measure_emb_share, peak_memory)
from examples.dlrm.pipeline import DeviceData, local_padded_len, prefetch, split_padded_len


@dataclasses.dataclass(frozen=True)
class SizeDefaults:
    batch_size: int
    steps: int
    lr: float  # Adam, dense layers
    emb_lr: float  # row-wise Adagrad, tables
    eval_batches: int
    tt_lr: float = 0.05  # optimizer of the TT cores (--tt-tables)
    tt_rank: int = 16  # their inner ranks


SIZES = {
    "tiny": SizeDefaults(batch_size=256, steps=60, lr=3e-3, emb_lr=0.05, eval_batches=8),
    "small": SizeDefaults(batch_size=512, steps=3000, lr=1e-3, emb_lr=0.05, eval_batches=16),
    "gpu": SizeDefaults(batch_size=8192, steps=2000, lr=1e-3, emb_lr=0.05, eval_batches=16, tt_rank=32),
    "mlperf": SizeDefaults(batch_size=65536, steps=300, lr=1e-3, emb_lr=0.05, eval_batches=4, tt_rank=32),
}
# --model dcnv2: dense Adagrad (MLPerf's optimizer); lr: the dense Adagrad's, emb_lr: the tables' row-wise Adagrad's.
# gpu / mlperf: MLPerf's 0.004 for both; tiny / small: higher (0.01 / 0.02), for the CPU's few steps (at 0.004
# the tiny run's AUC after 40 steps is ~0.68 against ~0.70 with these; 0.05 on the tables diverges at first).
DCNV2_SIZES = {
    "tiny": SizeDefaults(batch_size=256, steps=40, lr=0.01, emb_lr=0.02, eval_batches=8),
    "small": SizeDefaults(batch_size=512, steps=2000, lr=0.01, emb_lr=0.02, eval_batches=16),
    "gpu": SizeDefaults(batch_size=8192, steps=1000, lr=0.004, emb_lr=0.004, eval_batches=8, tt_rank=32),
    "mlperf": SizeDefaults(batch_size=65536, steps=3000, lr=0.004, emb_lr=0.004, eval_batches=4, tt_rank=32),
}
DENSE_OPTIMIZERS = ("adam", "adagrad")


def dense_optimizer(name: str, lr: float):
    """The dense part's optax optimizer: `optax.adam(lr)`, or (`"adagrad"`, MLPerf DLRMv2's) `optax.adagrad(lr,
    initial_accumulator_value=0.0, eps=1e-8)`, whose update (optax's `scale_by_rss`) is

        G += g**2;   w -= lr * g / sqrt(G + eps)   (and 0 where G == 0)

    element-wise, eps inside the square root (torch.optim.Adagrad puts it outside: `g / (sqrt(G) + eps)`;
    the two differ only while G is below ~eps). The tables' `tbe_jax.RowwiseAdagrad` is FBGEMM's:
    `m += mean(g**2 over the row)`, `row -= lr * g / (sqrt(m) + eps)`."""
    if name == "adam":
        return optax.adam(lr)
    if name == "adagrad":
        return optax.adagrad(lr, initial_accumulator_value=0.0, eps=1e-8)
    raise ValueError(f"dense optimizer {name!r} must be one of {DENSE_OPTIMIZERS}")


# -- the jitted functions (cached per configuration, so repeated main() calls reuse them) --


TT_OPTIMIZERS = {"rowwise_adagrad": tt_jax.RowwiseAdagrad, "adagrad": tt_jax.Adagrad}


class Built(NamedTuple):
    """What `build` returns: the jitted functions and the embedding optimizer they are called with."""

    init: Callable  # key -> (dense_params, dense_opt_state, emb_params, emb_state)
    train_step: Callable  # (dense_params, emb_params, emb_state, dense_opt_state, emb_opt, batch) -> (.., loss)
    eval_logits: Callable  # (dense_params, emb_params, batch) -> [B] logits
    emb_step: Callable  # (emb_params, emb_state, emb_opt, batch, g_out) -> (emb_params, emb_state)
    emb_opt: Any  # tbe_jax.RowwiseAdagrad, or {"tbe": ..., "tt": ...} with TT tables


def make_emb_opt(model: DLRM, emb_lr: float, tt_lr: float | None = None, tt_opt: str = "rowwise_adagrad"):
    """The embedding optimizer: row-wise Adagrad (emb_lr) on the TBE; with TT tables
    `{"tbe": that, "tt": TT_OPTIMIZERS[tt_opt] (tt_lr, default emb_lr)}`."""
    opt = tbe_jax.RowwiseAdagrad(learning_rate=emb_lr, eps=1e-8)
    if model.tt is not None:
        opt = {"tbe": opt, "tt": TT_OPTIMIZERS[tt_opt](learning_rate=emb_lr if tt_lr is None else tt_lr, eps=1e-8)}
    return opt


@functools.lru_cache(maxsize=8)
def _jitted(model: DLRM, lr: float, dense_opt: str = "adam"):
    """The jitted functions of one model and dense optimizer (`dense_optimizer(dense_opt, lr)`); the embedding
    optimizer is an argument (its hyperparameters are traced values: other embedding learning rates reuse the
    compiled code). `train_step` donates the tables and their state (and `init` writes the tables in place:
    `DLRM.init_tables`)."""
    dense_tx = dense_optimizer(dense_opt, lr)

    @jax.jit
    def init(key, emb_opt):
        dense_params, emb_params = model.init(key)
        if model.tt is None:
            emb_state = model.emb.init_opt_state(emb_params, emb_opt)
        else:
            emb_state = {"tbe": model.emb.init_opt_state(emb_params["tbe"], emb_opt["tbe"]),
                         "tt": model.tt.init_opt_state(emb_params["tt"], emb_opt["tt"])}
        dense_opt_state = dense_tx.init(dense_params)
        if model.mesh is not None:  # the dense part data parallel: its parameters on every device
            dense_params, dense_opt_state = jax.lax.with_sharding_constraint(
                (dense_params, dense_opt_state), model.sharding())
        return dense_params, dense_opt_state, emb_params, emb_state

    @functools.partial(jax.jit, donate_argnums=(1, 2))
    def train_step(dense_params, emb_params, emb_state, dense_opt_state, emb_opt, batch):
        res = model.train_step(dense_params, emb_params, emb_state, emb_opt, batch)
        updates, dense_opt_state = dense_tx.update(res.grads, dense_opt_state, dense_params)
        return optax.apply_updates(dense_params, updates), res.params, res.opt_state, dense_opt_state, res.loss

    @jax.jit
    def eval_logits(dense_params, emb_params, batch):
        return model.forward(dense_params, emb_params, batch)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def emb_step(emb_params, emb_state, emb_opt, batch, g_out):
        """The embedding part of a step alone: the lookups, then `apply_gradients` with the output gradient
        `g_out + 1e-3 * pooled` (that of `<pooled, g_out> + 5e-4 |pooled|^2`: it depends on the forward, so
        XLA cannot drop the lookup kernels)."""
        g = model.split_output_grad(g_out + 1e-3 * model.pooled(emb_params, batch))
        if model.tt is None:
            return model.emb.apply_gradients(emb_params, emb_state, emb_opt, batch["indices"], batch["offsets"], g)
        p_tbe, s_tbe = model.emb.apply_gradients(emb_params["tbe"], emb_state["tbe"], emb_opt["tbe"],
                                                 batch["indices"], batch["offsets"], g["tbe"])
        p_tt, s_tt = model.tt.apply_gradients(emb_params["tt"], emb_state["tt"], emb_opt["tt"],
                                              batch["tt_indices"], batch["tt_offsets"], g["tt"])
        return {"tbe": p_tbe, "tt": p_tt}, {"tbe": s_tbe, "tt": s_tt}

    return init, train_step, eval_logits, emb_step


def evaluate_quantized(model: DLRM, state: TrainState, eval_set, weight_types: str, log=print) -> dict:
    """`{weight type: {"auc", "loss", "table_bytes", "quantize_s"}}`: the trained model evaluated with its tables
    quantized (`tbe_jax.quantize`, one type at a time, freed after its evaluation; fp32 output). Only the
    all-TBE model on one device (TT tables and sharded tables are not quantized: an empty dict)."""
    names = [w for w in (weight_types or "").split(",") if w and w != "none"]
    if not names:
        return {}
    if model.tt is not None or not isinstance(model.emb, tbe_jax.TableBatchedEmbedding):
        log("quantized evaluation: skipped (TT or sharded tables; tbe_jax.quantize takes one TableBatchedEmbedding)")
        return {}
    out = {}
    for wt in names:
        t0 = time.perf_counter()
        qemb, qparams = tbe_jax.quantize(model.emb, state.emb_params, wt, output_dtype=jax.numpy.float32)
        jax.block_until_ready(qparams)
        t_q = time.perf_counter() - t0

        @jax.jit
        def q_logits(dense_params, qparams, batch, qemb=qemb):
            return model.logits(dense_params, batch["dense"], qemb(qparams, batch["indices"], batch["offsets"]))

        r = evaluate(q_logits, state._replace(emb_params=qparams), eval_set)
        nbytes = sum(int(v.size) * 4 for v in qparams.values())
        out[wt] = {"auc": r["auc"], "loss": r["loss"], "table_bytes": nbytes, "quantize_s": t_q}
        log(f"eval with the tables quantized to {wt}: AUC {r['auc']:.4f}, loss {r['loss']:.4f} "
            f"({nbytes / 2**20:,.1f} MiB of rows, quantized in {t_q:.1f} s)")
        del qparams
    return out


@functools.lru_cache(maxsize=8)
def build(model: DLRM, lr: float, emb_lr: float, tt_lr: float | None = None,
          tt_opt: str = "rowwise_adagrad", dense_opt: str = "adam") -> Built:
    """`Built(init, train_step, eval_logits, emb_step, emb_opt)` for this model and these learning rates.

    `emb_opt` (`make_emb_opt`) is passed to `train_step` and `emb_step` as an ordinary argument; `init`
    has it bound. With TT tables (`model.tt`) the embedding params, states and optimizers are dicts
    `{"tbe": ..., "tt": ...}`."""
    emb_opt = make_emb_opt(model, emb_lr, tt_lr, tt_opt)
    init, train_step, eval_logits, emb_step = _jitted(model, lr, dense_opt)
    return Built(functools.partial(init, emb_opt=emb_opt), train_step, eval_logits, emb_step, emb_opt)


# -- main ------------------------------------------------------------------------------


def _mem_summary(mem: dict) -> str:
    """The embedding parameters' memory (`DLRM.table_bytes()`) in words."""
    if mem["tt"] == 0:
        return f"{mem['total'] / 2**20:.2f} MiB (every table dense, in the TBE)"
    return (f"{mem['total'] / 2**20:.2f} MiB = TBE {mem['tbe'] / 2**20:.2f} MiB + TT cores "
            f"{mem['tt'] / 2**20:.2f} MiB, vs {mem['dense'] / 2**20:.2f} MiB with every table dense: TT saves "
            f"{100 * (1 - mem['total'] / mem['dense']):.1f}%")


def _state_bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m examples.dlrm.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="small",
                    help="tiny: tests; small (default): a few minutes on a 2-core CPU; gpu: tables of 10 to 1e6 rows; "
                         "mlperf: MLPerf DLRMv2's 26 tables (204,184,588 rows, 97.4 GiB at D=128 fp32) and fixed "
                         "multi-hot bag sizes, batch 65536")
    ap.add_argument("--model", choices=("dlrm", "dcnv2"), default="dlrm",
                    help="dlrm (default): dot interaction, Adam on the dense part; dcnv2: MLPerf DLRMv2 (DCN v2 "
                         "low-rank cross network, Adagrad everywhere, TF32 matmuls, MLPerf's fixed bag sizes)")
    ap.add_argument("--dense-opt", choices=DENSE_OPTIMIZERS, default=None,
                    help="optimizer of the dense part (default: adam for dlrm, adagrad for dcnv2)")
    ap.add_argument("--host-tables", type=int, default=0,
                    help="keep the K largest embedding tables in host memory behind an HBM cache (location "
                         "'host_cached'; with --devices N, each device caches its own pieces; no TT tables)")
    ap.add_argument("--cache-load-factor", type=float, default=0.2,
                    help="with --host-tables: each cache's share of its table's rows (default 0.2)")
    ap.add_argument("--emb-dtype", choices=("float32", "float16"), default="float32",
                    help="the tables' storage dtype (the TBE's weights_dtype; default float32)")
    ap.add_argument("--matmul-precision", default=None,
                    help="precision= of the dense matmuls: default (the backend's), tensorfloat32, float32, "
                         "bfloat16 (bf16 operands, fp32 sums), highest (default: tensorfloat32 for dcnv2, default "
                         "for dlrm)")
    ap.add_argument("--steps", type=int, default=None, help="total training steps (default: per size)")
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0, help="fixes the data (hidden model and batches) and the init")
    ap.add_argument("--lr", type=float, default=None, help="learning rate of the dense part (--dense-opt)")
    ap.add_argument("--emb-lr", type=float, default=None, help="row-wise Adagrad learning rate of the tables")
    ap.add_argument("--eval-batches", type=int, default=None, help="held-out batches for AUC and loss")
    ap.add_argument("--eval-every", type=int, default=0,
                    help="also evaluate (AUC, loss) every N steps (0: only before and after; not in the step time)")
    ap.add_argument("--eval-quantized", default="int8,int4",
                    help="after training, also evaluate the model with its tables quantized to these weight types "
                         "(tbe_jax.quantize: int8, int4, int2, fp8, float16, float32; comma-separated; 'none': skip)")
    ap.add_argument("--ckpt-dir", default=None, help="save a checkpoint here at the end (and every --ckpt-every)")
    ap.add_argument("--ckpt-every", type=int, default=0, help="also save every N steps (0: only at the end)")
    ap.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --ckpt-dir")
    ap.add_argument("--impl", choices=("auto", "xla", "pallas"), default="auto",
                    help="TBE (and TT) implementation")
    ap.add_argument("--tt-tables", type=int, default=0,
                    help="hold the K largest tables as tensor-train tables (tt_jax), the rest in the TBE (default 0)")
    ap.add_argument("--tt-rank", type=int, default=None,
                    help="inner TT ranks of those tables (3 cores; default: 16, 32 at --size gpu)")
    ap.add_argument("--tt-lr", type=float, default=None, help="learning rate of the TT cores (default: per size)")
    ap.add_argument("--tt-opt", choices=sorted(TT_OPTIMIZERS), default="rowwise_adagrad",
                    help="optimizer of the TT cores (on the touched core slices)")
    ap.add_argument("--emb-share", action="store_true",
                    help="measure the embeddings' share of step time (always done on a GPU)")
    ap.add_argument("--data", choices=("device", "host"), default="device",
                    help="device (default): draw each batch on the device inside a jitted function (jax.random, "
                         "key from seed and step), so the training loop never waits on the host; host: the "
                         "NumPy generator on --workers threads, batches copied to the device (the data of "
                         "earlier versions; checkpoints written without --data resume with --data host)")
    ap.add_argument("--workers", type=int, default=None,
                    help="--data host: data-generation threads (default: by CPU count)")
    ap.add_argument("--time-steps", type=int, default=20,
                    help="after training, time K steps enqueued back to back on batches already on the device "
                         "(the device step time; device share = device step / wall step); 0: skip (default 20)")
    ap.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    ap.add_argument("--devices", type=int, default=1,
                    help="shard the tables over the first N devices and split each batch into N local batches "
                         "(the dense MLPs data parallel); default 1. On a CPU, set "
                         "XLA_FLAGS=--xla_force_host_platform_device_count=N before starting Python (before jax "
                         "is imported), e.g. XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m "
                         "examples.dlrm.train --devices 2; the batch size must be a multiple of N")
    args = ap.parse_args(argv)
    d = (DCNV2_SIZES if args.model == "dcnv2" else SIZES)[args.size]
    if args.dense_opt is None:
        args.dense_opt = "adagrad" if args.model == "dcnv2" else "adam"
    for name in ("steps", "batch_size", "lr", "emb_lr", "eval_batches", "tt_lr", "tt_rank"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(d, name))
    if args.resume and not args.ckpt_dir:
        ap.error("--resume needs --ckpt-dir")
    if not 0 <= args.tt_tables < data_lib.NUM_SPARSE or args.tt_rank < 1:
        ap.error(f"--tt-tables must be in [0, {data_lib.NUM_SPARSE}) and --tt-rank >= 1")
    if args.steps < 0 or args.batch_size < 1 or args.eval_batches < 1 or args.time_steps < 0 or args.eval_every < 0:
        ap.error("--steps, --time-steps and --eval-every must be >= 0, --batch-size and --eval-batches >= 1")
    if args.devices < 1 or args.batch_size % args.devices:
        ap.error(f"--devices must be >= 1 and divide the batch size ({args.batch_size})")
    return args


def make_mesh(n: int):
    """A 1-D mesh ("data") of the first `n` devices, its axis automatic (XLA partitions the dense part).

    On a CPU with fewer devices, jax is first asked for `n` CPU devices (`jax_num_cpu_devices`), which
    works while no backend has started; else (or on another platform) a SystemExit says how to get them."""
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        try:
            jax.config.update("jax_num_cpu_devices", max(n, 1))
        except Exception:  # a backend already started (or an older jax): the devices are what they are
            pass
    devices = jax.devices()
    if len(devices) < n:
        raise SystemExit(
            f"--devices {n}: jax sees {len(devices)} {jax.default_backend()} device(s). On a CPU, set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before starting Python (before jax is "
            "imported).")
    return jax.make_mesh((n,), ("data",), devices=devices[:n], axis_types=(jax.sharding.AxisType.Auto,))


def configs(size: str, model: str = "dlrm", *, impl: str = "auto", emb_dtype: str = "float32",
            matmul_precision: str | None = None) -> tuple[data_lib.DataConfig, DLRMConfig]:
    """The data's and the model's configs of a `--size` and `--model` (dcnv2: fixed bag sizes, given to the tables
    as their `bag_size_hint`s); `matmul_precision` None keeps the model's default."""
    data_cfg = data_lib.DataConfig.preset(size, fixed_bags=model == "dcnv2")
    config = DLRMConfig.preset(size, data_cfg.table_rows, impl=impl, model=model, weights_dtype=emb_dtype)
    if data_cfg.bag_sizes is not None:
        config = dataclasses.replace(config, bag_size_hints=tuple(int(n) for n in data_cfg.bag_sizes))
    if matmul_precision is not None:
        config = dataclasses.replace(config, matmul_precision=matmul_precision)
    return data_cfg, config


def main(argv=None) -> dict:
    """Run the demo; returns {"auc_before", "auc_after", "eval_loss_before", "eval_loss_after",
    "oracle_auc", "final_loss", "steps", "steps_per_s", "examples_per_s", "step_ms", "wall_step_ms", "data",
    "start_step", "ckpt", "table_bytes", "dense_table_bytes", "state"} (state: the final `TrainState`;
    step_ms = wall_step_ms: wall time per training step after the first; data: "device" or "host";
    table_bytes: the embedding parameters, dense_table_bytes: the same tables all dense), plus
    "device_step_ms" and "device_share" (device step / wall step) with --time-steps K > 0 (the default),
    and "emb_share" and "jit_step_ms" when measured."""
    args = parse_args(argv)
    if args.size == "mlperf":  # before anything starts jax's GPU backend
        allow_most_device_memory()
    log = functools.partial(print, flush=True)
    mesh = make_mesh(args.devices) if args.devices > 1 else None  # first: it may set the CPU device count
    backend = jax.default_backend()
    t_build = time.perf_counter()
    data_cfg, config = configs(args.size, args.model, impl=args.impl, emb_dtype=args.emb_dtype,
                               matmul_precision=args.matmul_precision)
    if args.tt_tables:
        config = dataclasses.replace(config, tt_tables=args.tt_tables, tt_ranks=(args.tt_rank, args.tt_rank))
    if args.host_tables:
        if args.tt_tables:
            raise SystemExit("--host-tables runs without --tt-tables")
        config = dataclasses.replace(config, host_tables=args.host_tables, cache_load_factor=args.cache_load_factor)
    model = DLRM(config, mesh=mesh)
    tt_args = (args.tt_lr, args.tt_opt) if args.tt_tables else (None, "rowwise_adagrad")
    built = build(model, args.lr, args.emb_lr, *tt_args, dense_opt=args.dense_opt)
    init_fn, train_step, eval_logits, emb_opt = built.init, built.train_step, built.eval_logits, built.emb_opt
    gen = data_lib.ClickLogGenerator(data_cfg, args.batch_size, seed=args.seed)
    settings = {"size": args.size, "seed": args.seed, "batch_size": args.batch_size, "lr": args.lr,
                "emb_lr": args.emb_lr, "impl": args.impl}
    for name, default in (("model", "dlrm"), ("dense_opt", "adam"), ("emb_dtype", "float32")):
        if getattr(args, name) != default:  # (only then: older checkpoints' settings stay as they were)
            settings[name] = getattr(args, name)
    if config.matmul_precision != "default":
        settings["matmul_precision"] = config.matmul_precision
    prepare = None
    if args.tt_tables:  # (only then: the settings of a run without TT tables are what they always were)
        settings.update(tt_tables=args.tt_tables, tt_rank=args.tt_rank, tt_lr=args.tt_lr, tt_opt=args.tt_opt)
        pad = (split_padded_len(gen, model.tbe_features), split_padded_len(gen, model.tt_features))
        prepare = functools.partial(model.split_batch, padded_len=pad)
    batch_sharding = None
    if mesh is not None:  # (only then, likewise)
        settings["devices"] = args.devices
        local_cap = local_padded_len(gen, args.devices)
        if args.tt_tables:  # each local batch split by features (TBE, TT)
            local_cap = (local_padded_len(gen, args.devices, model.tbe_features),
                         local_padded_len(gen, args.devices, model.tt_features))
        prepare = functools.partial(model.shard_batch, cap=local_cap)
        batch_sharding = model.sharding("batch")
    device_data = None
    if args.data == "device":  # (a checkpoint without "data" was written with the host generator's batches)
        settings["data"] = "device"
        device_data = DeviceData(gen, model)
    restore_init = init_fn
    if mesh is not None and args.resume:  # a checkpoint holds the one-device format: that model's init's structure
        restore_init = build(DLRM(config), args.lr, args.emb_lr, *tt_args, dense_opt=args.dense_opt).init
    t_build = time.perf_counter() - t_build

    emb = model.emb_unsharded
    path = "Pallas kernels" if emb.uses_kernel() else "XLA path"
    rows = np.asarray(data_cfg.table_rows)
    log(f"DLRM demo | jax {jax.__version__} | backend {backend} ({jax.devices()[0].device_kind}) | TBE: {path}")
    log(f"size={args.size}: {data_cfg.num_dense} dense + {data_cfg.num_sparse} sparse features, tables of "
        f"{rows.min()}..{rows.max()} rows ({rows.sum():,} in all), D={model.config.embedding_dim}, "
        f"batch {args.batch_size}, ~{int(gen.bag_mean.sum() * args.batch_size):,} ids/batch "
        f"(padded to {gen.padded_len:,}), Zipf({data_cfg.alpha}); data: "
        + ("drawn on the device (jax.random in a jitted function, key from seed and step)" if device_data else
           "NumPy generator on the host"))
    if mesh is not None:
        counts = {st: model.emb.strategies.count(st) for st in ("table", "row", "column", "data")
                  if st in model.emb.strategies}
        per_dev = [0] * args.devices
        for t, spec in enumerate(emb.tables):
            share = spec.num_embeddings * spec.embedding_dim * emb.weights_dtype.itemsize
            strategy = model.emb.strategies[t]
            if strategy == "table":
                per_dev[model.emb.plan.owners[t]] += share
            else:  # split over every device, or (replicated) whole on each
                per_dev = [x + (share if strategy == "data" else share / args.devices) for x in per_dev]
        log(f"sharded over {args.devices} {jax.devices()[0].platform} devices (mesh axis 'data'): tables "
            + ", ".join(f"{c} {st}-wise" for st, c in counts.items())
            + f" (tbe_jax.shard's planner; table bytes per device {min(per_dev) / 2**20:.2f}.."
            f"{max(per_dev) / 2**20:.2f} MiB); each batch = {args.devices} local batches of "
            f"{args.batch_size // args.devices} (ids padded to "
            + (f"{local_cap:,}" if not args.tt_tables else f"{local_cap[0]:,} TBE + {local_cap[1]:,} TT")
            + " per device); dense MLPs data parallel"
            + ("; TT tables data parallel (cores replicated, tt_jax.shard)" if args.tt_tables else ""))

    # State: fresh, or restored from the newest checkpoint.
    t_init = None
    if args.resume and latest_checkpoint(args.ckpt_dir) is not None:
        saved = json.loads((pathlib.Path(args.ckpt_dir) / "run.json").read_text())
        if saved != settings:
            raise SystemExit(f"--resume: checkpoint settings {saved} differ from this run's {settings}")
        ck = latest_checkpoint(args.ckpt_dir)
        t_restore = time.perf_counter()
        state = jax.block_until_ready(placed(model, restore_checkpoint(ck, restore_init)))
        t_restore = time.perf_counter() - t_restore
        log(f"restored step {state.step} from {ck} in {t_restore:.1f} s")
    else:
        if args.resume:
            log(f"--resume: no checkpoint in {args.ckpt_dir}; starting from scratch")
        t_init = time.perf_counter()
        state = jax.block_until_ready(TrainState(0, *init_fn(jax.random.key(args.seed))))
        t_init = time.perf_counter() - t_init
        log(f"built the model, data and jitted functions in {t_build:.2f} s; tables and optimizer state initialised "
            f"on the device in {t_init:.2f} s (compile included); peak device memory "
            + ("n/a" if peak_memory() is None else f"{peak_memory() / 2**30:.2f} GiB"))
    peak_init = peak_memory()
    n_dense = sum(x.size for x in jax.tree_util.tree_leaves(state.dense_params))
    tbe_params = state.emb_params if model.tt is None else state.emb_params["tbe"]
    n_emb = sum(x.size for x in jax.tree_util.tree_leaves(tbe_params))
    if mesh is not None or args.host_tables:  # sharded storage pads, a cache repeats rows: the tables' own rows
        n_emb = sum(t.num_embeddings * t.embedding_dim for t in emb.tables)
    mem = model.table_bytes()
    arch = ("DCN v2: bottom MLP, x0 = [bottom, 26 pooled] of width "
            f"{model.interaction_dim}, {config.dcn_layers} low-rank cross layers of rank {config.dcn_rank}, top MLP"
            if config.interaction == "dcn" else "DLRM: bottom MLP, dot interaction, top MLP")
    log(f"model: {arch}; matmul precision {config.matmul_precision}; tables {config.weights_dtype}")
    log(f"parameters: {n_dense:,} dense ({args.dense_opt}, lr {args.lr}), {n_emb:,} in "
        f"{'TBE ' if model.tt else ''}tables "
        f"({mem['tbe'] / 2**20:.1f} MiB, row-wise Adagrad on the looked-up rows, lr {args.emb_lr})")
    if model.tt is not None:
        n_tt = sum(x.size for x in jax.tree_util.tree_leaves(state.emb_params["tt"]))
        tt_dense = mem["dense"] - mem["tbe"]
        log(f"TT tables: the {len(model.tt_features)} largest (" + ", ".join(
            f"C{f + 1}: {data_cfg.table_rows[f]:,} rows" for f in model.tt_features) + f"), ranks {config.tt_ranks}, "
            f"p x q shapes {[(s.p_shapes, s.q_shapes) for s in model.tt.specs]}: {n_tt:,} core parameters, "
            f"{mem['tt'] / 2**20:.2f} MiB instead of {tt_dense / 2**20:.2f} MiB dense "
            f"({tt_dense / max(mem['tt'], 1):.0f}x smaller); {args.tt_opt} on the touched core slices, "
            f"lr {args.tt_lr} | TT: {'Pallas kernel' if model.tt_unsharded.resolved_impl == 'pallas' else 'XLA path'}")
    log(f"embedding parameters: {_mem_summary(mem)}; their optimizer state: "
        f"{_state_bytes(state.emb_state) / 2**20:.2f} MiB")

    eval_set = []
    for i in range(args.eval_batches):
        if device_data is not None:
            arrays = device_data.batch(i, "eval")
            labels, logit = np.asarray(arrays.pop("labels")), np.asarray(arrays.pop("logit"))
            eval_set.append((arrays, labels, logit))
            continue
        b = gen.batch(i, "eval")
        arrays = b.arrays() if prepare is None else prepare(b.arrays())
        eval_set.append((jax.device_put({k: v for k, v in arrays.items() if k != "labels"}, batch_sharding),
                         b.labels, b.logit))
    oracle = auc(np.concatenate([z for _, _, z in eval_set]), np.concatenate([y for _, y, _ in eval_set]))
    oracle_loss = log_loss(np.concatenate([z for _, _, z in eval_set]), np.concatenate([y for _, y, _ in eval_set]))
    before = evaluate(eval_logits, state, eval_set)
    n_eval = args.eval_batches * args.batch_size
    log(f"eval ({n_eval:,} held-out examples) at step {state.step}: AUC {before['auc']:.4f}, "
        f"loss {before['loss']:.4f} | hidden model (ceiling): AUC {oracle:.4f}, loss {oracle_loss:.4f}")

    # Training.
    start = state.step
    n = max(args.steps - start, 0)
    workers = args.workers or max(1, min(8, (os.cpu_count() or 2) - 1))
    bar = None
    try:  # the progress bar is optional (the "demo" extra installs tqdm)
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if not args.no_progress and n and tqdm is not None:
        bar = tqdm(total=args.steps, initial=start, desc="train", unit="step", dynamic_ncols=True, mininterval=0.5,
                   file=sys.stderr)
    dense_params, dense_opt_state, emb_params, emb_state = (state.dense_params, state.dense_opt_state,
                                                            state.emb_params, state.emb_state)
    losses = []
    curve = []  # (step, AUC, loss) of the --eval-every evaluations
    t_first = t_warm = None
    t_ckpt = 0.0  # time spent saving or evaluating inside the loop (left out of the step time)
    t0 = time.perf_counter()
    ckpt = None
    if device_data is not None:
        batches = device_data.train_batches(start, args.steps)
    else:
        batches = prefetch(gen, start, args.steps, workers, prepare, batch_sharding)
    for i, batch in enumerate(batches, start):
        dense_params, emb_params, emb_state, dense_opt_state, loss = train_step(
            dense_params, emb_params, emb_state, dense_opt_state, emb_opt, batch)
        losses.append(loss)
        done = i + 1 - start
        if done == 1:
            jax.block_until_ready(loss)
            t_warm = time.perf_counter()
            t_first = t_warm - t0
        if done > 20 and done % 10 == 0:  # keep the host at most ~20 steps ahead (never draining the queue)
            jax.block_until_ready(losses[-11])
        if bar is not None:
            bar.update(1)
            if done % 10 == 0 or i + 1 == args.steps:
                # the 10 steps before the last 10 (already done: reading them does not drain the queue)
                window = losses[-20:-10] if done >= 20 and i + 1 < args.steps else losses[-10:]
                recent = float(np.mean(jax.device_get(window)))
                rate = (done - 1) * args.batch_size / max(time.perf_counter() - t_warm, 1e-9) if done > 1 else 0.0
                bar.set_postfix(loss=f"{recent:.4f}", ex_per_s=f"{rate:,.0f}")
        if args.eval_every and (i + 1) % args.eval_every == 0 and i + 1 < args.steps:
            tc = time.perf_counter()
            mid = evaluate(eval_logits, TrainState(i + 1, dense_params, dense_opt_state, emb_params, emb_state),
                           eval_set)
            curve.append((i + 1, mid["auc"], mid["loss"]))
            log(f"eval at step {i + 1}: AUC {mid['auc']:.4f}, loss {mid['loss']:.4f} (ceiling {oracle:.4f})")
            t_ckpt += time.perf_counter() - tc
        if args.ckpt_dir and args.ckpt_every and (i + 1) % args.ckpt_every == 0 and i + 1 < args.steps:
            tc = time.perf_counter()
            save_checkpoint(args.ckpt_dir, portable(
                model, TrainState(i + 1, dense_params, dense_opt_state, emb_params, emb_state)), settings)
            t_ckpt += time.perf_counter() - tc
    jax.block_until_ready((dense_params, emb_params, emb_state))
    t_end = time.perf_counter()
    if bar is not None:
        bar.close()
    state = TrainState(start + n, dense_params, dense_opt_state, emb_params, emb_state)

    losses = np.asarray(jax.device_get(losses), np.float64)
    timed = n - 1
    step_ms = (t_end - t_warm - t_ckpt) * 1e3 / timed if timed > 0 else float("nan")
    k = max(1, min(50, n // 2))  # loss averaged over the first and the last k steps
    steps_per_s = 1e3 / step_ms if timed > 0 else float("nan")
    if n:
        log(f"trained steps {start}..{args.steps}: train loss {losses[:k].mean():.4f} (first {k}) -> "
            f"{losses[-k:].mean():.4f} (last {k}); first step {t_first:.2f} s (compiles); then "
            f"{step_ms:.2f} ms/step wall, {steps_per_s:.1f} steps/s, {steps_per_s * args.batch_size:,.0f} examples/s "
            + ("(wall time includes drawing the batches on the device)" if device_data else
               f"(wall time includes host data generation on {workers} thread{'s' if workers > 1 else ''})"))

    after = evaluate(eval_logits, state, eval_set)
    log(f"eval at step {state.step}: AUC {before['auc']:.4f} -> {after['auc']:.4f} "
        f"({after['auc'] - before['auc']:+.4f}), loss {before['loss']:.4f} -> {after['loss']:.4f} "
        f"(ceiling AUC {oracle:.4f})")

    quantized = evaluate_quantized(model, state, eval_set, args.eval_quantized, log)

    if args.ckpt_dir:
        t_save = time.perf_counter()
        ckpt = save_checkpoint(args.ckpt_dir, portable(model, state), settings)
        t_save = time.perf_counter() - t_save
        size = sum(f.stat().st_size for f in pathlib.Path(ckpt).rglob("*") if f.is_file())
        log(f"checkpoint: {ckpt} ({size / 2**30:.2f} GiB written in {t_save:.1f} s, orbax StandardCheckpointer; "
            f"resume with --ckpt-dir {args.ckpt_dir} --resume)")

    results = {
        "auc_before": before["auc"], "auc_after": after["auc"], "eval_loss_before": before["loss"],
        "eval_loss_after": after["loss"], "oracle_auc": oracle, "auc_curve": curve, "quantized": quantized,
        "final_loss": float(losses[-k:].mean()) if n else float("nan"),
        "steps": n, "start_step": start, "steps_per_s": steps_per_s,
        "examples_per_s": steps_per_s * args.batch_size, "step_ms": step_ms, "wall_step_ms": step_ms,
        "data": args.data,
        "ckpt": None if ckpt is None else str(ckpt),
        "table_bytes": mem["total"], "dense_table_bytes": mem["dense"],
        "model": args.model, "dense_opt": args.dense_opt, "emb_dtype": args.emb_dtype,
        "matmul_precision": config.matmul_precision,
        "build_s": t_build, "init_s": t_init, "peak_bytes_after_init": peak_init,
    }

    timing_batches = []
    if args.time_steps or args.emb_share or backend == "gpu":  # batches past the training ones, on the device
        k_time = max(args.time_steps, 1)
        if device_data is not None:
            timing_batches = list(device_data.train_batches(args.steps, args.steps + k_time))
        else:
            timing_batches = list(prefetch(gen, args.steps, args.steps + k_time, workers, prepare, batch_sharding))
    # Large tables (mlperf): the timing runs on the state itself (a copy would not fit), continuing its training.
    in_place = mem["total"] >= IN_PLACE_BYTES
    if args.time_steps:
        if in_place:
            dev_ms, state = measure_device_step(built, state, timing_batches, in_place=True)
        else:
            dev_ms = measure_device_step(built, state, timing_batches)
        results["device_step_ms"] = dev_ms
        results["device_share"] = dev_ms / step_ms if timed > 0 else float("nan")
        log(f"device step {dev_ms:.2f} ms ({args.time_steps} steps enqueued back to back on batches already on the "
            f"device, blocked once) vs {step_ms:.2f} ms/step wall: device share {results['device_share']:.2f} "
            f"({'data drawn on the device' if device_data else 'host data'}; "
            f"{results['examples_per_s']:,.0f} examples/s)")

    if args.emb_share or backend == "gpu":
        batch = timing_batches[0]
        reps = 20 if backend == "gpu" else 5
        m = measure_emb_share(model, built, state, batch, reps, in_place=in_place)
        state = m.get("state", state)
        results["emb_share"] = m["share"]
        results["jit_step_ms"] = m["step_ms"]
        log(f"step time on one batch: full jitted step {m['step_ms']:.3f} ms; embeddings alone "
            f"({'TBE and TT' if model.tt else 'TBE'} lookups + apply_gradients, same batch, a fixed output "
            f"gradient) {m['emb_ms']:.3f} ms "
            f"-> embeddings ~{100 * m['share']:.0f}% of the step")
        log("  method: both are jitted, warmed up, run on copies of the trained state threaded through "
            f"{reps} back-to-back calls, blocked once; median of 3 repetitions. The share is an estimate: "
            "inside the full step XLA may overlap or fuse the two parts.")
        if not emb.uses_kernel():
            log("  (XLA path: its sparse update is the dense reference, work proportional to the tables, "
                "so this share is not what the GPU kernels give)")

    results["peak_bytes"] = peak_memory()
    log(f"SUMMARY size={args.size} model={args.model} steps={start}->{state.step} | AUC {before['auc']:.4f} -> {after['auc']:.4f} "
        f"(ceiling {oracle:.4f})" + "".join(f", {wt} {q['auc']:.4f}" for wt, q in quantized.items())
        + f" | eval loss {before['loss']:.4f} -> {after['loss']:.4f} | train loss "
        f"{results['final_loss']:.4f} | {results['examples_per_s']:,.0f} examples/s | {step_ms:.2f} ms/step wall"
        + (f" (device step {results['device_step_ms']:.2f} ms, share {results['device_share']:.2f})"
           if "device_step_ms" in results else "")
        + f" | data on the {args.data}"
        + (f" | embeddings {100 * results['emb_share']:.0f}% of step" if "emb_share" in results else "")
        + f" | tables: {mem['total'] / 2**20:.2f} MiB"
        + (f" (TT saves {100 * (1 - mem['total'] / mem['dense']):.1f}%)" if model.tt is not None else "")
        + (f" | build {t_build:.1f} s, init {t_init:.1f} s" if t_init is not None else "")
        + ("" if results["peak_bytes"] is None else f" | peak device memory {results['peak_bytes'] / 2**30:.2f} GiB"))
    if in_place and (args.time_steps or "emb_share" in results):
        log("(tables of 16 GiB or more: the timing steps ran on the trained state itself, so the returned state "
            "has trained on them too)")
    results["state"] = state
    return results


if __name__ == "__main__":
    main()
