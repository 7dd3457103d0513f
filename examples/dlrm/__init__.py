"""A DLRM-style demo on synthetic click logs, trained with tbe_jax's fused embedding optimizer.

- `examples.dlrm.data`: the synthetic click-log generator (planted signal, FBGEMM input format), on the
  host (NumPy, `ClickLogGenerator`) or drawn on the device in jitted code (`DeviceClickLog`).
- `examples.dlrm.model`: the model (bottom MLP, one TableBatchedEmbedding, dot interaction, top MLP).
- `examples.dlrm.train`: the training CLI, `python -m examples.dlrm.train`.
"""
