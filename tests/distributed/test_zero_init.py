"""zero.Init: a module's parameters keep what its ``__init__`` gave them (rank 0's values), put away as cheaply as
they can be (replayed, constant, sharded); parameters are created in the config's dtype; ``.cpu()`` is a no-op for
parameters without data; writes before ``initialize`` are errors outside a gather and kept inside one; a plain
process gets a process group, as under DeepSpeed."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from zeroshard.testing import run_distributed


class Halved(nn.Linear):
    """Writes to its parameters after reset_parameters(): no replay reproduces that."""

    def __init__(self):
        super().__init__(4, 4)
        self.weight.data.mul_(0.5)


class Custom(nn.Module):
    """What client modules do in ``__init__``: raw parameters, writes through ``.data`` and through a reference kept
    in a local, no reset_parameters(), layers built inside a ModuleList."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(5))
        self.noise = nn.Parameter(torch.randn(3, 5))
        shift = nn.Parameter(torch.empty(4))
        self.shift = shift
        shift.data.fill_(2.5)
        self.lin = nn.Linear(5, 3)
        self.halved = Halved()
        self.layers = nn.ModuleList(nn.Linear(3, 3) for _ in range(3))
        self.norm = nn.LayerNorm(3)

    def forward(self, x):
        x = self.lin(x * self.scale + self.noise.sum(0)) + self.shift[:3]
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class Router(nn.Module):
    """A MoE router as DeepSeek-V3's: a gate and a correction bias whose values (5.000 .. 5.015) lie closer together
    than bf16's steps there (0.031), so only an fp32 bias keeps them apart; with the gate at zero the bias alone
    picks the experts."""

    def __init__(self, experts: int = 16, width: int = 8):
        super().__init__()
        self.gate = nn.Linear(width, experts, bias=False)
        nn.init.zeros_(self.gate.weight)
        self.register_buffer("e_score_correction_bias", 5.0 + 0.001 * torch.arange(experts, dtype=torch.float32))
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))

    def forward(self, x):
        scores = torch.sigmoid(self.gate(x).float())
        return (scores + self.e_score_correction_bias).topk(2, dim=-1).indices


class MoEModel(nn.Module):
    _keep_in_fp32_modules_strict = ["e_score_correction_bias"]  # as transformers' DeepseekV3PreTrainedModel

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.mlp = Router()

    def forward(self, x):
        return self.mlp(self.embed(x))


FP32_BUFFER_CASES = {
    "auto": {},
    "buffer_bf16": {"buffer_dtype": "bf16"},
    "nothing_kept": {"buffer_dtype": "bf16", "keep_in_fp32_modules": []},
    "pattern": {"buffer_dtype": "bf16", "keep_in_fp32_modules": ["mlp.e_score*"]},
}


def fp32_buffer_cases() -> dict:
    """MoEModel built under zero.Init with bf16 at stage 3, then initialized with each data_types block."""
    import zeroshard
    from zeroshard.zero import Init

    out = {}
    for name, data_types in FP32_BUFFER_CASES.items():
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "optimizer": {"type": "AdamW"},
            "data_types": data_types,
        }
        with Init(config_dict_or_path=config):
            model = MoEModel()
        engine, *_ = zeroshard.initialize(model=model, config=config)
        router = engine.module.mlp
        with torch.no_grad():
            chosen = engine(torch.randn(1, 8)).tolist()
        bias, inv_freq = router.e_score_correction_bias, router.inv_freq
        out[name] = {
            "bias": (str(bias.dtype), bias.float().tolist()),
            "inv_freq": str(inv_freq.dtype),
            "chosen": chosen,
        }
        engine.destroy()
    try:
        zeroshard.initialize(model=MoEModel(), config={**config, "data_types": {"param_dtype": "fp16"}})
    except ValueError as err:
        out["param_dtype"] = str(err)
    return out


def _kinds(model: nn.Module) -> dict[str, str]:
    from zeroshard.zero.materialize import pending_recipe as _pending

    return {n: type(_pending(p).initial).__name__ for n, p in model.named_parameters()}


