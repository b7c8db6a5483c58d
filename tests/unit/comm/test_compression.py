"""The message formats against exact math: 1-bit signs and block scales, int8/int4 block quantization, sizes, and
error feedback that keeps exactly what the compression dropped."""

import pytest
import torch

from zeroshard.comm.compression import BLOCK, INT4, INT8, ONE_BIT, compress_with_feedback


def roundtrip(values: torch.Tensor, codec=ONE_BIT) -> torch.Tensor:
    message = torch.empty(codec.message_nbytes(values.numel()), dtype=torch.uint8)
    codec.compress(values, message)
    return codec.decompress(message, values.numel(), torch.empty(values.numel()))


def per_block(values: torch.Tensor, fn) -> torch.Tensor:
    out = torch.empty_like(values)
    for start in range(0, values.numel(), BLOCK):
        block = values[start : start + BLOCK]
        out[start : start + BLOCK] = fn(block)
    return out


SIZES = [1, 7, 8, 9, BLOCK, BLOCK + 5, 3 * BLOCK - 1]


@pytest.mark.parametrize("numel", SIZES)
def test_one_bit_decompresses_to_block_mean_absolute_value_times_sign(numel):
    values = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    values[0] = 0.0  # a zero counts as +1
    expected = per_block(values, lambda b: torch.where(b >= 0, b.abs().mean(), -b.abs().mean()))
    torch.testing.assert_close(roundtrip(values), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("codec", [INT8, INT4], ids=["int8", "int4"])
def test_block_quantization_rounds_to_the_nearest_level_of_max_over_levels(numel, codec):
    values = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3
    if numel > 8:
        values[3:6] = 0.0
    if numel >= BLOCK:
        values[:BLOCK] = 0.0  # an all-zero block stays zero (scale 0)

    def quantize(block):
        scale = block.abs().max() / codec.levels
        if scale == 0:
            return torch.zeros_like(block)
        return (block / scale).round().clamp(-codec.levels, codec.levels) * scale

    got = roundtrip(values, codec)
    torch.testing.assert_close(got, per_block(values, quantize), rtol=1e-6, atol=1e-7)
    step = per_block(values, lambda b: b.abs().max().expand_as(b) / codec.levels)
    assert ((got - values).abs() <= step / 2 + 1e-6).all()  # within half a level of the input


def test_message_sizes_payload_plus_one_fp32_scale_per_block():
    assert ONE_BIT.message_nbytes(8) == 4 + 4  # one scale, one sign byte padded to 4
    assert ONE_BIT.message_nbytes(BLOCK) == 4 + BLOCK // 8
    assert INT8.message_nbytes(BLOCK + 1) == 8 + 4 * -(-(BLOCK + 1) // 4)
    assert INT4.message_nbytes(3) == 4 + 4
    numel = 1 << 20
    for codec, bits in ((ONE_BIT, 1), (INT4, 4), (INT8, 8)):  # vs fp32: payload plus the scales
        assert codec.message_nbytes(numel) / (4 * numel) == pytest.approx(bits / 32 + 1 / BLOCK)


def test_error_feedback_keeps_exactly_what_was_dropped():
    gen = torch.Generator().manual_seed(0)
    error = torch.zeros(3000)
    sent_total, input_total = torch.zeros(3000), torch.zeros(3000)
    message = torch.empty(ONE_BIT.message_nbytes(3000), dtype=torch.uint8)
    for _ in range(20):
        values = torch.randn(3000, generator=gen)
        before = error.clone()
        compress_with_feedback(values, error, message)
        sent = ONE_BIT.decompress(message, 3000, torch.empty(3000))
        # this step: what was sent plus the new error is the input plus the old error
        torch.testing.assert_close(sent + error, values + before, rtol=0, atol=1e-6)
        sent_total += sent
        input_total += values
    # over all steps: nothing is lost, only delayed -- the sum sent plus the error left is the sum of the inputs
    torch.testing.assert_close(sent_total + error, input_total, rtol=0, atol=1e-4)
    assert error.abs().max() < 10  # bounded, it does not grow with the number of steps


def test_compression_of_a_16_bit_tensor_keeps_an_fp32_error():
    values = torch.randn(100).to(torch.bfloat16)
    error = torch.zeros(100)
    message = torch.empty(ONE_BIT.message_nbytes(100), dtype=torch.uint8)
    compress_with_feedback(values, error, message)
    sent = ONE_BIT.decompress(message, 100, torch.empty(100))
    torch.testing.assert_close(sent + error, values.float(), rtol=0, atol=1e-6)
