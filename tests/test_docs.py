"""The docstring examples run (they are the API's first documentation)."""

import doctest

import pytest

import tbe_jax.optim
import tbe_jax.specs
import tbe_jax.quant
import tbe_jax.tbe
import tt_jax.tt


@pytest.mark.parametrize("module", [tbe_jax.tbe, tbe_jax.optim, tbe_jax.quant, tbe_jax.specs, tt_jax.tt], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, result
