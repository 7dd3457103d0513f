"""`BackwardConfig`: the knobs of the sorted-run backward kernels, and their defaults."""

from __future__ import annotations

import dataclasses

from tbe_jax.pallas_compat import sm_count

# The counting-rank sort's default reach (`BackwardConfig.rank_sort_max`): where it stops beating XLA's sort of
# (key, position) on the H200 (`benchmarks/results/ranksort-20261202*.json`).
RANK_SORT_MAX = 24576
# The SM count of the GPU the program-count defaults were tuned on (an H200).
REFERENCE_SMS = 132


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    """Knobs of the sorted-run backward kernels (`tbe_jax.kernels.backward`).

    Defaults are the H200 winners; the sweeps behind them are in benchmarks/NOTES.md ("Performance (H200,
    backward)", "Design notes moved from the kernel docstrings").

    Attributes:
      small_block: runs (<= `runs.SMALL` lookups each) one small-run task updates together. None (default): 8
        for SGD and row-wise state, 4 with element-wise state (Adagrad, Adam, LAMB and their partial row-wise
        forms); width classes holding several dims (SGD, row-wise state) take about 1024 gradient elements per
        task (16 runs at width 64, 8 at 128, 4 at 256). Set it to force one block size everywhere.
      small_num_warps: warps per program of the small-run kernel. None (default): 2 for SGD and row-wise
        state, 4 with element-wise state.
      lookups_per_step: output-gradient rows (K) the mid-run and chunk kernels gather per step (default 8, a
        power of 2).
      programs: persistent programs of the mid-run, chunk and long-run kernels, capped by the task count bound.
        None (default): 8192 on a 132-SM GPU (an H200, where it was tuned), scaled by the device's SM count;
        16 in interpret mode (programs run one after another there). A value set here is used as given.
      small_programs: persistent programs of the small-run kernel (twice as many for the width classes holding
        several dims, with SGD or row-wise state). None (default): 4096 on a 132-SM GPU, scaled by the SM
        count; 16 in interpret mode. A value set here is used as given.
      num_warps: warps per program of the mid-run, chunk and long-run kernels (default 1).
      sort_in_forward: `tbe_jax.train_step` only: build the runs (sort, run-length encoding) in the step's
        forward half and keep them as residuals for the update (default False: build them in the update).
      prefetch: the mid-run and chunk kernels load step i+1's source offsets while step i's gradient rows
        arrive (software pipelining). None (default): on for fp32 tables, off for fp16/bf16 (slower there).
      rle_kernel: run-length encode the sorted keys with the Pallas passes of `kernels.rle` (default True)
        instead of ~15 XLA ops.
      rank_sort_max: batches of at most this many lookups are sorted by the counting-rank kernels
        (`kernels.ranksort`) instead of XLA's sort. None (default): `RANK_SORT_MAX` with compiled kernels, 0
        (XLA's sort) in interpret mode; 0: never.
      rank_sort_chunk: positions the counting-rank sort ranks by direct comparison (default 2048, a multiple
        of 256); larger batches take its merge pass (binary searches in the other chunks).
      merge_width: segments of this tile width or less (the narrow ones) share one small-run launch with the
        segment before them, each keeping its own programs (default 32; 0: one launch per segment).
      narrow_block: runs per small-run block of those narrow segments (SGD or row-wise state, `small_block`
        None; default 32; 0: the rules of `small_block`).
      narrow_sort_keys: XLA's sort (batches past `rank_sort_max`) sorts the lookups' row keys as uint8 when all
        tables together have at most 255 rows, as uint16 up to 65535, else int32 (default True). Its radix sort
        makes one pass per key byte, so small tables pay one or two passes instead of four.
    """


    small_block: int | None = None
    small_num_warps: int | None = None
    lookups_per_step: int = 8
    programs: int | None = None
    small_programs: int | None = None
    num_warps: int = 1
    sort_in_forward: bool = False
    prefetch: bool | None = None
    rle_kernel: bool = True
    rank_sort_max: int | None = None
    rank_sort_chunk: int = 2048
    merge_width: int = 32
    narrow_block: int = 32
    narrow_sort_keys: bool = True

    def resolved_programs(self, interpret: bool) -> tuple[int, int]:
        """(`programs`, `small_programs`), the None ones derived from the device (see the fields)."""
        def resolve(v, reference):
            if v is not None:
                return v
            return 16 if interpret else max(1, round(reference * sm_count() / REFERENCE_SMS))
        return resolve(self.programs, 8192), resolve(self.small_programs, 4096)

    def rank_sort_limit(self, interpret: bool) -> int:
        """The largest batch (lookups) sorted by the counting-rank kernel."""
        if self.rank_sort_max is not None:
            return self.rank_sort_max
        return 0 if interpret else RANK_SORT_MAX

    def __post_init__(self):
        if self.rank_sort_max is not None and (not isinstance(self.rank_sort_max, int) or self.rank_sort_max < 0):
            raise ValueError(f"BackwardConfig.rank_sort_max={self.rank_sort_max!r} must be None or an int >= 0")
        if not isinstance(self.rank_sort_chunk, int) or self.rank_sort_chunk < 256 or self.rank_sort_chunk % 256:
            raise ValueError(f"BackwardConfig.rank_sort_chunk={self.rank_sort_chunk!r} must be a multiple of 256")
        for name in ("merge_width", "narrow_block"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"BackwardConfig.{name}={v!r} must be an int >= 0")
        for name in ("small_block", "lookups_per_step"):
            v = getattr(self, name)
            if v is None and name == "small_block":
                continue
            if v < 1 or v & (v - 1):
                raise ValueError(f"BackwardConfig.{name}={v} must be a power of two")
        for name in ("small_num_warps", "num_warps", "programs", "small_programs"):
            if name != "num_warps" and getattr(self, name) is None:
                continue
            if getattr(self, name) < 1:
                raise ValueError(f"BackwardConfig.{name}={getattr(self, name)} must be >= 1")
