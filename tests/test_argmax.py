"""vocab_argmax finds exactly torch.argmax's index: the first maximum, NaN as the largest, on any shape and dtype."""

import pytest
import torch

from tetris_hf.logits import vocab_argmax


def _cases():
    generator = torch.Generator().manual_seed(0)
    random = torch.randn(4, 3, 1024, generator=generator)
    ties = torch.zeros(3, 1024)
    ties[0, [700, 5, 900]] = 1.0  # equal maxima: the first wins
    ties[1, [1023, 256]] = 2.0  # the maximum in the middle, and at the very end
    ties[2, :] = 7.0  # all equal: index 0
    nan = torch.randn(2, 1024, generator=generator)
    nan[0, 600], nan[1, [3, 900]] = float("nan"), float("nan")
    nan[1, 2] = float("inf")
    infinite = torch.full((2, 512), float("-inf"))
    infinite[1, 400] = 0.0
    half = torch.randn(3, 2048, generator=generator).to(torch.bfloat16)  # bf16 ties are common
    odd_vocab = torch.randn(3, 1000, generator=generator)
    double = torch.randn(2, 3, 512, generator=generator, dtype=torch.float64)
    fp16 = torch.randn(3, 512, generator=generator).half()
    fp16[0, [7, 9]] = 100.0
    grad = torch.randn(2, 256, generator=generator, requires_grad=True)  # not viewable by NumPy: torch's own
    small = torch.randn(5, 100, generator=generator)
    strided = torch.randn(2, 5, 1024, generator=generator)[:, 1:4]  # rows of a larger block, as the loop slices
    one_row = torch.randn(1, 1, 2048, generator=generator)  # a draft token at batch size 1
    return {"random": random, "ties": ties, "nan": nan, "infinite": infinite, "bf16": half, "odd vocab": odd_vocab,
            "float64": double, "float16": fp16, "requires grad": grad,
            "small": small, "strided": strided, "one row": one_row, "empty": torch.empty(0, 1024)}


@pytest.mark.parametrize("name", list(_cases()))
def test_vocab_argmax_equals_torch_argmax(name):
    scores = _cases()[name]
    found = vocab_argmax(scores)
    assert found.dtype == torch.long and torch.equal(found, scores.argmax(dim=-1))


def test_the_ties_case_has_the_first_maximum_before_later_ones():
    scores = _cases()["ties"]
    assert vocab_argmax(scores).tolist() == [5, 256, 0]
