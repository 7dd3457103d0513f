"""`BackwardConfig`: the knobs of the sorted-run backward kernels and of their preprocessing, and their defaults."""

from __future__ import annotations

import dataclasses
import numbers

from tbe_jax.pallas_compat import sm_count

# The SM count of the GPU the program-count defaults (8192 and 4096, `BackwardConfig.programs`) were measured on, an
# H200: not a knob and not this device's count (that comes from `sm_count()` when the defaults are resolved), but
# the denominator that scales those defaults to the device.
REFERENCE_SMS = 132


def _count(v) -> bool:
    """An integer (Python's or NumPy's), not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def chunk_slots(n: int, long_run: int, split_chunk: int) -> int:
    """Chunk task slots for `n` lookups: a run of L >= `chunked_min` lookups has at most 2 L / c chunks (c its chunk
    length, `long_run` or `split_chunk`, the smaller bounding them), so at most 2 n / c + 1 in all."""
    return 2 * n // (split_chunk or long_run) + 1


def _pow2(v) -> bool:
    return _count(v) and v >= 1 and not v & (v - 1)


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    """Knobs of the sorted-run backward kernels (`tbe_jax.kernels.backward`) and of the preprocessing that sorts
    the lookups into runs (`tbe_jax.runs.build_runs`).

    Defaults are the H200 winners; the sweeps behind them are in benchmarks/NOTES.md ("Performance (H200,
    backward)", "Design notes moved from the kernel docstrings").

    Attributes:
      small_block: runs (<= `small_run_max` lookups each) one small-run task updates together. None (default): 8
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
      long_num_warps: warps per program of the long-run kernel alone (default 4: with `long_block` 16, a Zipf
        batch's hot rows sum their chunk partials ~13% faster than at one warp); None: `num_warps`.
      sort_in_forward: `tbe_jax.train_step` only: build the runs (sort, run-length encoding) in the step's
        forward half and keep them as residuals for the update (default False: build them in the update).
      prefetch: the mid-run and chunk kernels load step i+1's source offsets while step i's gradient rows
        arrive (software pipelining). None (default): on for fp32 tables, off for fp16/bf16 (slower there).
      rle_kernel: run-length encode the sorted keys with the Pallas passes of `kernels.rle` (default True)
        instead of ~15 XLA ops.
      rle_fill: the run-length write pass fills every slot past the counts (`run_start` with the valid lookups'
        count, `run_key` with the total row count, the mid and long lists with N). False (default): it writes
        only `run_start[num_runs]` (the last run's end) and leaves the rest undefined; the kernels read below the
        counts only, and an update of N lookups in few runs writes ~8 N bytes fewer (0.3-4.5% faster updates on
        an H100, none slower: `benchmarks/results/probe-rle-fill-20261207-s55-NVIDIA_H100.json`).
      rank_sort_max: batches of at most this many lookups are sorted by the counting-rank kernels
        (`kernels.ranksort`) instead of XLA's sort (default 24576; 0: never). In interpret mode only with
        `rank_sort_interpret`.
      rank_sort_interpret: whether interpret mode takes the counting-rank sort too (default False: XLA's sort
        there, which gives the same runs without the interpreted kernels' CPU compile time).
      rank_sort_chunk: positions the counting-rank sort ranks by direct comparison (default 2048, a multiple
        of `rank_sort_block_j` and of `rank_sort_merge_block`); larger batches take its merge pass (binary
        searches in the other chunks).
      rank_sort_block_i, rank_sort_block_j: keys per program of the counting-rank sort's chunk pass (default 16),
        and keys each of them compares against per step (default 256, a multiple of `rank_sort_block_i`); both
        powers of 2.
      rank_sort_merge_block: keys per program of the counting-rank sort's merge pass (default 256, a power of 2).
      rank_sort_wide_block: K keys a program of the merge pass, which searches all other chunks at once (one
        `[K, chunks]` gather a halving step, `ranksort._wide_merge_kernel`; default 16, a power of 2 dividing
        `rank_sort_chunk`) while K times the chunk count (padded to a power of 2) is at most
        `rank_sort_wide_tile`, and one chunk after another past that; 0: always one after another, a chain of
        log2(`rank_sort_chunk`) dependent loads per chunk. On an H100 the wide merge took an update of 17k
        lookups from 0.061 to 0.050 ms (`benchmarks/results/probe-rank-merge-20261207-s53-NVIDIA_H100.json`).
      rank_sort_wide_tile: the wide merge's largest tile, K times the padded chunk count (default 512: its
        registers grow with the tile; on an H100 the merge at 16 or 32 keys a program took 0.016-0.022 ms against
        the serial 0.027-0.036 at 12 chunks of 2048 and lost from 21 chunks on, 41k keys 0.072-0.077 against
        0.060: `benchmarks/results/probe-ranksort-wide-20261207-s53-NVIDIA_H100.json`).
      merge_width: segments of this tile width or less (the narrow ones) share one small-run launch with the
        segment before them, each keeping its own programs (default 32; 0: one launch per segment).
      narrow_block: runs per small-run block of those narrow segments (SGD or row-wise state, `small_block`
        None; default 32; 0: the rules of `small_block`).
      narrow_sort_keys: XLA's sort (batches past `rank_sort_max`) sorts the lookups' row keys as uint8 when all
        tables together have at most 255 rows, as uint16 up to 65535, else int32 (default True). Its radix sort
        makes one pass per key byte, so small tables pay one or two passes instead of four.
      small_run_max: runs of at most this many lookups are small runs, updated in blocks by the small-run kernel
        (default 8, >= 1); longer ones are mid runs (one task each) or long runs.
      long_run: runs of at least this many lookups are long runs, split into chunks of this many lookups for the
        two-pass chunk and long-run kernels (default 256, above `small_run_max`).
      split_chunk: a chunk length C: runs of 2C to `long_run` - 1 lookups are split into chunks of C too (the
        chunk and long-run kernels, as long runs), not one mid-run task each; runs of `long_run` or more keep
        chunks of `long_run` (a hot row's partials stay few). None (default): `long_run` // 4 (64 by default)
        where `small_run_max` < 2C < `long_run`, else 0; 0: no mid run is chunked. Where a batch's longest mid
        runs set the mid-run kernel's time (a few hundred of ~250 lookups: 32 dependent steps a task), C 64
        quarters the longest task: on an H100 it took 11-19% off such updates (s083, s098, s109, s148) and up
        to 7% where runs of 128-255 lookups are many (s040, s063), at a cost of up to 2.7% (the longer chunk
        lists) on updates with no such runs (`benchmarks/results/probe-split-chunk-20261207-s53-NVIDIA_H100.json`,
        `probe-defaults-20261207-s53-NVIDIA_H100.json`). The chunk workspace is `(2 N / C + 1, width)` fp32.
      long_block: chunk partials the long-run kernel sums per step, one `[long_block, width]` load (default 16,
        a power of 2): a hot row's thousands of chunks take that many times fewer dependent steps.
      step_width: segments of a tile width W below this gather `lookups_per_step * step_width / W` rows a step
        in the mid-run and chunk tasks and sum `long_block * step_width / W` partials a step in the long-run
        kernel: a step moves as many elements as at width `step_width`, so a narrow row's run takes that many
        times fewer dependent steps (`steps_at`). Default 128 (widths 128 and up unchanged); 0: K and
        `long_block` at every width. A power of 2. On an H100, 128 made updates of narrow rows with long or mid
        runs 4-35% faster and one 3% slower (`docs/kernels.md`, "Tuning fields").
      segment_buffers: most storage buffers per segment: a width class (of one row alignment) with more buffers
        is split into segments, branches of the backward's launches (default 8, >= 1). The runs and the update
        of one step must use the same value (both read it from this config).
      keys_block: lookups per program of the pass that gives each lookup its sort key (`kernels.keys`; default
        1024, a power of 2).
      rle_block: sorted lookups per program of the run-length passes (`kernels.rle`; default 1024, a power of 2).
      scan_chunk: rows per step of the single-program prefix sum over the run-length passes' block counts
        (`kernels.scan`), and long runs per step of the single program that counts their chunk tasks
        (`kernels.rle.long_chunks`); default 1024, a power of 2.
    """

    small_block: int | None = None
    small_num_warps: int | None = None
    lookups_per_step: int = 8
    programs: int | None = None
    small_programs: int | None = None
    num_warps: int = 1
    long_num_warps: int | None = 4
    sort_in_forward: bool = False
    prefetch: bool | None = None
    rle_kernel: bool = True
    rle_fill: bool = False
    rank_sort_max: int = 24576
    rank_sort_interpret: bool = False
    rank_sort_chunk: int = 2048
    rank_sort_block_i: int = 16
    rank_sort_block_j: int = 256
    rank_sort_merge_block: int = 256
    rank_sort_wide_block: int = 16
    rank_sort_wide_tile: int = 512
    merge_width: int = 32
    narrow_block: int = 32
    narrow_sort_keys: bool = True
    small_run_max: int = 8
    long_run: int = 256
    split_chunk: int | None = None
    long_block: int = 16
    step_width: int = 128
    segment_buffers: int = 8
    keys_block: int = 1024
    rle_block: int = 1024
    scan_chunk: int = 1024

    def resolved_programs(self, interpret: bool) -> tuple[int, int]:
        """(`programs`, `small_programs`), the None ones derived from the device (see the fields)."""
        def resolve(v, reference):
            if v is not None:
                return v
            return 16 if interpret else max(1, round(reference * sm_count() / REFERENCE_SMS))
        return resolve(self.programs, 8192), resolve(self.small_programs, 4096)

    @property
    def mid_chunk(self) -> int:
        """`split_chunk` resolved: the chunk length of chunked mid runs, 0 when none is chunked."""
        if self.split_chunk is not None:
            return self.split_chunk
        c = self.long_run // 4
        return c if self.small_run_max < 2 * c < self.long_run else 0

    @property
    def chunked_min(self) -> int:
        """The shortest run split into chunks: `long_run`, or `2 * mid_chunk` when that is set."""
        return 2 * self.mid_chunk if self.mid_chunk else self.long_run

    def max_chunks(self, n: int) -> int:
        """Chunk task slots for `n` lookups (`chunk_slots` at this config's `long_run` and `mid_chunk`)."""
        return chunk_slots(n, self.long_run, self.mid_chunk)

    def steps_at(self, base: int, width: int) -> int:
        """`base` rows a step (`lookups_per_step` or `long_block`) at tile width `width`, scaled by `step_width`."""
        return base * max(1, self.step_width // width) if self.step_width else base

    def rank_sort_limit(self, interpret: bool) -> int:
        """The largest batch (lookups) sorted by the counting-rank kernel."""
        return 0 if interpret and not self.rank_sort_interpret else self.rank_sort_max

    def __post_init__(self):
        def bad(name, want):
            raise ValueError(f"BackwardConfig.{name}={getattr(self, name)!r} must be {want}")

        for name in ("rank_sort_max", "rank_sort_wide_tile", "merge_width", "narrow_block"):
            v = getattr(self, name)
            if not _count(v) or v < 0:
                bad(name, "an int >= 0")
        for name in ("rank_sort_block_i", "rank_sort_block_j", "rank_sort_merge_block", "keys_block", "rle_block",
                     "scan_chunk"):
            if not _pow2(getattr(self, name)):
                bad(name, "a power of two")
        if self.rank_sort_block_j % self.rank_sort_block_i:
            bad("rank_sort_block_j", f"a multiple of rank_sort_block_i={self.rank_sort_block_i}")
        chunk = self.rank_sort_chunk
        if (not _count(chunk) or chunk < 1 or chunk % self.rank_sort_block_j
                or chunk % self.rank_sort_merge_block):
            bad("rank_sort_chunk", f"a multiple of rank_sort_block_j={self.rank_sort_block_j} and of "
                f"rank_sort_merge_block={self.rank_sort_merge_block}")
        for name in ("small_run_max", "segment_buffers"):
            v = getattr(self, name)
            if not _count(v) or v < 1:
                bad(name, "an int >= 1")
        if not _count(self.long_run) or self.long_run <= self.small_run_max:
            bad("long_run", f"an int above small_run_max={self.small_run_max}")
        wb = self.rank_sort_wide_block
        if not _count(wb) or wb < 0 or (wb and (not _pow2(wb) or self.rank_sort_chunk % wb)):
            bad("rank_sort_wide_block", f"0 or a power of two dividing rank_sort_chunk={self.rank_sort_chunk}")
        sc = self.split_chunk
        if sc is not None and (not _count(sc) or sc < 0 or (sc and not self.small_run_max < 2 * sc < self.long_run)):
            bad("split_chunk", f"None, 0 or an int C with small_run_max={self.small_run_max} < 2 C < "
                f"long_run={self.long_run}")
        if self.step_width and not _pow2(self.step_width):
            bad("step_width", "0 or a power of two")
        for name in ("small_block", "lookups_per_step", "long_block"):
            v = getattr(self, name)
            if v is None and name == "small_block":
                continue
            if not _pow2(v):
                raise ValueError(f"BackwardConfig.{name}={v!r} must be a power of two")
        for name in ("small_num_warps", "num_warps", "long_num_warps", "programs", "small_programs"):
            v = getattr(self, name)
            if name != "num_warps" and v is None:
                continue
            if not _count(v) or v < 1:
                raise ValueError(f"BackwardConfig.{name}={v!r} must be >= 1")
