"""Seconds-long check that FBGEMM loads and computes right on the GPU machine, right after its chunks are unpacked
(`benchmarks/fbgemm_chunks.sh` keeps only the sm_90a cubins of its libraries: this is their first test there).

- Training TBE (`SplitTableBatchedEmbeddingBagsCodegen`, fp32 weights, exact row-wise Adagrad, sum pooling): two
  tables, a forward against sums of the module's own rows (torch, float64), then a backward whose update must
  equal row-wise Adagrad computed here, and leave untouched rows as they were.
- Inference TBE (`IntNBitTableBatchedEmbeddingBagsCodegen`, int8 rows written here, skipped with --no-inference):
  a forward against float64 sums of the dequantized rows.

  python -m benchmarks fbgemm_smoke      (torch + fbgemm_gpu importable: `source .fbgemm-inf/n/unpack.sh`)
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

LR, EPS = 0.05, 1e-3


def _bags(rng, rows: int, batch: int, mean: int):
    lengths = rng.integers(0, 2 * mean + 1, batch)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return rng.integers(0, rows, int(offsets[-1])), offsets


def training(torch, rng) -> float:
    """Max abs error of the forward and of the updated rows against float64 references."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (BoundsCheckMode, ComputeDevice,
                                                                       EmbeddingLocation, PoolingMode)
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    tables, batch = ((1000, 64), (300, 128)), 256
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(e, d, EmbeddingLocation.DEVICE, ComputeDevice.CUDA) for e, d in tables],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=LR, eps=EPS, weights_precision=SparseType.FP32,
        output_dtype=SparseType.FP32, pooling_mode=PoolingMode.SUM, bounds_check_mode=BoundsCheckMode.FATAL,
        device=torch.device("cuda"))
    before = [w.detach().double().cpu().numpy().copy() for w in tbe.split_embedding_weights()]
    ids, offs = zip(*(_bags(rng, e, batch, 4) for e, _ in tables))
    flat_ids = np.concatenate(ids)
    flat_offs = np.concatenate([offs[0][:-1], offs[1] + offs[0][-1]])
    out = tbe(torch.tensor(flat_ids, device="cuda"), torch.tensor(flat_offs, device="cuda"))
    want = np.concatenate([np.stack([w[i[o[b]:o[b + 1]]].sum(0) for b in range(batch)])
                           for w, i, o in zip(before, ids, offs)], axis=1)
    err = float(np.abs(out.detach().double().cpu().numpy() - want).max())
    grad = rng.standard_normal(want.shape)
    out.backward(torch.tensor(grad, dtype=torch.float32, device="cuda"))
    after = [w.detach().double().cpu().numpy() for w in tbe.split_embedding_weights()]
    col = 0
    for w0, w1, i, o, (e, d) in zip(before, after, ids, offs, tables):
        g_rows = np.zeros((e, d))
        for b in range(batch):
            np.add.at(g_rows, i[o[b]:o[b + 1]], grad[b, col:col + d])
        col += d
        touched = np.zeros(e, bool)
        touched[i] = True
        m = (g_rows ** 2).mean(1)  # the accumulators start at 0
        upd = w0 - LR * g_rows / (np.sqrt(m) + EPS)[:, None]
        ref = np.where(touched[:, None], upd, w0)
        err = max(err, float(np.abs(w1 - ref).max()))
    return err


def inference(torch, rng) -> float:
    """Max error, relative to the largest output, of an int8 forward against float64 sums of the rows it
    dequantizes (scale and bias fp16 in each row's first four bytes, then one byte a value: FBGEMM's IntNBit
    int8 row)."""
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen

    rows, dim, batch = 1000, 64, 128
    tbe = IntNBitTableBatchedEmbeddingBagsCodegen([("t0", rows, dim, SparseType.INT8, EmbeddingLocation.DEVICE)],
                                                  pooling_mode=PoolingMode.SUM, device=torch.device("cuda"),
                                                  output_dtype=SparseType.FP32)
    tbe.initialize_weights()
    # views of the module's rows: uint8 [rows, dim] codes and [rows, 4] fp16 scale, bias (each row's first bytes)
    w_codes, w_qparams = tbe.split_embedding_weights(split_scale_shifts=True)[0]
    codes = rng.integers(0, 256, (rows, dim))
    scale = rng.uniform(0.001, 0.01, rows).astype(np.float16)
    bias = rng.uniform(-0.5, 0.5, rows).astype(np.float16)
    qparams = np.concatenate([scale.view(np.uint8).reshape(rows, 2), bias.view(np.uint8).reshape(rows, 2)], 1)
    w_codes.copy_(torch.tensor(codes.astype(np.uint8), device="cuda"))
    w_qparams.copy_(torch.tensor(qparams, device="cuda"))
    ids, offs = _bags(rng, rows, batch, 4)
    out = tbe(torch.tensor(ids, dtype=torch.int32, device="cuda"), torch.tensor(offs, dtype=torch.int32,
                                                                                  device="cuda"))
    values = codes * scale.astype(np.float64)[:, None] + bias.astype(np.float64)[:, None]
    want = np.stack([values[ids[offs[b]:offs[b + 1]]].sum(0) for b in range(batch)])
    # relative: FBGEMM's int8 kernel is off by 2.3e-3 absolute on outputs up to ~20 (an H100, session 62)
    return float(np.abs(out.double().cpu().numpy() - want).max() / np.abs(want).max())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-inference", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        import torch
        import fbgemm_gpu
    except ImportError as exc:
        sys.exit(f"fbgemm_smoke: cannot import torch + FBGEMM ({exc}); on the GPU machine unpack FBGEMM first "
                 "(`source .fbgemm-inf/n/unpack.sh`, benchmarks/fbgemm_chunks.sh)")
    rng = np.random.default_rng(0)
    err = training(torch, rng)
    print(f"FBGEMM training TBE: max abs error {err:.2e} (forward and row-wise Adagrad update against float64)")
    if err > 1e-4:
        sys.exit("FBGEMM smoke: FAILED (training TBE)")
    if not args.no_inference:
        err = inference(torch, rng)
        print(f"FBGEMM int8 inference TBE: max error {err:.2e} of the largest output, against float64")
        if err > 1e-3:
            sys.exit("FBGEMM smoke: FAILED (int8 inference TBE)")
    print(f"FBGEMM smoke: ok in {time.perf_counter() - t0:.1f} s ({fbgemm_gpu.__file__})")


if __name__ == "__main__":
    main()
