"""The chunked output layer + cross entropy (afm_core.train.loss.linear_cross_entropy) against F.cross_entropy."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from afm_core.train.loss import linear_cross_entropy


def test_chunked_linear_cross_entropy_equals_full_logits_loss_and_grads():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 50, (37,), generator=g)
    labels[[3, 20]] = -100  # ignored: loss 0, no gradient
    upstream = torch.rand(37, generator=g)  # a per-token loss mask times a scale

    loss = linear_cross_entropy(hidden, weight, labels, chunk_bytes=4 * 50 * 8)  # chunks of 8 rows
    expected = F.cross_entropy(hidden @ weight.t(), labels, reduction="none")
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    grads = torch.autograd.grad((loss * upstream).sum(), (hidden, weight))
    expected_grads = torch.autograd.grad((expected * upstream).sum(), (hidden, weight))
    for grad, reference in zip(grads, expected_grads):
        torch.testing.assert_close(grad, reference, rtol=1e-5, atol=1e-6)
