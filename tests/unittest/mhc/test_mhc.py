"""mHC weights: shapes, ranges and the Sinkhorn constraint (parity with the reference is in
tests/integration/test_hf_parity.py)."""

from __future__ import annotations

import pytest
import torch

from trtllm_glm.modules.mhc import mhc_block, mhc_collapse, mhc_expand, mhc_weights

pytestmark = pytest.mark.cpu_only


def _params(S: int, D: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mix = (2 + S) * S
    return (torch.randn(mix, S * D, generator=g) * 0.3, torch.randn(mix, generator=g) * 0.5,
            1 + 0.3 * torch.randn(3, generator=g))  # fmt: skip


def test_weights_ranges_and_doubly_stochastic_comb() -> None:
    S, D = 4, 16
    streams = torch.randn(7, S, D, generator=torch.Generator().manual_seed(1))
    fn, base, scale = _params(S, D)
    pre, post, comb = mhc_weights(streams, fn, base, scale, norm_eps=1e-5, hc_eps=1e-6, sinkhorn_iters=20)
    assert pre.shape == post.shape == (7, S) and comb.shape == (7, S, S)
    assert (pre > 0).all() and (pre <= 1 + 1e-6).all() and (post > 0).all() and (post < 2).all()
    torch.testing.assert_close(comb.sum(-2), torch.ones(7, S), atol=1e-4, rtol=0)
    # Sinkhorn ends on a column normalisation: rows are only close to 1 after 20 iterations.
    torch.testing.assert_close(comb.sum(-1), torch.ones(7, S), atol=2e-2, rtol=0)


def test_block_is_collapse_then_expand_and_scale_invariant_weights() -> None:
    S, D = 4, 8
    streams = torch.randn(5, S, D, generator=torch.Generator().manual_seed(2))
    fn, base, scale = _params(S, D, seed=3)
    kw = dict(norm_eps=1e-5, hc_eps=1e-6, sinkhorn_iters=5)
    lin = torch.nn.Linear(D, D)
    out = mhc_block(streams, lin, fn, base, scale, **kw)
    pre, post, comb = mhc_weights(streams, fn, base, scale, **kw)
    want = post[..., None] * lin(mhc_collapse(streams, pre))[:, None, :] + torch.einsum("njs,njd->nsd", comb, streams)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mhc_expand(streams, lin(mhc_collapse(streams, pre)), post, comb), want)
    # The weights come from RMS-normed streams: scaling every stream leaves them unchanged.
    p2, q2, c2 = mhc_weights(streams * 7.0, fn, base, scale, **kw)
    torch.testing.assert_close((p2, q2, c2), (pre, post, comb), atol=1e-5, rtol=1e-5)
