"""``engine.train_batch(data_iter)`` on the ZeRO engine (DeepSpeed's pipeline-engine call): the same step, bit for
bit, as the loop a user writes against the engine (forward, backward, step per micro-batch) at stages 0-3 and 1 or 4
micro-batches, the mean loss over micro-batches and ranks returned on every rank; and its hostile inputs, each a
named error on every rank with the engine left as it was: data that ends at a batch boundary (a ``StopIteration``),
data that ends early on one rank, a step begun with ``forward``/``backward``, micro-batches the model cannot take,
a model that returns no loss, no data at all."""

import dataclasses
import math
import re

import pytest
import torch

from zeroshard.testing import run_distributed
from zeroshard.testing.parity import ParityCase, make_batches, make_model

MICRO = 2
CASES = [(stage, gas) for stage in (0, 1, 2, 3) for gas in (1, 4)]


def _case(stage: int, gas: int) -> ParityCase:
    units = (("gather_unit_classes", ["Block"]), ("stage3_param_persistence_threshold", 0)) if stage == 3 else ()
    return ParityCase(stage, "fp32", gas=gas, micro_batch=MICRO, lr=1e-3, clip=0.05, steps=2, zero=units)


def _engine(case: ParityCase):
    import zeroshard

    engine, *_ = zeroshard.initialize(model=make_model(), config=case.config())
    return engine


def _micro_batches(case: ParityCase, steps: int) -> list:
    """This rank's micro-batches, in order, for ``steps`` steps."""
    from zeroshard import comm

    rank, world, b = comm.get_rank(), comm.get_world_size(), case.micro_batch
    out = []
    for x, y in make_batches(steps, world * b * case.gas, vocab_size=case.model.vocab_size):
        for k in range(case.gas):
            rows = slice((k * world + rank) * b, (k * world + rank + 1) * b)
            out.append((x[rows], y[rows]))
    return out


def _weights(engine) -> dict:
    return {k: v.clone() for k, v in engine.consolidated_state_dict(rank0_only=False).items()}


def _error(call) -> str:
    try:
        call()
    except Exception as error:  # noqa: BLE001 -- the class, message and notes are what the test compares
        notes = " ".join(getattr(error, "__notes__", []))
        return f"{type(error).__name__}|{isinstance(error, StopIteration)}|{error}|{notes}"
    return "no error"


