"""Issue 40 probe 5: which of the host tier's calls compile on the GPU (each step's outcome, or its error).

    python -m benchmarks.probe_host_steps
"""
import traceback

import jax
import jax.numpy as jnp
import tbe_jax


def attempt(name, f):
    try:
        r = f()
        jax.block_until_ready(r)
        print(f"OK   {name}", flush=True)
        return r
    except Exception as e:  # noqa: BLE001
        msg = str(e).replace("\n", " ")[:400]
        tb = "".join(traceback.format_tb(e.__traceback__)[-6:]).replace("\n", " | ")[-900:]
        print(f"FAIL {name}: {type(e).__name__}: {msg}\n     at {tb}", flush=True)
        return None


idx = jnp.asarray([1, 5, 39, 0, 29, 7], jnp.int32)
off = jnp.asarray([0, 2, 3, 5, 6], jnp.int32)
g = jnp.ones((2, 16), jnp.float32)
opt = tbe_jax.RowwiseAdagrad(learning_rate=0.1)
for label, specs in (("host", [tbe_jax.TableSpec(40, 8, location="host"), tbe_jax.TableSpec(30, 8)]),
                     ("host_cached", [tbe_jax.TableSpec(40, 8, location="host_cached"), tbe_jax.TableSpec(30, 8)])):
    emb = tbe_jax.TableBatchedEmbedding(specs, cache_load_factor=0.5, cache_ways=4)
    p = attempt(f"{label}: init", lambda: emb.init(jax.random.key(0)))
    print("   kinds", {k: getattr(v, "sharding", None) and v.sharding.memory_kind for k, v in p.items()
                      if hasattr(v, "sharding")}, flush=True)
    s = attempt(f"{label}: init_opt_state", lambda: emb.init_opt_state(p, opt))
    attempt(f"{label}: forward eager", lambda: emb(p, idx, off))
    attempt(f"{label}: forward jit", lambda: jax.jit(lambda p: emb(p, idx, off))(p))
    if label == "host_cached":
        r = attempt(f"{label}: prefetch eager (state)", lambda: emb.prefetch(p, idx, off, opt_state=s))
        if r is not None:
            p, s = r
        r = attempt(f"{label}: prefetch jit donated", lambda: jax.jit(
            lambda p, s: emb.prefetch(p, idx, off, opt_state=s), donate_argnums=(0, 1))(p, s))
        if r is not None:
            p, s = r
    r = attempt(f"{label}: apply jit donated", lambda: jax.jit(
        lambda p, s: emb.apply_gradients(p, s, opt, idx, off, g), donate_argnums=(0, 1))(p, s))
    if r is not None:
        p, s = r
    r = attempt(f"{label}: train_step jit donated", lambda: jax.jit(lambda p, s: tbe_jax.train_step(
        lambda _, o: jnp.sum(o * g), None, tbe_jax.SparseLookup(emb, opt, p, s, idx, off))[3:5],
        donate_argnums=(0, 1))(p, s))
    if r is not None:
        p, s = r
    r = attempt(f"{label}: apply eager (not donated)", lambda: emb.apply_gradients(p, s, opt, idx, off, g))
    attempt(f"{label}: get_tables", lambda: [jnp.asarray(t) for t in emb.get_tables(p if r is None else r[0])])
