"""The 1-bit message format against exact math: signs and block scales, sizes, and error feedback that keeps
exactly what the compression dropped."""

import pytest
import torch

from zeroshard.comm.compression import BLOCK, compress, compress_with_feedback, decompress, message_nbytes


def roundtrip(values: torch.Tensor) -> torch.Tensor:
    message = torch.empty(message_nbytes(values.numel()), dtype=torch.uint8)
    compress(values, message)
    return decompress(message, values.numel(), torch.empty(values.numel()))


@pytest.mark.parametrize("numel", [1, 7, 8, 9, BLOCK, BLOCK + 5, 3 * BLOCK - 1])
def test_decompresses_to_block_mean_absolute_value_times_sign(numel):
    values = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    values[0] = 0.0  # a zero counts as +1
    expected = torch.empty(numel)
    for start in range(0, numel, BLOCK):
        block = values[start : start + BLOCK]
        scale = block.abs().mean()
        expected[start : start + BLOCK] = torch.where(block >= 0, scale, -scale)
    torch.testing.assert_close(roundtrip(values), expected, rtol=1e-6, atol=0)


def test_message_is_signs_packed_eight_per_byte_plus_one_fp32_scale_per_block():
    assert message_nbytes(8) == 4 + 4  # one scale, one sign byte padded to 4
    assert message_nbytes(BLOCK) == 4 + BLOCK // 8
    assert message_nbytes(BLOCK + 1) == 8 + 4 * -(-(BLOCK // 8 + 1) // 4)
    numel = 1 << 20
    assert message_nbytes(numel) / (4 * numel) == pytest.approx(1 / 32 + 1 / BLOCK)  # vs fp32: signs plus scales


def test_error_feedback_keeps_exactly_what_was_dropped():
    gen = torch.Generator().manual_seed(0)
    error = torch.zeros(3000)
    sent_total, input_total = torch.zeros(3000), torch.zeros(3000)
    message = torch.empty(message_nbytes(3000), dtype=torch.uint8)
    for _ in range(20):
        values = torch.randn(3000, generator=gen)
        before = error.clone()
        compress_with_feedback(values, error, message)
        sent = decompress(message, 3000, torch.empty(3000))
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
    message = torch.empty(message_nbytes(100), dtype=torch.uint8)
    compress_with_feedback(values, error, message)
    sent = decompress(message, 100, torch.empty(100))
    torch.testing.assert_close(sent + error, values.float(), rtol=0, atol=1e-6)