def init_semantics_worker() -> dict:
    import zeroshard
    from zeroshard import comm
    from zeroshard.zero import GatheredParameters, Init, ShardedParameterError
    from zeroshard.zero.materialize import Materializer
    from zeroshard.zero.materialize import pending_recipe as _pending

    rank = comm.get_rank()
    torch.manual_seed(0)
    expected = {n: p.detach().clone() for n, p in Custom().named_parameters()}
    torch.manual_seed(0 if rank == 0 else 101)  # ranks differ: every rank must end with rank 0's values
    with Init(seed=3):
        model = Custom()
    kinds = _kinds(model)
    pieces = {n: _pending(p).initial.piece.numel() for n, p in model.named_parameters() if kinds[n] == "Sharded"}

    # before initialize: metadata answers, writes outside a gather are refused by name, .cpu() is a no-op
    assert model.lin.weight.shape == (3, 5) and model.lin.weight.ds_numel == 15
    assert list(model.state_dict())[:3] == ["scale", "noise", "shift"]
    with pytest.raises(ShardedParameterError, match=r"'Linear\.weight' \(3, 5\) was built under zero.Init"):
        with torch.no_grad():
            model.lin.weight.copy_(torch.ones(3, 5))
    with pytest.raises(ShardedParameterError):
        model.norm.bias.data.fill_(1.0)
    model.cpu()
    model.to("cpu")
    assert model.lin.weight.is_meta

    # HF passes a set: every rank gathers in creation order
    params = [model.norm.bias, model.scale, model.lin.weight]
    assert GatheredParameters(set(params)).params == [model.scale, model.lin.weight, model.norm.bias]

    with GatheredParameters([model.layers[1].weight], modifier_rank=0):  # a load: rank 0's write is kept
        with torch.no_grad():
            model.layers[1].weight.copy_(torch.arange(9.0).view(3, 3) * (rank + 1))
    expected["layers.1.weight"] = torch.arange(9.0).view(3, 3)
    # no rank keeps a gathered value after the context: a written one as its slice, the others as they were
    put_back = [p.is_meta for p in model.parameters()]
    loaded = {n: k for n, k in _kinds(model).items() if k != kinds[n]}
    loaded_piece = _pending(model.layers[1].weight).initial.piece.numel()
    with GatheredParameters(list(model.parameters())):
        got = {n: p.detach().clone() for n, p in model.named_parameters()}
    mismatched = [n for n in expected if not torch.equal(got[n], expected[n])]
    assert _kinds(model) == {**kinds, **loaded} and all(p.is_meta for p in model.parameters())

    # param_init_fn runs after construction, as a parent's self.apply(init) would have, but not on a loaded value
    with Init(param_init_fn=lambda m: nn.init.ones_(m.weight) if isinstance(m, nn.Linear) else None):
        initialized = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.LayerNorm(3))
    with GatheredParameters([initialized[1].weight], modifier_rank=0):
        with torch.no_grad():
            initialized[1].weight.fill_(2.0)
    with GatheredParameters(list(initialized.parameters())):
        assert torch.equal(initialized[0].weight.detach(), torch.ones(3, 3))
        assert torch.equal(initialized[1].weight.detach(), torch.full((3, 3), 2.0))

    # dtype from the config's half precision, as DeepSpeed; an explicit dtype wins
    dtypes = []
    for block, dtype in (("bf16", None), ("fp16", None), ("bf16", torch.float32)):
        config = {"zero_optimization": {"stage": 3}, block: {"enabled": True}}
        with Init(config_dict_or_path=config, dtype=dtype):
            half = Custom()
        dtypes.append({str(p.dtype) for p in half.parameters()})

    # initialize materializes on its mesh: the gathers of the ranks' pieces count in the mesh's ledger
    with Init():
        sharded = Custom()
    mesh = comm.build_mesh(comm.ParallelDims.for_world(comm.get_world_size()))
    Materializer(sharded, torch.device("cpu"), 0, world=mesh.world)([sharded.noise])
    mesh_gathers = {(op, g): (t.calls, t.bytes) for (op, g), t in mesh.context.ledger.summary().items()}
    comm.destroy_mesh(mesh)

    # trains after initialize, and .cpu() on the wrapped module is still a no-op for its shards
    torch.manual_seed(0)
    with Init():
        model = Custom()
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}, "optimizer": {"type": "SGD"}}
    engine, *_ = zeroshard.initialize(model=model, config=config)
    engine.module.cpu()
    losses = []
    for _ in range(2):
        loss = engine(torch.ones(2, 5)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {
        "kinds": kinds,
        "pieces": pieces,
        "mismatched": mismatched,
        "dtypes": dtypes,
        "losses": losses,
        "put_back": put_back,
        "loaded": loaded,
        "loaded_piece": loaded_piece,
        "fp32_buffers": fp32_buffer_cases(),
        "mesh_gathers": mesh_gathers,
    }


@pytest.fixture(scope="module")
def per_rank():
    return run_distributed(init_semantics_worker, 2)


def test_init_keeps_what_init_wrote_in_the_config_dtype_with_rank0_values(per_rank):
    for result in per_rank:
        assert result["mismatched"] == []
        kinds = result["kinds"]
        assert kinds["scale"] == kinds["shift"] == "Constant"
        assert kinds["noise"] == kinds["halved.weight"] == "Sharded"
        assert {kinds[n] for n in ("lin.weight", "lin.bias", "layers.2.weight", "norm.weight")} == {"Replayed"}
        assert result["dtypes"] == [{"torch.bfloat16"}, {"torch.float16"}, {"torch.float32"}]
        assert all(torch.isfinite(torch.tensor(result["losses"])))
        # after a gather before initialize nothing stays whole; the written weight is kept as each rank's slice
        assert all(result["put_back"]) and result["loaded"] == {"layers.1.weight": "Loaded"}
    # each rank keeps half of a sharded value: 15 elements -> 8 + 7; a loaded one too: 9 -> 5 + 4
    assert [r["pieces"]["noise"] for r in per_rank] == [8, 7]
    assert [r["loaded_piece"] for r in per_rank] == [5, 4]
    assert per_rank[0]["losses"] == per_rank[1]["losses"]
    # the 15-element sharded value, gathered as 2 pieces of 8 fp32 elements on the mesh's world group
    assert all(r["mesh_gathers"] == {("all_gather", "world"): (1, 64)} for r in per_rank), per_rank[0]["mesh_gathers"]


def test_buffers_a_model_names_for_fp32_stay_fp32_under_zero_init_with_bf16(per_rank):
    """DeepSeek-V3's router bias under zero.Init with bf16 (DeepSpeed 0.19.8's data_types.keep_in_fp32_modules)."""
    exact = [5.0 + 0.001 * i for i in range(16)]
    for result in per_rank:
        cases = result["fp32_buffers"]
        assert cases["auto"]["bias"][0] == "torch.float32" and cases["auto"]["bias"][1] == pytest.approx(
            exact, abs=1e-6
        )
        assert cases["auto"]["chosen"] == [[15, 14]]  # the two largest biases: the route fp32 gives
        assert cases["auto"]["inv_freq"] == "torch.float32"  # buffers keep their dtype unless buffer_dtype is set
        assert (
            cases["buffer_bf16"]["bias"][0] == "torch.float32" and cases["buffer_bf16"]["inv_freq"] == "torch.bfloat16"
        )
        assert cases["pattern"]["bias"][0] == "torch.float32" and cases["pattern"]["chosen"] == [[15, 14]]
        assert cases["nothing_kept"]["bias"][0] == "torch.bfloat16"
        assert len(set(cases["nothing_kept"]["bias"][1])) < 4  # bf16 merges 16 experts' biases into a few values
        assert "data_types.param_dtype 'fp16' conflicts with the precision" in result["fp32_buffers"]["param_dtype"]


PLAIN_PROCESS = """
import torch, torch.nn as nn
from zeroshard.compat import deepspeed
with deepspeed.zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}):
    model = nn.Linear(4, 4)
print(torch.distributed.get_rank(), torch.distributed.get_world_size(), model.weight.dtype)
"""


def test_init_in_a_plain_process_creates_the_process_group():
    """transformers' ZeRO-3 from_pretrained asks torch.distributed.get_rank() right after zero.Init."""
    launcher_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher_vars}
    out = subprocess.run([sys.executable, "-c", PLAIN_PROCESS], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "1", "torch.bfloat16"]
