"""``deepspeed.accelerator.get_accelerator()``: every public name of DeepSpeed's accelerator interface, taken from its
source (``tests/fixtures/deepspeed_accelerator/names.json``, written by ``make.py`` beside it), exists on zeroshard's
for CPU and CUDA and takes DeepSpeed's arguments; on CPU each does what DeepSpeed's CPU accelerator does, or refuses by
name where that answer would be silently wrong (graph capture)."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch

from zeroshard.compat.deepspeed.accelerator import DeepSpeedAccelerator, GraphCaptureUnavailable, get_accelerator

FIXTURE = json.loads(
    (Path(__file__).resolve().parents[2] / "fixtures" / "deepspeed_accelerator" / "names.json").read_text()
)
NAMES = FIXTURE["names"]
KINDS = [DeepSpeedAccelerator("cpu", "gloo"), DeepSpeedAccelerator("cuda", "nccl")]


def test_the_fixture_is_deepspeeds_whole_interface():
    assert FIXTURE["deepspeed"] == "0.19.8" and len(NAMES) >= 67
    for name in ("random", "Stream", "pin_memory", "create_graph", "FloatTensor", "get_op_builder", "range_push"):
        assert name in NAMES


@pytest.mark.parametrize("accelerator", KINDS, ids=lambda a: a.name)
@pytest.mark.parametrize("name", sorted(NAMES))
def test_every_name_takes_deepspeeds_arguments(accelerator, name):
    record = NAMES[name]
    attribute = inspect.getattr_static(accelerator, name)  # no property runs: CUDA's need a GPU
    if record["kind"] in ("property", "attribute"):
        assert attribute is not None
        return
    signature = inspect.signature(getattr(accelerator, name))
    accepted = signature.parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in accepted.values())
    for parameter in record["parameters"]:
        assert parameter in accepted or takes_any, f"{name}() lacks DeepSpeed's parameter {parameter!r}"
    if record["varargs"]:
        assert any(p.kind is p.VAR_POSITIONAL for p in accepted.values())


def test_one_accelerator_per_process_remembers_its_compile_backend():
    accelerator = get_accelerator()
    assert accelerator is get_accelerator() and accelerator.get_compile_backend() == "inductor"
    try:
        accelerator.set_compile_backend("aot_eager")
        assert get_accelerator().get_compile_backend() == "aot_eager" == get_accelerator()._compile_backend
        with pytest.raises(ValueError, match="no_such_backend not supported by cpu"):
            accelerator.set_compile_backend("no_such_backend")
    finally:
        accelerator.set_compile_backend("inductor")


def test_rng_names_drive_torchs_generator():
    accelerator = get_accelerator()
    assert accelerator.random().manual_seed is torch.random.manual_seed
    assert accelerator.default_generator(0) is torch.default_generator
    accelerator.manual_seed_all(7)
    assert accelerator.initial_seed() == 7
    state = accelerator.get_rng_state()
    first = torch.rand(3)
    accelerator.set_rng_state(state)
    assert torch.equal(torch.rand(3), first)
    with accelerator.random().fork_rng():
        torch.rand(5)
    accelerator.set_rng_state(state)
    torch.rand(3)
    expected = torch.rand(2)
    accelerator.set_rng_state(state)
    torch.rand(3)
    # DeepSpeed's train_cifar: fork_rng(devices=[current_device_name()], device_type=device_name()); torch's own
    # fork_rng fails on CPU (torch.cpu has no get_rng_state), with DeepSpeed's CPU accelerator too
    with accelerator.random().fork_rng(
        devices=[accelerator.current_device_name()], device_type=accelerator.device_name()
    ):
        torch.manual_seed(123)
        torch.rand(4)
    assert torch.equal(torch.rand(2), expected)  # the fork restored the generator


def test_streams_and_events_run_in_order_on_cpu():
    accelerator = get_accelerator()
    side = accelerator.Stream()
    with accelerator.stream(side):
        value = torch.ones(2) * 3
    side.wait_stream(accelerator.current_stream())
    event = accelerator.Event()
    event.record()
    event.synchronize()
    assert event.query() and value.sum().item() == 6.0
    assert accelerator.default_stream() is not None and accelerator.is_current_stream_capturing() is False
    accelerator.synchronize()
    accelerator.synchronize(0)


def test_memory_names_report_the_process_on_cpu():
    accelerator = get_accelerator()
    assert accelerator.total_memory() >= accelerator.available_memory() > 0
    stats = accelerator.memory_stats()
    assert stats["allocated_bytes.all.peak"] >= stats["allocated_bytes.all.current"] > 0
    for name in ("memory_allocated", "memory_reserved", "memory_cached", "max_memory_allocated", "max_memory_cached"):
        assert getattr(accelerator, name)() > 0
    block = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB resident
    peak_with_block = accelerator.max_memory_allocated()
    del block
    accelerator.reset_peak_memory_stats()
    assert accelerator.max_memory_allocated() < peak_with_block  # the peak starts again from now
    accelerator.reset_max_memory_allocated()
    accelerator.reset_max_memory_cached()
    accelerator.empty_cache()


def test_host_memory_names_on_cpu():
    accelerator = get_accelerator()
    tensor = torch.arange(6.0).view(2, 3)
    assert accelerator.pin_memory(tensor) is tensor and not accelerator.is_pinned(tensor)  # nothing to pin for
    assert accelerator.pin_memory(tensor, make_copy=False).shape == (2, 3)
    assert accelerator.pin_memory(tensor, make_copy=False, match_shape=False).shape == (6,)
    assert accelerator.pin_empty(2, 4, dtype=torch.bfloat16).shape == (2, 4)
    assert accelerator.pin_empty((3,), dtype=torch.int8).dtype == torch.int8
    assert accelerator.pin_empty_like(tensor, dtype=torch.half).dtype == torch.half
    for bad in ("cuda", "meta", "no-such-device;rm -rf /"):
        with pytest.raises(ValueError, match="host memory lives on 'cpu'"):
            accelerator.pin_empty(2, dtype=torch.float, device=bad)
    assert accelerator.unpin_memory(tensor) is None and accelerator.register_host_memory(0, 8) is False
    assert accelerator.pin_memory_alignment() == 1 and accelerator.on_accelerator(tensor)


def test_typed_tensors_and_device_facts_on_cpu():
    accelerator = get_accelerator()
    assert accelerator.FloatTensor is torch.FloatTensor and accelerator.LongTensor([1, 2]).dtype == torch.long
    assert accelerator.BFloat16Tensor([1.5]).dtype == torch.bfloat16 and accelerator.ByteTensor(2).dtype == torch.uint8
    assert accelerator._name == "cpu" and accelerator._communication_backend_name == "gloo"
    assert accelerator.is_synchronized_device() and accelerator.use_host_timers()
    assert accelerator.resolves_data_dependency() and accelerator.handles_memory_backpressure()
    assert accelerator.is_fp64_supported() and not accelerator.is_triton_supported()
    assert not accelerator.prefer_triton_grouped_mm() and accelerator.supports_nvtx_domain is False
    assert accelerator.lazy_call(lambda: 5) == 5
    assert accelerator.visible_devices_envs() == ["CUDA_VISIBLE_DEVICES"] and accelerator.export_envs() == []
    env = {}
    accelerator.set_visible_devices_envs(env, [0, 2])
    assert env == {"CUDA_VISIBLE_DEVICES": "0,2"}
    accelerator.range_push("forward")
    accelerator.range_pop()
    assert accelerator.build_extension().__name__ == "BuildExtension"


def test_what_a_cpu_lacks_is_a_named_error():
    accelerator = get_accelerator()
    for call in (
        accelerator.create_graph,
        lambda: accelerator.capture_to_graph(None),
        lambda: accelerator.replay_graph(None),
    ):
        with pytest.raises(GraphCaptureUnavailable, match="graph capture needs CUDA"):
            call()
    assert issubclass(GraphCaptureUnavailable, NotImplementedError)
    for name in ("InferenceBuilder", "AsyncIOBuilder"):
        assert accelerator.get_op_builder(name).__name__ == name
        with pytest.raises(NotImplementedError, match=f"deepspeed.ops.op_builder.{name} is not implemented"):
            accelerator.create_op_builder(name)
    assert accelerator.op_builder_dir() == "deepspeed.ops.op_builder"
