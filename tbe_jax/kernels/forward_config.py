"""`ForwardConfig`: the knobs of the pooled forward kernel (`kernels.forward`), and their defaults."""

from __future__ import annotations

import dataclasses

from tbe_jax.pallas_compat import sm_count
from tbe_jax.specs import next_pow2

_FP32_ACCUMULATION = ("fp32", "fp64", "twosum")
_CTAS_PER_SM = 32  # resident thread blocks an SM holds at most (Hopper; one-warp programs reach it at <= 64 registers)


@dataclasses.dataclass(frozen=True)
class ForwardConfig:
    """Block sizes and launch knobs of the pooled forward kernel.

    Attributes:
      tile_elems: elements of the `[G, Dp]` tile gathered per step (default 256); `G` (bags per
        program) is `tile_elems // Dp`, clipped to `[1, max_bags]` and to the batch.
      max_bags: upper bound on bags per program (default 64).
      unroll: steps (rows per bag) whose loads are issued together (default 4).
      num_warps: warps per program (a power of 2), or None (default): `launch_warps`' rule, 2 for a launch of
        fp32 rows with per-sample weights where some row tile is at most 128 columns wide, else 1. Such a
        launch takes 80 registers a thread at one warp (25 programs an SM) against 61-64 for every other
        float launch (32, the cap of one-warp programs), and two warps restore its occupancy: 1.09-1.80x on
        the 6 such shards timed on an H200 (`benchmarks/NOTES.md`, session 48); fp32 rows of 256-wide tiles
        (63 registers) lost 0.89-0.91x, unweighted fp32 launches 0.83-1.02x and fp16 ones to 0.71x (session 47).
      wide_bags: bags (and warps) per program of a launch of wide rows with short bags (default 2; 1: off).
        A float launch whose every row tile is `tile_elems` columns (D 129-256 at the default) has one
        bag per one-warp program, and one-warp programs are capped at 32 an SM (the CTA limit), half the warps
        an SM holds; with short bags such a launch is latency-bound at that occupancy. When the launch's bags
        average at most `wide_max_mean` ids (the static mean: `len(indices)` over the bags) and there are at
        least `wide_min_bags` bags, each program takes `wide_bags` bags on as many warps (the same work a
        thread): 1.24-1.67x on such shards of D 160-256 at B 8192-32768 on an H100, where long bags (whose
        programs are bound by bandwidth, and two bags in a program wait for the longer) lost up to 1.4x
        (`benchmarks/NOTES.md`, session 50). Not for quantized rows, nor with an explicit `num_warps`, nor for
        tiles wider than `tile_elems` (still one bag a program with twice the tile: unmeasured).
      wide_min_bags: the least bags (all features) for `wide_bags` (default 8192: two waves of one-warp
        programs on an H100's 132 SMs; fewer bags leave SMs idle rather than short of warps).
      wide_max_mean: the largest static mean bag length for `wide_bags` (default 3.0).
      prefetch: load the next step's ids while this step's rows are in flight (default True).
      num_stages: Triton software-pipelining depth (default 1).
      segment_buffers: storage buffers (distinct dims; quantized: distinct (weight type, row words)) per
        launch (default 8): the kernel has one code branch per buffer, and Triton's compile time grows faster
        than linearly with the branches, so models with more buffers get one launch per `segment_buffers` of
        them, writing their features' columns of one output in place.
      merge_programs: a launch over more than `segment_buffers` buffers (at most twice as many) stays one
        launch when it runs at most this many programs; 0 (default) always splits. Split launches run one
        after the other, and a small one leaves most SMs idle: on an H100 a ten-dim shard at B 512 took
        51 + 35 us, its second launch 160 programs of long bags running alone. Opt-in until timed
        (`benchmarks/NOTES.md`, session 62).
      bag_groups: sub-groups of `G` bags each program owns (default 1). The first row of every bag of the
        program's `G * bag_groups` bags is loaded at once, then the sub-groups' remaining rows run one
        sub-group after the other: one-id bags (the small tables of a DLRM) pay a program's fixed cost once
        per `G * bag_groups` bags, while long bags get fewer, longer programs. 2 suits models whose
        features mostly have one or two ids per bag (MLPerf's DLRMv2 tables) and slows long bags
        (measurements: docs/kernels.md).
      short_bag_groups: `bag_groups` for the features whose table's `bag_size_hint` is at most 2 (bags known
        to hold one or two ids): they get a segment of programs of their own (default 2).
      max_programs: looping programs of the pooled forward's launch (a persistent grid), or None (default):
        the rule of `persistent_max_mean` and `persistent_max_values`. With P looping programs and a schedule
        of n entries (`G` bags each), program p < P runs entries p, p + P, ... (`n // P - 1` of them) in a
        loop, and each later program one of the remaining entries, launched as the loops finish (they balance
        the end as a plain grid does). The same code pools each bag, in the same order: the outputs are bitwise
        those of the plain grid (one program an entry), which a launch keeps where `n < 3 P`.
      persistent_max_mean, persistent_max_values: the rule for `max_programs` None: a one-warp float launch
        whose bags hold at most `persistent_max_mean` ids on average (the static `len(indices)` over the launch's
        bags; default 10) and pool at most `persistent_max_values` values (that mean times the bags' mean row
        width; default 1280, ten rows of 128) gets `32 * sms` looping programs (one resident wave: the CTA limit
        of an SM times its SMs); 0 in either turns the rule off. Short bags make many programs of little work
        each, and a thread block a program costs more than their pooling: on an H100, DLRMv2's tables (8.2 ids,
        1053 values a bag) 0.1229 -> 0.1108 ms, the seed shards under both bounds 1-11% faster; more work a bag
        loses to the plain grid (8.4 ids of 192 values: +5.5%; base's 20 of 128: +5%; 56 ids: +19%)
        (`benchmarks/NOTES.md`, sessions 57-58).
      fp32_accumulation: how fp32 weights are summed. "fp32" (default): fp32 sums, as
        FBGEMM's CUDA kernels do (their accumulator type for fp32 weights is fp32);
        "fp64": fp64 accumulators, "twosum": an fp32 sum and its TwoSum error term, both
        within 2 ulp of the exact sum of any bag (`tests/test_accuracy.py`), slower than "fp32" (their cost:
        docs/kernels.md). fp16/bf16 weights always sum in fp32.
      row_tile_bytes: quantized rows (`tbe_jax.quantize`): stored bytes of the rows a step gathers. Their `G`
        is the larger of the float rule's `tile_elems // Dp` and `row_tile_bytes // next_pow2(row bytes)`
        (an int4 row of D = 128 is 80 bytes: 4 bags where an fp16 row gets 2), at most `row_tile_elems // Dp`.
        None (default): `2 * tile_elems`, the bytes of the fp16 tile `tile_elems` was tuned for. Derived, not
        yet tuned on a GPU.
      row_tile_elems: quantized rows: at most this many dequantized fp32 values in a step's tile (`G * Dp`,
        registers); None (default): `2 * tile_elems`.
    """

    tile_elems: int = 256
    max_bags: int = 64
    unroll: int = 4
    num_warps: int | None = None
    num_stages: int = 1
    prefetch: bool = True
    segment_buffers: int = 8
    merge_programs: int = 0
    fp32_accumulation: str = "fp32"
    bag_groups: int = 1
    short_bag_groups: int = 2
    max_programs: int | None = None
    persistent_max_mean: float = 10.0
    persistent_max_values: float = 1280.0
    row_tile_bytes: int | None = None
    row_tile_elems: int | None = None
    wide_bags: int = 2
    wide_min_bags: int = 8192
    wide_max_mean: float = 3.0

    def __post_init__(self):
        for name in ("tile_elems", "max_bags", "unroll", "num_stages", "segment_buffers"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"ForwardConfig.{name} must be a positive int, got {v!r}")
        w = self.num_warps
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1 or w & (w - 1)):
            raise ValueError(f"ForwardConfig.num_warps must be None or a positive power of 2, got {w!r}")
        if self.fp32_accumulation not in _FP32_ACCUMULATION:
            raise ValueError(
                f"ForwardConfig.fp32_accumulation must be one of {_FP32_ACCUMULATION}, "
                f"got {self.fp32_accumulation!r}"
            )
        for name in ("wide_min_bags", "merge_programs"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"ForwardConfig.{name} must be a non-negative int, got {v!r}")
        for name in ("wide_max_mean", "persistent_max_mean", "persistent_max_values"):
            m = getattr(self, name)
            if isinstance(m, bool) or not isinstance(m, (int, float)) or not m >= 0:
                raise ValueError(f"ForwardConfig.{name} must be a non-negative number, got {m!r}")
        for name in ("bag_groups", "short_bag_groups", "wide_bags"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1 or v & (v - 1):
                raise ValueError(f"ForwardConfig.{name} must be a positive power of 2, got {v!r}")
        for name in ("row_tile_bytes", "row_tile_elems", "max_programs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"ForwardConfig.{name} must be None or a positive int, got {v!r}")

    @staticmethod
    def get_default() -> "ForwardConfig":
        return ForwardConfig()

    def launch_warps(self, *, fp32_rows: bool, weighted: bool, block_dims) -> int:
        """Warps per program of one launch: `num_warps` if set, else 2 where the launch gathers fp32 rows (no
        quantized or fp16 buffer), has per-sample weights and has a branch whose tile (`block_dims`, one per
        branch) is at most 128 columns wide, else 1 (the rule and its measurements: `num_warps`)."""
        if self.num_warps is not None:
            return self.num_warps
        return 2 if fp32_rows and weighted and min(block_dims, default=256) <= 128 else 1

    def for_launch(self, *, dims, num_ids: int, num_bags: int, quantized: bool) -> "ForwardConfig":
        """The config one launch runs with: `self`, or under the `wide_bags` rule (rows of `dims`, every tile
        exactly `tile_elems` wide; `num_ids` ids in `num_bags` bags, static shapes) `self` with `wide_bags` times
        the tile and as many warps: `wide_bags` bags a program, one a warp."""
        k = self.wide_bags
        if k == 1 or quantized or self.num_warps is not None or not dims:
            return self
        if any(next_pow2(d) != self.tile_elems for d in dims) or num_bags < max(self.wide_min_bags, 1):
            return self
        if num_ids > self.wide_max_mean * num_bags:
            return self
        return dataclasses.replace(self, tile_elems=self.tile_elems * k, num_warps=k)

    def launch_programs(self, *, warps: int, num_ids: int, num_bags: int, mean_dim: float,
                        quantized: bool) -> int | None:
        """Looping programs of one pooled-forward launch (`max_programs`), or None for a plain grid: `max_programs`
        if set, else one resident wave, `32 * sm_count()`, for a one-warp float launch whose `num_ids` ids in
        `num_bags` bags (static shapes) of rows `mean_dim` wide on average (weighted by bags) hold at most
        `persistent_max_mean` ids and pool at most `persistent_max_values` values a bag (the rule and its
        measurements: `persistent_max_mean`)."""
        if self.max_programs is not None:
            return self.max_programs
        ids, values = self.persistent_max_mean, self.persistent_max_values
        if quantized or warps != 1 or not ids or not values:
            return None
        if num_ids > ids * num_bags or num_ids * mean_dim > values * num_bags:
            return None
        return _CTAS_PER_SM * sm_count()

    def bags_per_program(self, dim: int, max_batch: int, row_bytes: int | None = None) -> int:
        """`G` for rows of `dim` values (`row_bytes`: the stored bytes of a quantized row, None for float rows)
        and features of at most `max_batch` bags."""
        dp = next_pow2(dim)
        g = self.tile_elems // dp
        if row_bytes is not None:
            by_bytes = (self.row_tile_bytes or 2 * self.tile_elems) // next_pow2(row_bytes)
            g = min(max(g, by_bytes), (self.row_tile_elems or 2 * self.tile_elems) // dp)
        g = max(1, min(self.max_bags, g))
        g = min(g, next_pow2(max(max_batch, 1)))
        return 1 << (g.bit_length() - 1)  # a power of 2
