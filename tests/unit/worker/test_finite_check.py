"""The non-finite gradient check: 2-norm first, the exact max-abs pass only when needed."""

import pytest
import torch

from elasticdl.worker.trainer import NonFiniteError, check_finite_grads


def _named(**grads):
    out = []
    for name, g in grads.items():
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g
        out.append((name, p))
    return out


def test_finite_gradients_pass_even_when_their_squares_overflow():
    huge = torch.full((1000,), 3e30)          # finite; its 2-norm overflows float32
    assert not torch.isfinite(torch.linalg.vector_norm(huge))
    check_finite_grads(_named(a=torch.ones(3), b=huge))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_nan_or_inf_names_the_parameter(bad):
    g = torch.ones(5)
    g[3] = bad
    with pytest.raises(NonFiniteError, match="'b'"):
        check_finite_grads(_named(a=torch.ones(3), b=g, c=torch.ones(2)))
