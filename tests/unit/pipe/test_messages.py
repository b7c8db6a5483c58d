"""What a stage announces before its activations: a tuple of an fp32 activation (requires grad), an int64 mask and a
bf16 tensor (diffusion-pipe's 3-stage shape) round-trips exactly; outputs that cannot be sent and headers that do
not describe one are named errors before anything is allocated from them."""

import pytest
import torch

from zeroshard.pipe import PipeMessageError, TensorMeta, announce, encode, parse
from zeroshard.pipe.messages import MAGIC


def test_mixed_dtypes_and_grad_flags_round_trip():
    output = (
        torch.randn(2, 5, 8, requires_grad=True),
        torch.ones(2, 5, dtype=torch.int64),
        torch.zeros(2, 3, dtype=torch.bfloat16),
    )
    got = parse(encode(announce(output)))
    assert not got.single
    assert got.tensors == (
        TensorMeta((2, 5, 8), torch.float32, True),
        TensorMeta((2, 5), torch.int64, False),
        TensorMeta((2, 3), torch.bfloat16, False),
    )
    single = parse(encode(announce(torch.zeros((), dtype=torch.float16))))
    assert single.single and single.tensors == (TensorMeta((), torch.float16, False),)


@pytest.mark.parametrize(
    "output, message",
    [
        ([torch.zeros(2)], "a tensor or a tuple"),
        ((), "a tensor or a tuple"),
        (tuple(torch.zeros(1) for _ in range(65)), "a tensor or a tuple"),
        ((torch.zeros(2), "mask"), "element 1 .* is a str"),
        ((torch.zeros(2), None), "element 1 .* is a NoneType"),
        (torch.zeros(2, dtype=torch.complex64), "cannot be sent"),
        (torch.zeros([1] * 9), "at most 8 dims"),
    ],
)
def test_outputs_that_cannot_be_sent_are_named(output, message):
    with pytest.raises(PipeMessageError, match=message):
        announce(output)


def header(*fields):
    return torch.tensor(fields, dtype=torch.int64)


@pytest.mark.parametrize(
    "received, message",
    [
        (torch.zeros(4, dtype=torch.float32), "1-D int64"),
        (header(MAGIC, 0), "1-D int64"),
        (header(1234, 0, 1, 0, 0, 1, 2), "not a pipeline announcement"),
        (header(MAGIC, 2, 1, 0, 0, 1, 2), "not a pipeline announcement"),
        (header(MAGIC, 1, 2, 0, 0, 1, 2, 0, 0, 1, 2), "not a pipeline announcement"),
        (header(MAGIC, 0, 0), "not a pipeline announcement"),
        (header(MAGIC, 0, 10**6, 0, 0, 1, 2), "not a pipeline announcement"),
        (header(MAGIC, 0, 2, 0, 0, 1, 2), "ends inside tensor 1"),
        (header(MAGIC, 0, 1, 99, 0, 1, 2), "describes tensor 0 badly"),
        (header(MAGIC, 0, 1, -1, 0, 1, 2), "describes tensor 0 badly"),
        (header(MAGIC, 0, 1, 0, 5, 1, 2), "describes tensor 0 badly"),
        (header(MAGIC, 0, 1, 0, 0, 9, *[1] * 9), "describes tensor 0 badly"),
        (header(MAGIC, 0, 1, 0, 0, 3, 2), "describes tensor 0 badly"),
        (header(MAGIC, 0, 1, 0, 0, 1, -2), "shape \\[-2\\]"),
        (header(MAGIC, 0, 1, 0, 0, 2, 2**40, 2**40), "shape"),
        (header(MAGIC, 0, 1, 4, 1, 1, 2), "gradient of torch.int64"),
        (header(MAGIC, 0, 1, 0, 0, 1, 2, 7), "1 fields past its 1 tensors"),
    ],
)
def test_headers_that_describe_no_output_are_named_errors(received, message):
    with pytest.raises(PipeMessageError, match=message):
        parse(received, sender="stage 1 (rank 2)")
