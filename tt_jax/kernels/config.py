"""Knobs of the TT kernels: `TTForwardConfig` (forward), `TTBackwardConfig` (backward) and `TTKernelConfig`,
the user-facing flat config of `TTEmbeddingBag(config=...)` that holds both.

Defaults are the H200 winners; the sweeps that chose them are in benchmarks/NOTES.md ("Tensor-train tables" and
"Design notes moved from the kernel docstrings").
"""

from __future__ import annotations

import dataclasses

import jax

from tbe_jax.pallas_compat import plgpu, sm_count
from tt_jax import prefix

SCHEDULES = ("queue", "static", "grid")
PRECISIONS = {  # `precision` -> the fp32 dot algorithm on the GPU
    "ieee": jax.lax.DotAlgorithmPreset.F32_F32_F32,
    "tf32x3": jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
    "tf32": jax.lax.DotAlgorithmPreset.TF32_TF32_F32,
    "bf16x3": jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3,
    "bf16x6": jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6,
}
GROUP_KERNELS = ("tiles3", "general")
_KEY_MAX = prefix.SENTINEL  # int32 sort keys stay below this: the key limits' default and maximum
BACKWARD_IMPLS = ("pallas", "xla")


def _check_precision(cls: str, precision):
    if precision not in PRECISIONS:
        raise ValueError(f"{cls}.precision must be one of {tuple(PRECISIONS)}, got {precision!r}")


def _check_ints(cls: str, obj, names, *, pow2: tuple[str, ...] = ()):
    for name in names:
        v = getattr(obj, name)
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{cls}.{name} must be a positive int, got {v!r}")
    for name in pow2:
        v = getattr(obj, name)
        if v & (v - 1):
            raise ValueError(f"{cls}.{name} must be a power of 2, got {v}")