def worker() -> dict:
    from zeroshard import comm

    result = {"parity": {}, "errors": {}}
    for stage, gas in CASES:
        case = _case(stage, gas)
        batches = _micro_batches(case, case.steps)
        loop, losses = _engine(case), []
        for x, y in batches:
            loss = loop(x, y)
            loop.backward(loss)
            loop.step()
            losses.append(loss.detach())
        batched, returned = _engine(case), []
        data = iter(batches)
        for _ in range(case.steps):
            returned.append(batched.train_batch(data))
        expected = []
        for step in range(case.steps):
            mean = torch.stack(losses[step * gas : (step + 1) * gas]).sum() / gas
            comm.all_reduce(mean, loop.mesh.batch)
            expected.append(mean / comm.get_world_size())
        a, b = _weights(loop), _weights(batched)
        result["parity"][(stage, gas)] = {
            "weights_equal": all(torch.equal(a[k], b[k]) for k in a),
            "losses": [(float(r), float(e)) for r, e in zip(returned, expected)],
            "steps": (loop.global_steps, batched.global_steps, loop.micro_steps, batched.micro_steps),
        }
        loop.destroy()
        batched.destroy()

    case = _case(3, 2)
    engine = _engine(case)
    batches = _micro_batches(case, 2)
    before = _weights(engine)
    errors = result["errors"]
    errors["boundary"] = _error(lambda: engine.train_batch(iter([])))
    mine = batches[:2] if comm.get_rank() == 0 else batches[:1]  # rank 1's data ends after one micro-batch
    errors["one_rank_short"] = _error(lambda: engine.train_batch(iter(mine)))
    x, y = batches[0]
    too_long = torch.randint(0, case.model.vocab_size, (MICRO, case.model.block_size * 2))
    errors["shape"] = _error(lambda: engine.train_batch(iter([batches[0], (too_long, too_long)])))
    errors["no_loss"] = _error(lambda: engine.train_batch(iter([(x,), (x,)])))
    errors["no_data"] = _error(lambda: engine.train_batch())
    result["unchanged"] = all(torch.equal(before[k], v) for k, v in _weights(engine).items())
    result["counts_after_errors"] = (engine.global_steps, engine.micro_steps)
    engine.backward(engine(x, y))  # a step begun by hand
    errors["mixed"] = _error(lambda: engine.train_batch(iter(batches)))
    engine.step()  # ... and finished by hand
    engine.backward(engine(*batches[1]))
    engine.step()
    # the engine goes on: a whole batch as a dict of keyword arguments
    dict_batches = [{"idx": x, "targets": y} for x, y in batches[2:4]]
    result["dict_loss"] = float(engine.train_batch(iter(dict_batches)))
    result["counts_after"] = (engine.global_steps, engine.micro_steps)
    engine.destroy()

    # the same refusals with layer_major: a micro-batch fails inside its fiber, the others are ended
    case = dataclasses.replace(case, zero=case.zero + (("layer_major", True),))
    engine = _engine(case)
    before = _weights(engine)
    layer = result["layer_major"] = {}
    layer["shape"] = _error(lambda: engine.train_batch(iter([batches[0], (too_long, too_long)])))
    layer["no_loss"] = _error(lambda: engine.train_batch(iter([(x,), (x,)])))
    layer["short"] = _error(lambda: engine.train_batch(iter(mine)))
    layer["unchanged"] = all(torch.equal(before[k], v) for k, v in _weights(engine).items())
    layer["counts_after_errors"] = (engine.global_steps, engine.micro_steps)
    engine.backward(engine(x, y))
    layer["mixed"] = _error(lambda: engine.train_batch(iter(batches)))
    engine.step()
    engine.backward(engine(*batches[1]))
    engine.step()
    layer["loss"] = float(engine.train_batch(iter(batches[2:4])))
    layer["counts_after"] = (engine.global_steps, engine.micro_steps)
    engine.destroy()
    result["fit"] = _activations_that_do_not_fit()
    return result


