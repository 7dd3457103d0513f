"""The one place that imports Pallas-Triton and silences its deprecation notice.

jax 0.11+ warns that the Pallas Triton backend "will be removed in a future JAX
version" each time a Triton kernel is lowered. We pin jax to the range where the
backend exists (see pyproject.toml), so the notice carries no information for our
users; it is filtered here, once, for every kernel in the package. (pytest resets
warning filters per test, so pyproject.toml repeats the filter for the suite.)
"""

from __future__ import annotations

import warnings

from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

__all__ = ["pl", "plgpu"]

_TRITON_DEPRECATION = r"(?s).*Pallas Triton backend is deprecated"


def _install_filter() -> None:
    warnings.filterwarnings(
        "ignore", message=_TRITON_DEPRECATION, category=DeprecationWarning
    )


_install_filter()