@dataclasses.dataclass(frozen=True)
class TTForwardConfig:
    """Knobs of the fused TT forward (`tt_jax.kernels.forward`) and of the plan it runs on.

    Attributes:
      schedule: how the rows kernel hands out work items. "static" (default): persistent programs, item t on
        program t mod P; "queue": persistent programs taking the next item from an atomic counter (FlowTT's work
        stealing); "grid": one program per item slot (the baseline).
      chunk: most distinct rows per work item (default 64; 0: whole prefix groups). Items are the unit of load
        balancing and each recomputes its prefix product: smaller balances better, larger recomputes less.
      tile_rows: distinct rows per row-stage dot (default 8, a power of 2).
      prefix_reuse: True (default) shares each prefix product over its group; False is the "unique only"
        ablation (every distinct row its own item).
      num_programs: persistent programs of "static" and "queue" (None, the default: the device's SM count times
        `programs_per_sm`, capped by the item bound).
      programs_per_sm: see `num_programs` (default 32).
      num_warps, num_stages: Triton launch knobs of the rows and packed-prefix kernels (defaults 2 and 1).
      precision: fp32 dot algorithm on the GPU (default "tf32x3": three TF32 passes, about fp32 accuracy);
        "ieee" (fp32 FMA), "bf16x3" (~1e-5 relative error), "bf16x6", or "tf32" (one pass, ~1e-3). Interpret
        mode always uses HIGHEST.
      pool_bags, pool_unroll, pool_warps: the pooling kernel's bags per program (default 8), lookups whose
        loads are issued together (4) and warps (1).
      prefix_c_max_bytes: budget for the per-item prefix products a forward for differentiation keeps for the
        backward (T = 3 with prefix reuse, `FlowPlan.prefix_c`), summed over table groups (default 256 MiB);
        past it a group's kernels compute them item by item. Lower it if those buffers crowd device memory.
      plan_block: sorted lookups per program of the plan's bookkeeping passes (`tt_jax.kernels.plan`; default
        1024, a power of 2).
      plan_scan_chunk: rows per step of the single-program prefix sums over those passes' block counts
        (`tbe_jax.kernels.scan`; default 1024, a power of 2).
      packed_key_limit: the plan sorts one packed int32 key per lookup while a table group's sort keys stay below
        this, else two keys (table, key), more slowly (`prefix.StackedTables`; default 2**31 - 1, the int32
        limit, also the most). Lower only to run the two-key sort on small tables (tests).
      reorder_key_limit: T = 3 sorts by the digits (i2, i1, i3) while every table's p1 p2 p3 stays below this,
        else by (i1, i2, i3) (`StackedTables.prefix_digits`; default 2**31 - 1, also the most). Lower only to
        run the plain order on small tables (tests).
      force_int64_addressing: 64-bit address arithmetic in the rows, packed-prefix and pooling kernels even where
        every buffer holds fewer than 2**31 elements (default False: they switch to it at 2**31 by
        themselves). For tests of the wide paths on small inputs; slower.
    """

    schedule: str = "static"
    chunk: int = 64
    tile_rows: int = 8
    prefix_reuse: bool = True
    num_programs: int | None = None
    programs_per_sm: int = 32
    num_warps: int = 2
    num_stages: int = 1
    precision: str = "tf32x3"
    pool_bags: int = 8
    pool_unroll: int = 4
    pool_warps: int = 1
    prefix_c_max_bytes: int = 256 << 20
    plan_block: int = 1024
    plan_scan_chunk: int = 1024
    packed_key_limit: int = _KEY_MAX
    reorder_key_limit: int = _KEY_MAX
    force_int64_addressing: bool = False

    def __post_init__(self):
        cls = type(self).__name__
        if self.schedule not in SCHEDULES:
            raise ValueError(f"{cls}.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        _check_precision(cls, self.precision)
        if not isinstance(self.chunk, int) or self.chunk < 0:
            raise ValueError(f"{cls}.chunk must be an int >= 0, got {self.chunk!r}")
        _check_ints(cls, self, ("tile_rows", "programs_per_sm", "num_warps", "num_stages", "pool_bags",
                                "pool_unroll", "pool_warps", "plan_block", "plan_scan_chunk"),
                    pow2=("tile_rows", "num_warps", "pool_bags", "pool_warps", "plan_block", "plan_scan_chunk"))
        if self.num_programs is not None and (not isinstance(self.num_programs, int) or self.num_programs < 1):
            raise ValueError(f"{cls}.num_programs must be None or a positive int, got {self.num_programs!r}")
        if not isinstance(self.prefix_c_max_bytes, int) or self.prefix_c_max_bytes < 0:
            raise ValueError(f"{cls}.prefix_c_max_bytes must be an int >= 0, got {self.prefix_c_max_bytes!r}")
        for name in ("packed_key_limit", "reorder_key_limit"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= _KEY_MAX:
                raise ValueError(f"{cls}.{name} must be an int in [0, 2**31 - 1], got {v!r}")
        if not isinstance(self.force_int64_addressing, bool):
            raise ValueError(f"{cls}.force_int64_addressing must be a bool, got {self.force_int64_addressing!r}")

    @staticmethod
    def get_default() -> "TTForwardConfig":
        return TTForwardConfig()

    def programs(self, max_items: int) -> int:
        """Programs of the rows kernel for a static bound of `max_items` work items."""
        if self.schedule == "grid":
            return max_items
        p = self.num_programs
        if p is None:
            p = sm_count() * self.programs_per_sm
        return max(1, min(p, max_items))

    def stack_tables(self, specs, feature_table_map) -> list:
        """`prefix.stack_tables` under this config's sort rule (`packed_key_limit`, `reorder_key_limit`): the
        table groups of the plans built with it, which the forward's and the backward's kernels read."""
        return prefix.stack_tables(specs, feature_table_map, packed_limit=self.packed_key_limit,
                                   reorder_limit=self.reorder_key_limit)


@dataclasses.dataclass(frozen=True)
class TTBackwardConfig:
    """Knobs of the Pallas TT backward (`tt_jax.kernels.backward`).

    Attributes:
      impl: the backward of `TTEmbeddingBag` on the Pallas path (`jax.grad`, `apply_gradients`,
        `tbe_jax.train_step`): "pallas" (default: `tt_jax.kernels.backward`, deterministic) or "xla"
        (`tt_jax.backward`).
      lookup_tile: sorted lookups per program of the per-row gradient sum (default 64; a power of 2 >= 16).
      member_tile: sorted members (prefix groups or distinct rows) per program of the per-slice core-gradient
        sums (default 32; a power of 2 >= 16).
      rows: distinct rows per step of the per-group kernel (default 8, a power of 2).
      num_warps: warps per program of every backward kernel (default 2, a power of 2).
      group_kernel: the per-group kernel for T = 3: "tiles3" (default: the forward's `[q1 q2, r2]` prefix tile)
        or "general" (the any-T kernel). T = 2 and 4 always use "general".
      precision: fp32 dot algorithm on the GPU, as `TTForwardConfig.precision` (default "tf32x3").
    """

    impl: str = "pallas"
    lookup_tile: int = 64
    member_tile: int = 32
    rows: int = 8
    num_warps: int = 2
    group_kernel: str = "tiles3"
    precision: str = "tf32x3"

    def __post_init__(self):
        cls = type(self).__name__
        if self.group_kernel not in GROUP_KERNELS:
            raise ValueError(f"{cls}.group_kernel must be 'tiles3' or 'general', got {self.group_kernel!r}")
        if self.impl not in BACKWARD_IMPLS:
            raise ValueError(f"{cls}.impl must be 'pallas' or 'xla', got {self.impl!r}")
        for name in ("lookup_tile", "member_tile"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 16 or v & (v - 1):
                raise ValueError(f"{cls}.{name} must be a power of 2 >= 16, got {v!r}")
        _check_precision(cls, self.precision)
        _check_ints(cls, self, ("rows", "num_warps"), pow2=("rows", "num_warps"))

    @staticmethod
    def get_default() -> "TTBackwardConfig":
        return TTBackwardConfig()

    def compiler_params(self):
        """Launch knobs of every backward kernel."""
        return plgpu.CompilerParams(num_warps=self.num_warps, num_stages=1)


# TTKernelConfig field -> TTBackwardConfig field (the other fields are TTForwardConfig's; `precision` is both's).
_BACKWARD_FIELDS = {"backward": "impl", "bwd_lookup_tile": "lookup_tile", "bwd_member_tile": "member_tile",
                    "bwd_rows": "rows", "bwd_num_warps": "num_warps", "bwd_group_kernel": "group_kernel",
                    "precision": "precision"}


@dataclasses.dataclass(frozen=True)
class TTKernelConfig:
    """Every knob of the TT kernels in one flat, hashable config (`TTEmbeddingBag(config=...)`).

    The fields without a `bwd_` prefix (and `backward`) are those of `TTForwardConfig`, under the same names;
    `backward` and the `bwd_*` fields are `TTBackwardConfig`'s (`backward` -> `impl`, `bwd_rows` -> `rows`, ...);
    `precision` sets both. `forward_config` and `backward_config` give the two parts, which the kernels take.
    See those classes for what each field does and its default.
    """

    schedule: str = "static"
    chunk: int = 64
    tile_rows: int = 8
    prefix_reuse: bool = True
    num_programs: int | None = None
    programs_per_sm: int = 32
    num_warps: int = 2
    num_stages: int = 1
    precision: str = "tf32x3"
    pool_bags: int = 8
    pool_unroll: int = 4
    pool_warps: int = 1
    backward: str = "pallas"
    bwd_lookup_tile: int = 64
    bwd_member_tile: int = 32
    bwd_rows: int = 8
    bwd_num_warps: int = 2
    bwd_group_kernel: str = "tiles3"
    prefix_c_max_bytes: int = 256 << 20
    plan_block: int = 1024
    plan_scan_chunk: int = 1024
    packed_key_limit: int = _KEY_MAX
    reorder_key_limit: int = _KEY_MAX
    force_int64_addressing: bool = False

    def __post_init__(self):
        self.forward_config  # noqa: B018  (each part validates its fields)
        self.backward_config  # noqa: B018

    @staticmethod
    def get_default() -> "TTKernelConfig":
        return TTKernelConfig()

    @staticmethod
    def from_parts(forward: TTForwardConfig | None = None, backward: TTBackwardConfig | None = None
                   ) -> "TTKernelConfig":
        """The flat config of a forward and a backward config (None: its default). Their precisions must agree."""
        forward = forward if forward is not None else TTForwardConfig()
        backward = backward if backward is not None else TTBackwardConfig(precision=forward.precision)
        if forward.precision != backward.precision:
            raise ValueError(f"{forward.precision=} and {backward.precision=} must agree")
        kw = {f.name: getattr(forward, f.name) for f in dataclasses.fields(TTForwardConfig)}
        kw.update({flat: getattr(backward, name) for flat, name in _BACKWARD_FIELDS.items()})
        return TTKernelConfig(**kw)

    @property
    def forward_config(self) -> TTForwardConfig:
        return TTForwardConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(TTForwardConfig)})

    @property
    def backward_config(self) -> TTBackwardConfig:
        return TTBackwardConfig(**{name: getattr(self, flat) for flat, name in _BACKWARD_FIELDS.items()})

    def programs(self, max_items: int) -> int:
        """`TTForwardConfig.programs`."""
        return self.forward_config.programs(max_items)


def forward_part(config) -> TTForwardConfig:
    """The forward knobs of a `TTKernelConfig` or `TTForwardConfig`."""
    if isinstance(config, TTKernelConfig):
        return config.forward_config
    if isinstance(config, TTForwardConfig):
        return config
    raise TypeError(f"expected a TTForwardConfig or TTKernelConfig, got {type(config).__name__}")


def backward_part(config) -> TTBackwardConfig:
    """The backward knobs of a `TTKernelConfig` or `TTBackwardConfig`."""
    if isinstance(config, TTKernelConfig):
        return config.backward_config
    if isinstance(config, TTBackwardConfig):
        return config
    raise TypeError(f"expected a TTBackwardConfig or TTKernelConfig, got {type(config).__name__}")
