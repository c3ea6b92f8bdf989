"""The chunked output layer + cross entropy (afm_core.models.cross_entropy.linear_cross_entropy) against F.cross_entropy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from afm_core.models.cross_entropy import linear_cross_entropy

CHUNK_BYTES = 4 * 50 * 8  # chunks of 8 rows


def _inputs():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 50, (37,), generator=g)
    labels[[3, 20]] = -100  # ignored: loss 0, no gradient
    return hidden, weight, labels, g


def _grads(loss, upstream, hidden, weight, sink):
    """d hidden and d weight of ``(loss * upstream).sum()``; with a sink, d weight is what the sink gained."""
    grads = torch.autograd.grad((loss * upstream).sum(), (hidden, weight), allow_unused=sink is not None)
    if sink is None:
        return grads
    assert grads[1] is None  # the weight's gradient went into the sink only
    return grads[0], sink.clone()


@pytest.mark.parametrize("rows", ["found", "given"])
@pytest.mark.parametrize("sink", [False, True], ids=["autograd", "grad-sink"])
@pytest.mark.parametrize("upstream", ["ones", "per-row", "token-sum"])
def test_chunked_linear_cross_entropy_equals_full_logits_loss_and_grads(upstream, sink, rows):
    hidden, weight, labels, g = _inputs()
    # given: the labelled rows found by the caller, and with "ones" its promise that g = 1 on each (no check)
    given = {"rows": (labels >= 0).nonzero().squeeze(1), "unit_grads": upstream == "ones"} if rows == "given" else {}
    # ones: the SFT loss (a sum of masked token losses; d weight complete after forward); token-sum: one other
    # value on every labelled row; per-row: any upstream gradient. The ignored rows get any value.
    scale = {
        "ones": torch.ones(37),
        "per-row": torch.rand(37, generator=g),
        "token-sum": torch.full((37,), 0.3),
    }[upstream].index_fill(0, torch.tensor([3]), 5.0)
    grad_sink = torch.zeros(50, 16) if sink else None

    loss = linear_cross_entropy(hidden, weight, labels, chunk_bytes=CHUNK_BYTES, grad_sink=grad_sink, **given)
    expected = F.cross_entropy(hidden @ weight.t(), labels, reduction="none")
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    grads = _grads(loss, scale, hidden, weight, grad_sink)
    expected_grads = torch.autograd.grad((expected * scale).sum(), (hidden, weight))
    for grad, reference in zip(grads, expected_grads):
        torch.testing.assert_close(grad, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sink", [False, True], ids=["autograd", "grad-sink"])
def test_linear_cross_entropy_without_grad_mode_and_with_a_second_backward(sink):
    hidden, weight, labels, _ = _inputs()
    with torch.no_grad():
        eval_loss = linear_cross_entropy(hidden, weight, labels, chunk_bytes=CHUNK_BYTES)
    grad_sink = torch.zeros(50, 16) if sink else None
    loss = linear_cross_entropy(hidden, weight, labels, chunk_bytes=CHUNK_BYTES, grad_sink=grad_sink)
    torch.testing.assert_close(eval_loss, loss.detach())
    first = torch.autograd.grad(loss.sum(), (hidden, weight), retain_graph=True, allow_unused=sink)
    first_weight = grad_sink.clone() if sink else first[1]
    second = torch.autograd.grad(loss.sum(), (hidden, weight), allow_unused=sink)  # recomputed from the logits
    second_weight = grad_sink - first_weight if sink else second[1]
    expected = torch.autograd.grad(
        F.cross_entropy(hidden @ weight.t(), labels, reduction="none").sum(), (hidden, weight)
    )
    for got in ((first[0], first_weight), (second[0], second_weight)):
        for grad, reference in zip(got, expected):
            torch.testing.assert_close(grad, reference, rtol=1e-5, atol=1e-6)


def test_linear_cross_entropy_with_no_labelled_row_is_zero():
    hidden, weight, _, _ = _inputs()
    labels = torch.full((37,), -100)
    loss = linear_cross_entropy(hidden, weight, labels, chunk_bytes=CHUNK_BYTES)
    assert torch.equal(loss, torch.zeros(37))
    grad_hidden, grad_weight = torch.autograd.grad(loss.sum(), (hidden, weight))
    assert not grad_hidden.any() and not grad_weight.any()


class _MatmulRows(TorchDispatchMode):
    """Records the row count of every bf16 matmul (``aten.mm`` / ``aten.addmm``'s product) that passes."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out) and args[0].dtype == torch.bfloat16:
            self.rows.append(args[0].shape[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("upstream", ["ones", "per-row"])
def test_bf16_chunks_run_at_bucketed_row_counts_on_cpu_with_the_loss_and_grads_of_the_unpadded_rows(
    upstream, monkeypatch
):
    """On CPU in bf16 the chunks are multiples of 64 rows and the last one is run at a bucketed size with zero rows
    appended (torch keeps a bf16 matmul per new row count there: afm_core.models.cpu_shapes); the appended rows
    change no loss or gradient: the same numbers as the chunks run unpadded."""
    from afm_core.models import cross_entropy

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(150, 16, generator=g).bfloat16().requires_grad_()
    weight = torch.randn(50, 16, generator=g).bfloat16().requires_grad_()
    labels = torch.randint(0, 50, (150,), generator=g)
    scale = torch.ones(150) if upstream == "ones" else torch.rand(150, generator=g)

    def run() -> tuple[torch.Tensor, ...]:
        loss = linear_cross_entropy(hidden, weight, labels, chunk_bytes=4 * 50 * 150)  # 150 rows -> chunks of 128
        return (loss, *torch.autograd.grad((loss * scale).sum(), (hidden, weight)))

    with _MatmulRows() as seen:
        bucketed = run()
    assert seen.rows and set(seen.rows) <= {128, 64}  # 128 + 22 rows: the 22 run as 64
    monkeypatch.setattr(cross_entropy, "_kernel_rows", lambda h: h)
    with _MatmulRows() as seen:
        unpadded = run()
    assert 22 in seen.rows
    for a, b in zip(bucketed, unpadded):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
