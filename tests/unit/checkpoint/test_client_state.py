"""client_state round-trips through JSON plus tensors, whatever keys the user's dicts hold; tensors a safetensors
file cannot hold are refused naming their key."""

import pytest
import torch

from zeroshard.checkpoint.client_state import restore_client_state, split_client_state


def roundtrip(value):
    encoded, tensors = split_client_state(value)
    return restore_client_state(encoded, tensors)


def test_user_dicts_that_look_like_the_encoding_come_back_as_dicts():
    value = {
        "ref": {"__zeroshard_tensor__": "client.0"},  # once came back as the tensor client.0
        "escape": {"__zeroshard_dict__": {"__zeroshard_tensor__": "client.0"}},
        "both": [{"__zeroshard_tensor__": 1, "__zeroshard_dict__": 2, "x": torch.ones(1)}],
        "t": torch.tensor([3.0]),
    }
    back = roundtrip(value)
    assert back["ref"] == value["ref"] and back["escape"] == value["escape"]
    assert back["both"][0]["__zeroshard_tensor__"] == 1 and torch.equal(back["both"][0]["x"], torch.ones(1))
    assert torch.equal(back["t"], value["t"])


def test_checkpoints_written_before_the_escape_still_read():
    assert (
        restore_client_state({"a": {"__zeroshard_tensor__": "client.0"}}, {"client.0": torch.ones(2)})["a"].sum() == 2
    )


@pytest.mark.parametrize(
    "tensor, message",
    [
        (torch.ones(2, dtype=torch.complex64), "has dtype torch.complex64"),
        (torch.ones(2).to_sparse(), "is a torch.sparse_coo tensor"),
        (torch.empty(2, device="meta"), "is a tensor on the meta device"),
    ],
)
def test_unstorable_tensors_are_named_by_key(tensor, message):
    with pytest.raises(TypeError, match=r"client_state\['outer'\]\['inner'\]\[1\] " + message):
        split_client_state({"outer": {"inner": [0, tensor]}})