class Widening(torch.nn.Module):
    """A loss whose activations grow with an input's shape: ``widen`` is a stride-0 view of one float, so a 4-byte
    micro-batch makes forward save ``widen.numel()`` floats (``exp`` keeps its result). ``masked``: a forward that
    reads values (boolean indexing), which meta tensors cannot trace."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x, widen, masked=False):
        loss = self.linear(x).pow(2).mean() + (widen * self.linear.weight[0, 0]).exp().mean()
        return loss + self.linear(x)[x > 0].sum() if masked else loss


HUGE = 2**34  # floats: 64 GiB per micro-batch (were the check to fail, the allocation would fail, not swap)


def _activations_that_do_not_fit() -> dict:
    """A layer-major step whose micro-batches keep more activations than a rank can allocate: refused on every rank
    before anything runs (rank 1's alone, then both), the bytes named; the engine then trains on micro-batches that
    fit; a forward meta tensors cannot trace is warned about once and trains unmeasured."""
    import warnings

    import zeroshard
    from zeroshard import comm

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "layer_major": True},
    }
    engine, *_ = zeroshard.initialize(model=Widening(), config=config)
    before = _weights(engine)
    x = torch.randn(2, 16)

    def batch(width: int, masked: bool = False) -> tuple:
        return (x, torch.zeros(()).expand(width), masked)

    out = {}
    rank_1_huge = batch(HUGE if comm.get_rank() == 1 else 16)
    out["rank 1"] = _error(lambda: engine.train_batch(iter([rank_1_huge, rank_1_huge])))
    out["both"] = _error(lambda: engine.train_batch(iter([batch(16), batch(HUGE)])))
    out["unchanged"] = all(torch.equal(before[k], v) for k, v in _weights(engine).items())
    out["counts_after_errors"] = (engine.global_steps, engine.micro_steps)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["fits"] = float(engine.train_batch(iter([batch(16), batch(64)])))
        out["fits warnings"] = [str(w.message) for w in caught]
        caught.clear()
        out["masked"] = float(engine.train_batch(iter([batch(16, True), batch(16, True)])))
        out["masked warnings"] = [str(w.message) for w in caught]
    out["counts_after"] = (engine.global_steps, engine.micro_steps)
    engine.destroy()
    predicted = zeroshard.estimate(Widening, config, 2, sample_inputs=batch(HUGE))
    out["predicted activations"] = predicted.bytes["activations"]["device"]
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(worker, 2)


@pytest.mark.parametrize("stage,gas", CASES)
def test_train_batch_is_the_loop_a_user_writes(results, stage, gas):
    for rank in results:
        parity = rank["parity"][(stage, gas)]
        assert parity["weights_equal"], (stage, gas)
        for returned, expected in parity["losses"]:
            assert returned == expected, (stage, gas, parity["losses"])
        assert parity["steps"] == (2, 2, 2 * gas, 2 * gas)


def test_bad_batches_are_named_errors_on_every_rank_and_change_nothing(results):
    for rank, result in enumerate(results):
        errors = result["errors"]
        assert errors["boundary"].startswith("DataExhausted|True|") and "ended on every rank" in errors["boundary"]
        assert errors["one_rank_short"].startswith("DataExhausted|True|")
        assert "ended on ranks [1]" in errors["one_rank_short"] and "{1: 1}" in errors["one_rank_short"]
        assert errors["mixed"].startswith("TrainBatchError|False|") and "a backward without its step()" in errors[
            "mixed"]  # fmt: skip
        assert "micro-batch 2 of 2" in errors["shape"] and "the batch was not applied" in errors["shape"], errors[
            "shape"]  # fmt: skip
        assert errors["no_loss"].startswith("TrainBatchError|False|") and "returned a tensor of shape" in errors[
            "no_loss"]  # fmt: skip
        assert errors["no_data"].startswith("TrainBatchError|False|") and "has no data" in errors["no_data"]
        assert result["unchanged"], rank
        assert result["counts_after_errors"] == (0, 0)
        assert result["counts_after"] == (2, 4) and result["dict_loss"] > 0
        layer = result["layer_major"]
        assert "micro-batch 2 of 2" in layer["shape"] and "the batch was not applied" in layer["shape"], layer
        assert layer["no_loss"].startswith("TrainBatchError|False|") and "returned a tensor of shape" in layer[
            "no_loss"]  # fmt: skip
        assert layer["short"].startswith("DataExhausted|True|") and "ended on ranks [1]" in layer["short"]
        assert layer["mixed"].startswith("TrainBatchError|False|")
        assert layer["unchanged"] and layer["counts_after_errors"] == (0, 0)
        assert layer["counts_after"] == (2, 4) and layer["loss"] > 0


def test_a_layer_major_step_that_does_not_fit_is_refused_before_it_runs(results):
    """Measured on meta tensors before the step: the step's bytes named for the rank they do not fit on, on every
    rank, as a ``StepDoesNotFit`` (a ``MemoryError`` too); the activations named are ``zeroshard estimate``'s for
    the same micro-batches; the engine as it was, and training on afterwards."""
    from zeroshard.runtime.micro_batches import StepDoesNotFit

    assert issubclass(StepDoesNotFit, MemoryError)
    for result in results:
        fit = result["fit"]
        for case in ("rank 1", "both"):
            assert fit[case].startswith("StepDoesNotFit|False|"), fit[case]
            assert "keeps the activations of the step's 2 micro-batches" in fit[case] and "Nothing ran" in fit[case]
            assert "activation checkpointing" in fit[case] and "layer_major to false" in fit[case]
        assert "rank 1 needs " in fit["rank 1"] and "rank 0 needs" not in fit["rank 1"], fit["rank 1"]
        assert "rank 0 needs " in fit["both"] and "rank 1 needs " in fit["both"]
        gib = re.search(r"rank 1 needs ([0-9.]+) GiB and can allocate ([0-9.]+) GiB", fit["rank 1"])
        assert float(gib.group(1)) >= 2 * 2 * HUGE * 4 / 2**30 > float(gib.group(2)), fit["rank 1"]  # saved + working
        assert fit["unchanged"] and fit["counts_after_errors"] == (0, 0)
        assert fit["fits"] > 0 and not fit["fits warnings"], fit["fits warnings"]
        assert math.isfinite(fit["masked"])
        assert any("could not be measured on meta tensors" in w for w in fit["masked warnings"]), fit["masked warnings"]
        assert fit["counts_after"] == (2, 4)
    rank_1 = results[1]["fit"]
    here = re.search(r"here: ([0-9.]+) GiB of activations for 2 micro-batches", rank_1["rank 1"])
    assert here and float(here.group(1)) == round(rank_1["predicted activations"] / 2**30, 2), rank_1["rank 1"]


# Note [layer-major]: each case trains 2 steps with the micro-batch loop and with layer_major, from the same data
SWAP = "/tmp"
NVME = (
    ("offload_optimizer", {"device": "nvme", "nvme_path": SWAP}),
    ("offload_param", {"device": "nvme", "nvme_path": SWAP, "max_in_cpu": 0}),
)
LAYER_MAJOR = {  # name: (gas, dtype, zero keys, how the model is built)
    "gas 1": (1, "fp32", (), "gpt"),
    "gas 2": (2, "fp32", (), "gpt"),
    "gas 8": (8, "fp32", (), "gpt"),
    "nvme, gas 1": (1, "fp32", NVME, "gpt"),
    "nvme, gas 8": (8, "fp32", NVME, "gpt"),
    "bf16, gas 4": (4, "bf16", (), "gpt"),
    "activation checkpointing, gas 4": (4, "fp32", (), "recomputed"),
    "a unit run twice, gas 4": (4, "fp32", (), "repeated"),
    "frozen base (LoRA), gas 4": (4, "fp32", (), "frozen"),
    "reuse distance, gas 4": (4, "fp32", (("stage3_max_reuse_distance", 10**9),), "gpt"),
    "bf16 autocast around the blocks, gas 4": (4, "fp32", (), "autocast"),
}
UNITS = 3  # the GPT's gather units: the root (embeddings, final norm, tied head) and its 2 blocks
FROZEN = ("wte.weight", "wpe.weight", "blocks.0.qkv.weight", "blocks.0.fc.weight", "blocks.1.qkv.weight")


def _layer_major_model(kind: str):
    import dataclasses

    from zeroshard.testing.models import recompute_blocks
    from zeroshard.testing.parity import MODEL

    if kind == "repeated":
        return make_model(model=dataclasses.replace(MODEL, repeat_first_block=True))
    if kind == "frozen":
        return make_model(frozen=FROZEN)
    if kind == "autocast":
        return Autocast(make_model())
    model = make_model()
    return recompute_blocks(model) if kind == "recomputed" else model


class Autocast(torch.nn.Module):
    """A model whose forward runs its blocks under ``torch.autocast``: each fiber's autocast state is its own."""

    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt

    def forward(self, idx, targets):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.gpt(idx, targets)


def _watch_autocast(model) -> list:
    """Whether autocast is on at the end of each block's forward, in order (appended to the list returned); not in
    the forward on meta tensors that measures a layer-major step's activations first."""
    seen: list = []

    def hook(module, args, out):
        if not out.is_meta:
            seen.append(torch.is_autocast_enabled("cpu"))

    for block in model.gpt.blocks:
        block.register_forward_hook(hook)
    return seen


def layer_major_worker(names: list) -> dict:
    import warnings

    import zeroshard

    out = {}
    for name in names:
        gas, dtype, zero, kind = LAYER_MAJOR[name]
        units = (("gather_unit_classes", ["Block"]), ("stage3_param_persistence_threshold", 0))
        runs = {}
        for layer_major in (False, True):
            case = ParityCase(3, dtype, gas=gas, micro_batch=MICRO, lr=1e-3, clip=0.05, steps=2,
                              zero=units + zero + (("layer_major", layer_major),))  # fmt: skip
            engine, *_ = zeroshard.initialize(model=_layer_major_model(kind), config=case.config())
            seen = _watch_autocast(engine.module) if kind == "autocast" else []
            data, losses = iter(_micro_batches(case, 2)), []
            with warnings.catch_warnings(record=True) as caught:  # the step measured before it runs (no warning)
                warnings.simplefilter("always")
                for _ in range(2):
                    engine.comm_ledger.reset()
                    read_before = engine.disk_io()["read"]
                    losses.append(float(engine.train_batch(data)))
                    seen.append(torch.is_autocast_enabled("cpu"))  # after the step: off, as before it
                    read = engine.disk_io()["read"] - read_before
            unmeasured = [str(w.message) for w in caught if "could not be measured" in str(w.message)]
            summary = engine.comm_ledger.summary().items()
            ledger = {op: (t.calls, t.bytes) for (op, group), t in summary if group == "shard"}
            runs[layer_major] = {"weights": _weights(engine), "losses": losses, "ledger": ledger, "read": read,
                                 "unmeasured": unmeasured, "autocast": seen}  # fmt: skip
            engine.destroy()
        a, b = runs[False]["weights"], runs[True]["weights"]
        diff = sum(((a[k].float() - b[k].float()).norm() ** 2).item() for k in a) ** 0.5
        norm = sum((a[k].float().norm() ** 2).item() for k in a) ** 0.5
        out[name] = {
            "relative": diff / norm,
            "bitwise": all(torch.equal(a[k], b[k]) for k in a),
            "losses": (runs[False]["losses"], runs[True]["losses"]),
            "ledger": (runs[False]["ledger"], runs[True]["ledger"]),
            "read": (runs[False]["read"], runs[True]["read"]),
            "unmeasured": runs[True]["unmeasured"],
            "autocast": (runs[False]["autocast"], runs[True]["autocast"]),
        }
    return out


@pytest.fixture(scope="module")
def layer_major():
    return run_distributed(layer_major_worker, 2, list(LAYER_MAJOR))


def test_layer_major_equals_the_micro_batch_loop(layer_major):
    """The same weights within fp32 rounding (1e-6 relative; bit for bit with one micro-batch, where nothing is
    summed in another order), the same losses, in every case: tied embeddings (the GPT's), NVMe offload, bf16,
    activation checkpointing, a unit the forward runs twice, frozen parameters; clipping clips in each (0.05)."""
    for rank in layer_major:
        for name, result in rank.items():
            tolerance = 1e-2 if name.startswith("bf16") else 1e-6  # bf16 rounds each sum to 8 bits
            assert result["relative"] <= tolerance, (name, result["relative"])
            assert result["bitwise"] or not name.endswith("gas 1"), name
            assert not result["unmeasured"], (name, result["unmeasured"])
            assert result["autocast"][0] == result["autocast"][1], (name, result["autocast"])
            for loop, major in zip(*result["losses"]):
                assert abs(loop - major) <= 1e-5 * abs(loop) or name.startswith("bf16"), (name, result["losses"])


def test_layer_major_gathers_reduces_and_reads_once_per_step(layer_major):
    """Per step, layer-major gathers and reduce-scatters each unit as often as one micro-batch does (the ledger),
    and reads the NVMe shards once: the micro-batch loop does it once per micro-batch. With
    ``stage3_max_reuse_distance`` covering the model, each unit is gathered once per step in all."""
    for rank in layer_major:
        for gas, name in ((2, "gas 2"), (8, "gas 8"), (8, "nvme, gas 8"), (4, "a unit run twice, gas 4"),
                          (4, "reuse distance, gas 4")):  # fmt: skip
            loop, major = rank[name]["ledger"]
            for op in ("all_gather", "reduce_scatter"):
                assert loop[op] == (gas * major[op][0], gas * major[op][1]), (name, op, loop[op], major[op])
        # with a reuse distance that keeps every unit from its forward to its backward: one gather per unit per step
        assert rank["reuse distance, gas 4"]["ledger"][1]["all_gather"][0] == UNITS
        assert rank["gas 2"]["ledger"][1]["all_gather"][0] > UNITS  # without it, gathered again in backward
        one, eight = rank["nvme, gas 1"], rank["nvme, gas 8"]
        assert eight["ledger"][1] == one["ledger"][1]
        assert eight["read"][1] == one["read"][1] < eight["read"][0], (one["read"], eight["read"])
