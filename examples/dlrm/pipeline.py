"""The DLRM demo's input pipeline: host batches prefetched on threads (`prefetch`, `--data host`), batches drawn on
the device in the model's input format (`DeviceData`, `device_batch_fn`, `--data device`), and the fixed id
capacities of split and local batches (`split_padded_len`, `local_padded_len`). See `examples.dlrm.train`."""

from __future__ import annotations

import concurrent.futures
import functools

import jax
import numpy as np

from examples.dlrm import data as data_lib
from examples.dlrm.model import DLRM


# -- input pipeline --------------------------------------------------------------------


def prefetch(gen: data_lib.ClickLogGenerator, start: int, stop: int, workers: int, prepare=None, sharding=None):
    """Batches start..stop-1 in order, generated ahead by a thread pool (each through `prepare`, a
    host-side function of the arrays, when given) and put on the device (split by rows over a mesh:
    `sharding`, when given)."""

    def make(i):
        arrays = gen.batch(i).arrays()
        return jax.device_put(arrays if prepare is None else prepare(arrays), sharding)

    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        ahead = 2 * workers
        futures = {i: pool.submit(make, i) for i in range(start, min(stop, start + ahead))}
        for i in range(start, stop):
            if i + ahead < stop:
                futures[i + ahead] = pool.submit(make, i + ahead)
            yield futures.pop(i).result()


@functools.lru_cache(maxsize=8)
def device_batch_fn(model: DLRM, data_cfg: data_lib.DataConfig, batch_size: int, caps: tuple[int, ...]):
    """The device data mode's jitted `(params, stream_key, i) -> batch`: batch `i` of a stream drawn on
    the device (`data_lib.draw` with the key `fold_in(stream_key, i)`, `params` a `DeviceClickLog`'s)
    in the model's input format, with "labels" and the hidden model's "logit".

    `caps`: the id capacity of the whole batch; with TT tables `(whole, TBE features, TT features)`
    (the batch is drawn whole, then split on the device by `data_lib.select_features`: the same
    data as without TT tables); with a mesh `(one local batch,)`: each device draws its own local
    batch of `batch_size / N` examples (`shard_map`, key `fold_in(fold_in(stream_key, i), k)` on
    device k), so the batch is `indices [N, cap]`, `offsets [N, F*(B/N)+1]`, "dense"/"labels"
    `[B, ...]` split by rows, as `DLRM.shard_batch` gives it (other examples than the one-device run's);
    with a mesh and TT tables `(one local batch, its TBE features, its TT features)`.
    """
    if model.mesh is not None:
        n, ax = model.num_devices, model.axis_name
        b = batch_size // n

        def local(params, skey, i):
            key = jax.random.fold_in(jax.random.fold_in(skey, i), jax.lax.axis_index(ax))
            arrays = data_lib.draw(data_cfg, params, key, b, caps[0])
            if model.tt is not None:  # the local batch split by features, as without a mesh
                idx, off = arrays["indices"], arrays["offsets"]
                arrays["indices"], arrays["offsets"] = data_lib.select_features(idx, off, b, model.tbe_features,
                                                                                caps[1])
                arrays["tt_indices"], arrays["tt_offsets"] = data_lib.select_features(idx, off, b, model.tt_features,
                                                                                      caps[2])
                arrays["tt_indices"], arrays["tt_offsets"] = arrays["tt_indices"][None], arrays["tt_offsets"][None]
            arrays["indices"], arrays["offsets"] = arrays["indices"][None], arrays["offsets"][None]
            return arrays

        spec = jax.sharding.PartitionSpec
        return jax.jit(jax.shard_map(local, mesh=model.mesh, in_specs=(spec(), spec(), spec()), out_specs=spec(ax)))

    def make(params, skey, i):
        arrays = data_lib.draw(data_cfg, params, jax.random.fold_in(skey, i), batch_size, caps[0])
        if model.tt is None:
            return arrays
        out = {k: arrays[k] for k in ("dense", "labels", "logit")}
        out["indices"], out["offsets"] = data_lib.select_features(
            arrays["indices"], arrays["offsets"], batch_size, model.tbe_features, caps[1])
        out["tt_indices"], out["tt_offsets"] = data_lib.select_features(
            arrays["indices"], arrays["offsets"], batch_size, model.tt_features, caps[2])
        return out

    return jax.jit(make)


class DeviceData:
    """Batches drawn on the device (`--data device`) from `gen`'s hidden model, in `model`'s input format.

    `batch(i, stream)` is one asynchronous jitted call (`device_batch_fn`): the training loop never
    waits on the host. Batch i of a stream depends only on (seed, stream, i)."""

    def __init__(self, gen: data_lib.ClickLogGenerator, model: DLRM):
        if model.mesh is not None:
            caps = (local_padded_len(gen, model.num_devices),)
            if model.tt is not None:
                caps += (local_padded_len(gen, model.num_devices, model.tbe_features),
                         local_padded_len(gen, model.num_devices, model.tt_features))
        elif model.tt is not None:
            caps = (gen.padded_len, split_padded_len(gen, model.tbe_features),
                    split_padded_len(gen, model.tt_features))
        else:
            caps = (gen.padded_len,)
        self.caps = caps
        self.source = data_lib.DeviceClickLog(gen, None if model.mesh is None else model.sharding())
        self.fn = device_batch_fn(model, gen.config, gen.batch_size, caps)
        self.keys = {s: self.source.stream_key(s) for s in ("train", "eval")}

    def batch(self, i: int, stream: str = "train") -> dict:
        """The model's inputs plus "labels" and "logit" (device arrays)."""
        return self.fn(self.source.params, self.keys[stream], np.int32(i))

    def train_batches(self, start: int, stop: int):
        """Batches start..stop-1 as the training step takes them (without "logit")."""
        for i in range(start, stop):
            arrays = self.batch(i)
            arrays.pop("logit")
            yield arrays


# -- padded lengths ---------------------------------------------------------------------


def local_padded_len(gen: data_lib.ClickLogGenerator, n: int, features=None) -> int:
    """A fixed padded id count for one of `n` local batches of `gen.batch_size / n` examples (the
    generator's rule: the mean count plus 8 standard deviations plus 64, rounded up to 256); of
    `features` alone when given (the TBE's or the TT tables' part of a local batch)."""
    f = slice(None) if features is None else list(features)
    m, one_hot = gen.bag_mean[f], gen.one_hot[f]
    var = np.where(one_hot, m * (1 - m), m)
    b = gen.batch_size // n
    return int(-(-(b * m.sum() + 8 * np.sqrt(b * var.sum()) + 64) // 256) * 256)


def split_padded_len(gen: data_lib.ClickLogGenerator, features) -> int:
    """A fixed padded id count for `features` alone (as the generator's for all features): the mean
    count plus 8 standard deviations plus 64, rounded up to 256."""
    m = gen.bag_mean[list(features)]
    var = np.where(gen.one_hot[list(features)], m * (1 - m), m)
    b = gen.batch_size
    return int(-(-(b * m.sum() + 8 * np.sqrt(b * var.sum()) + 64) // 256) * 256)
