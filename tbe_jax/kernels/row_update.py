"""The optimizer's row update on a tile of rows, and the refs of a buffer's state (weights and optimizer
slots): shared by the sorted-run backward (`kernels.backward`) and the histogram backward."""

from __future__ import annotations

import jax.numpy as jnp

from tbe_jax.pallas_compat import plgpu
from tbe_jax.optim import NUM_HYPER, apply_rule
from tbe_jax.rounding import stochastic_round


def row_update(rule, hyper_ref, w_in_ref, w_out_ref, s_in, s_out, row, row_ok, acc, cols, col_ok, dim,
               stride=None):
    """Apply `rule` to rows `row` ([R] int32, where `row_ok`) with gradients `acc` ([R, Dp] f32).

    `s_in`/`s_out`: the refs of the optimizer state's slots (`rule.slot_rowwise` says
    which hold one value per row). `hyper_ref` holds the step's
    `Optimizer.hyperparameters` (an operand: changing them never recompiles). The
    formulas are `tbe_jax.optim.apply_rule`'s, on the tile: its padding columns (past
    `dim`) load as zeros, so the per-row sums see only the row. `rule=None` is the
    true-gradient mode: `acc` is stored as the row's gradient. With
    `rule.skip_nonfinite`, a row whose gradient holds a NaN or an infinity is not
    written (its weights and state stay as they were).

    `stride` (a Python int, > `dim`): the buffer's padded row length (`StorageLayout.strides`). Rows
    then load and store up to it, so a 16-byte-multiple row moves in 16-byte vectors; the padding
    columns are read as zeros (as `reference.apply_gradients` reads them) and written with what the
    rule makes of zeros.
    """
    rows = row[:, None]
    io_ok = col_ok if stride is None or stride <= dim else cols < stride
    if rule is None:  # `acc` is zero past `dim`
        mask = row_ok[:, None] & io_ok[None, :]
        plgpu.store(w_out_ref.at[rows, cols[None, :]], acc.astype(w_out_ref.dtype), mask=mask)
        return
    if rule.skip_nonfinite:
        bad = jnp.sum(jnp.where(jnp.abs(acc) < jnp.inf, 0, 1), axis=1)  # NaN fails the compare too
        row_ok = row_ok & (bad == 0)
    mask = row_ok[:, None] & io_ok[None, :]

    def values(x):  # the padding columns as zeros
        x = x.astype(jnp.float32)
        return x if io_ok is col_ok else jnp.where(col_ok[None, :], x, 0.0)

    hyper = tuple(plgpu.load(hyper_ref.at[jnp.int32(i)]) for i in range(NUM_HYPER))
    w0 = values(plgpu.load(w_in_ref.at[rows, cols[None, :]], mask=mask, other=0))
    slots = []
    for ref, rowwise in zip(s_in, rule.slot_rowwise):
        if rowwise:
            slots.append(plgpu.load(ref.at[row], mask=row_ok, other=0).astype(jnp.float32))
        else:
            slots.append(values(plgpu.load(ref.at[rows, cols[None, :]], mask=mask, other=0)))
    w, new, salts = apply_rule(rule, w0, tuple(slots), acc, hyper, dim=dim)
    for ref, x, rowwise in zip(s_out, new, rule.slot_rowwise):
        if rowwise:
            plgpu.store(ref.at[row], x.astype(ref.dtype), mask=row_ok)
        else:
            plgpu.store(ref.at[rows, cols[None, :]], x.astype(ref.dtype), mask=mask)
    if rule.stochastic_rounding and w_out_ref.dtype in (jnp.float16, jnp.bfloat16):
        w = stochastic_round(w, w_out_ref.dtype, jnp.broadcast_to(rows, acc.shape),
                             jnp.broadcast_to(cols[None, :], acc.shape), *salts)
    plgpu.store(w_out_ref.at[rows, cols[None, :]], w.astype(w_out_ref.dtype), mask=mask)


def state_width(opt) -> int:
    """Arrays per storage buffer that an update kernel aliases: the weights and the state's slots."""
    return 1 + (opt.num_slots if opt is not None else 0)


def state_refs(refs, opt):
    """(w_in, slots_in, w_out, slots_out) from one buffer's `2 * state_width(opt)` refs (its inputs, then
    its aliased outputs); the slot tuples are empty for SGD and the true-gradient mode."""
    n = state_width(opt)
    ins, outs = refs[:n], refs[n:]
    return ins[0], tuple(ins[1:]), outs[0], tuple(outs[1:])


def segment_states(refs, opt, segs):
    """Per segment, per buffer, its (w_in, slots_in, w_out, slots_out) refs; `refs` holds every
    buffer's inputs in segment order, then the aliased outputs in the same order."""
    n_state = state_width(opt)
    total = n_state * sum(len(seg.buffers) for seg in segs)
    ins, outs = refs[:total], refs[total:]
    out, i = [], 0
    for seg in segs:
        per = []
        for _ in seg.buffers:
            per.append(state_refs(ins[i:i + n_state] + outs[i:i + n_state], opt))
            i += n_state
        out.append(per)
    return out
