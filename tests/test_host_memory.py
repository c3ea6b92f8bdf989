"""Host-memory helpers of the CPU trainer: page release reads back as zeros, populating keeps the contents."""

import torch

from afm_core.utils.host_memory import PAGE_BYTES, populate_for_write, zero_by_release


def _resident_pages(tensor: torch.Tensor) -> int:
    """Resident pages under ``tensor`` (``mincore(2)`` through /proc/self/pagemap is not readable unprivileged;
    the present bit of pagemap is, and is all this needs)."""
    start = tensor.data_ptr() // PAGE_BYTES
    end = -(-(tensor.data_ptr() + tensor.numel() * tensor.element_size()) // PAGE_BYTES)
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(start * 8)
        entries = pagemap.read((end - start) * 8)
    return sum(int.from_bytes(entries[i : i + 8], "little") >> 63 for i in range(0, len(entries), 8))


def test_populate_after_release_keeps_zeros_and_accumulates_like_a_resident_buffer():
    torch.manual_seed(0)
    a, b = torch.randn(64, 32), torch.randn(32, 1024)
    buffer = torch.randn(3 * 64 * 1024 + 7)  # a grad buffer: several MiB, page-unaligned slices
    main_grad = buffer[5 : 5 + 64 * 1024].view(64, 1024)
    pages = -(-(main_grad.data_ptr() + main_grad.numel() * 4) // PAGE_BYTES) - main_grad.data_ptr() // PAGE_BYTES
    zero_by_release(buffer)
    assert _resident_pages(main_grad) <= 2  # the partial pages at both ends, written with zeros
    populate_for_write(main_grad)
    assert _resident_pages(main_grad) == pages
    assert not buffer.any()  # contents unchanged: zeros
    main_grad.addmm_(a, b)
    torch.testing.assert_close(main_grad, a @ b, rtol=0, atol=0)
    expected = buffer.clone()
    populate_for_write(main_grad)  # resident already: nothing changes
    assert torch.equal(buffer, expected)
    populate_for_write(torch.ones(3, 3).t())  # not contiguous, tiny: no-op
