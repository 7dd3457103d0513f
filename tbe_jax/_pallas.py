"""The one place that imports Pallas-Triton and silences its deprecation notice.

jax 0.11+ warns that the Pallas Triton backend "will be removed in a future JAX
version" each time a Triton kernel is lowered. We pin jax to the range where the
backend exists (see pyproject.toml), so the notice carries no information for our
users; it is filtered here, once, for every kernel in the package.
"""

from __future__ import annotations

import contextlib
import warnings

from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

__all__ = ["pl", "plgpu", "quiet_triton_deprecation"]

_TRITON_DEPRECATION = r"(?is).*triton.*"


def _install_filter() -> None:
    warnings.filterwarnings(
        "ignore", message=_TRITON_DEPRECATION, category=DeprecationWarning
    )


@contextlib.contextmanager
def quiet_triton_deprecation():
    """Context in which Pallas-Triton lowering runs without its deprecation notice.

    The module-level filter covers ordinary programs; this context also covers
    callers (pytest, notebooks) that reset the warning filters after import.
    """
    with warnings.catch_warnings():
        _install_filter()
        yield


_install_filter()
