"""Orbax checkpoints of the DLRM demo's training state (`TrainState`): save, find the newest, restore.

A checkpoint is `ckpt_dir/<step>/` (orbax `StandardCheckpointer`: the dense parameters and Adam state, the
embedding tables and their optimizer state, as arrays) plus `ckpt_dir/run.json` (the run's settings). Restoring
reads into the structure of a fresh state, so a sharded model restores onto the mesh its `init_fn` places it on.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import tbe_jax


class TrainState(NamedTuple):
    step: int
    dense_params: dict
    dense_opt_state: optax.OptState
    emb_params: dict  # the TBE's params, or {"tbe": ..., "tt": ...} with TT tables
    emb_state: Any  # tbe_jax.RowwiseAdagradState, or {"tbe": ..., "tt": <tt_jax state>} with TT tables


def _ocp():
    import orbax.checkpoint as ocp  # imported lazily: only checkpointing needs it

    return ocp


def _as_tree(state: TrainState) -> dict:
    return {"step": np.asarray(state.step, np.int32), "dense_params": state.dense_params,
            "dense_opt_state": state.dense_opt_state, "emb_params": state.emb_params,
            "emb_state": state.emb_state}


def save_checkpoint(ckpt_dir, state: TrainState, settings: dict) -> pathlib.Path:
    """Write `ckpt_dir/<step>/` (orbax StandardCheckpointer) and `ckpt_dir/run.json`; blocks until written."""
    ckpt_dir = pathlib.Path(ckpt_dir).absolute()
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    (ckpt_dir / "run.json").write_text(json.dumps(settings, indent=1, sort_keys=True))
    path = ckpt_dir / str(int(state.step))
    ckptr = _ocp().StandardCheckpointer()
    ckptr.save(path, _as_tree(state), force=True)
    ckptr.wait_until_finished()
    ckptr.close()
    return path


def latest_checkpoint(ckpt_dir) -> pathlib.Path | None:
    """The newest `ckpt_dir/<step>` (orbax writes to a temporary name and renames when complete)."""
    ckpt_dir = pathlib.Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return None
    steps = [int(p.name) for p in ckpt_dir.iterdir() if p.is_dir() and p.name.isdigit()]
    return ckpt_dir / str(max(steps)) if steps else None


_OPT_STATES = (tbe_jax.RowwiseAdagradState, tbe_jax.AdagradState, tbe_jax.SGDState)


def _saved_tree(ckptr, path):
    """The checkpoint's metadata tree (nested dicts; a NamedTuple is saved as a dict of its fields)."""
    md = ckptr.metadata(path)
    md = getattr(md, "item_metadata", md)
    return getattr(md, "tree", md)


def _legacy_keys(emb_state, saved) -> list:
    """The optimizer states of `emb_state` (keys: None for the state itself, "tbe"/"tt" with TT tables)
    that the checkpoint holds without a `count` (written before the states had one)."""
    states = {None: emb_state} if isinstance(emb_state, _OPT_STATES) else dict(emb_state)
    out = []
    for k, st in states.items():
        md = saved if k is None else saved.get(k) if isinstance(saved, dict) else None
        if isinstance(st, _OPT_STATES) and isinstance(md, dict) and "count" not in md:
            out.append(k)
    return out


def restore_checkpoint(path, init_fn) -> TrainState:
    """Read a checkpoint into the structure (and dtypes) of `init_fn`'s fresh state.

    An optimizer state saved without a step count (checkpoints from before `count`) gets the
    checkpoint's step as its count."""
    dense_params, dense_opt_state, emb_params, emb_state = jax.eval_shape(init_fn, jax.random.key(0))
    path = pathlib.Path(path).absolute()
    ckptr = _ocp().StandardCheckpointer()
    try:
        saved = _saved_tree(ckptr, path)
        legacy = _legacy_keys(emb_state, saved.get("emb_state") if isinstance(saved, dict) else None)
    except Exception:  # no readable metadata: restore as saved now
        legacy = []

    def strip(st):  # the state's fields but count, as the old checkpoints hold them
        return {f: v for f, v in st._asdict().items() if f != "count"}

    target_state = emb_state
    if legacy:
        target_state = strip(emb_state) if legacy == [None] else {
            k: strip(v) if k in legacy else v for k, v in emb_state.items()}
    target = {"step": jax.ShapeDtypeStruct((), jnp.int32), "dense_params": dense_params,
              "dense_opt_state": dense_opt_state, "emb_params": emb_params, "emb_state": target_state}
    tree = ckptr.restore(path, target)
    ckptr.close()
    state = tree["emb_state"]
    if legacy:
        count = jnp.asarray(tree["step"], jnp.int32)

        def with_count(fields, like):
            return type(like)(**fields, count=count)

        state = with_count(state, emb_state) if legacy == [None] else {
            k: with_count(v, emb_state[k]) if k in legacy else v for k, v in state.items()}
    return TrainState(int(tree["step"]), tree["dense_params"], tree["dense_opt_state"], tree["emb_params"], state)


# -- a sharded model's state in the one-device format (what a checkpoint holds) and back --


def portable(model, state: TrainState) -> TrainState:
    """The state to save: with a mesh, the tables and their optimizer state in the one-device format."""
    if model.mesh is None:
        return state
    emb_params, emb_state = per_embedding(model, "to_unsharded", state.emb_params, state.emb_state)
    return state._replace(emb_params=emb_params, emb_state=emb_state)


def per_embedding(model, method: str, emb_params, emb_state):
    """`model.emb.<method>(params, state)`, or with TT tables that of each part ({"tbe": ..., "tt": ...})."""
    if model.tt is None:
        return getattr(model.emb, method)(emb_params, emb_state)
    parts = {k: getattr(e, method)(emb_params[k], emb_state[k]) for k, e in (("tbe", model.emb), ("tt", model.tt))}
    return {k: p for k, (p, _) in parts.items()}, {k: s for k, (_, s) in parts.items()}


def placed(model, state: TrainState) -> TrainState:
    """A restored (one-device format) state on the model's mesh: tables sharded, dense state replicated."""
    if model.mesh is None:
        return state
    emb_params, emb_state = per_embedding(model, "from_unsharded", state.emb_params, state.emb_state)
    dense_params, dense_opt_state = jax.device_put((state.dense_params, state.dense_opt_state), model.sharding())
    return TrainState(state.step, dense_params, dense_opt_state, emb_params, emb_state)
