"""The client's path (issue 40): DeepSpeed's own tutorial and defaults, run as a client runs them, in compatibility
mode on 2 real ranks (one shared spawn).

- DeepSpeed's ALST tutorial loop (``docs/_tutorials/ulysses-alst-sequence-parallelism.md``), verbatim apart from
  the model (a tiny Llama built here instead of a hub download): ``move_to_device``, ``groups`` getters,
  ``UlyssesSPDataLoaderAdapter``, the weighted loss through ``torch.distributed.nn``; each sample's loss equals one
  process's loss on the whole sequence.
- A config without ``gradient_clipping`` clips at DeepSpeed's default 1.0 (equal to one process clipping at 1.0,
  unequal to one that does not clip).
- Accelerate's CPU-offload path for ``torch.optim.Adagrad``: ``DeepSpeedCPUAdagrad(optimizer.param_groups, ...)``
  under ``offload_optimizer`` equals torch's Adagrad in one process.
- ``deepspeed.sequence.layer.DistributedAttention`` (DeepSpeed's sequence-parallelism tutorial) equals attention
  on the whole sequence, forward and backward.
- ``deepspeed.comm.broadcast_object_list`` sends plain data as JSON; anything else is refused on every rank.
- Engine calls clients make: ``gradient_clipping()``, ``module_state_dict``, ``get_wall_clock_timers``,
  ``offload_states(include="optim_states")`` (one state named alone), ``compile`` with a bad backend or unknown
  options (refused at the call, not at the first forward), and expert parameters (``allreduce = False``) refused.
"""

from __future__ import annotations

import copy

import pytest
import torch

from zeroshard.testing import run_distributed
from zeroshard.testing.parity import ParityCase, make_batches, make_model, model_error, reference_train

CLIP_CASE = ParityCase(stage=2, clip=1.0, lr=1e-3)


def _alst_tutorial(tiny_llama) -> dict:
    """DeepSpeed's ALST tutorial as written; only ``from_pretrained(model_name_or_path)`` became ``tiny_llama``."""
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from deepspeed.runtime.utils import move_to_device
    from deepspeed.utils import groups
    from torch import tensor

    seq_length = 64
    sequence_parallel_size = 2
    micro_batch_size = 1

    config_dict = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {
            "stage": 3,
        },
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "sequence_parallel_size": sequence_parallel_size,
    }

    input_ids = tensor([[1, 10, 10, 10, 2, 2], [1, 20, 20, 20, 2, 2]])
    position_ids = tensor([[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]])
    ds = torch.utils.data.TensorDataset(input_ids, position_ids)

    def collate_fn(batch):
        input_ids, position_ids = batch[0]
        return dict(
            input_ids=input_ids.unsqueeze(0), position_ids=position_ids.unsqueeze(0), labels=input_ids.unsqueeze(0)
        )

    dist.init_distributed(dist_backend="nccl", dist_init_required=True)

    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=tiny_llama,
        core_attn_implementation="sdpa",
        sequence_parallel_size=sequence_parallel_size,
        micro_batch_size=micro_batch_size,
        seq_length=seq_length,
        seq_length_is_variable=True,
    )

    model = tiny_llama
    model, _, _, _ = deepspeed.initialize(config=config_dict, model=model, model_parameters=model.parameters(), mpu=mpu)

    sp_group = groups._get_sequence_parallel_group()
    sp_world_size = groups._get_sequence_parallel_world_size()
    sp_rank = groups._get_sequence_parallel_rank()
    dl = torch.utils.data.DataLoader(ds, batch_size=micro_batch_size, collate_fn=collate_fn)
    dl = UlyssesSPDataLoaderAdapter(dl, sp_rank=sp_rank, sp_group=sp_group, sp_world_size=sp_world_size,
                                    device=model.device)  # fmt: skip

    losses = []
    for iter, batch in enumerate(dl):  # noqa: B007 (the tutorial's loop, as written)
        batch = move_to_device(batch, model.device)

        outputs = model(**batch)
        shift_labels = batch["shift_labels"]
        loss = model.module.loss_function(
            logits=outputs.logits,
            labels=None,
            shift_labels=shift_labels,
            vocab_size=model.module.config.vocab_size,
        )

        losses_per_rank = torch.distributed.nn.functional.all_gather(loss, group=sp_group)
        good_tokens = (shift_labels != -100).view(-1).sum()
        good_tokens_per_rank = torch.distributed.nn.functional.all_gather(good_tokens, group=sp_group)
        total_loss = sum(losses_per_rank[rank] * good_tokens_per_rank[rank] for rank in range(sp_world_size))
        total_good_tokens = sum(good_tokens_per_rank)
        loss = total_loss / max(total_good_tokens, 1)

        losses.append(loss.item())
        model.backward(loss)
    model.destroy()
    return {"losses": losses}


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain softmax attention on Megatron's [sequence, batch, heads, head_dim] layout."""
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / q.shape[-1] ** 0.5
    return torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v)


def _distributed_attention(rank: int) -> dict:
    from deepspeed.sequence.layer import DistributedAttention

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(8, 2, 4, 3, generator=g) for _ in range(3))  # 8 tokens, 4 heads
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    _attention(*whole).square().sum().backward()
    mine = [t[rank * 4 : (rank + 1) * 4].clone().requires_grad_() for t in (q, k, v)]
    out = DistributedAttention(_attention, None)(*mine)
    out.square().sum().backward()  # each rank's share of the same loss
    wanted = _attention(q, k, v)[rank * 4 : (rank + 1) * 4]
    return {
        "forward": (out - wanted).abs().max().item(),
        "grads": max((m.grad - w.grad[rank * 4 : (rank + 1) * 4]).abs().max().item() for m, w in zip(mine, whole)),
    }


def _broadcast_objects(rank: int) -> dict:
    import deepspeed.comm as dist

    sent = [f"/runs/exp__{rank}", {"lr": 1e-3, "tags": ["a", "b"]}, None]
    dist.broadcast_object_list(sent, src=0)
    try:
        dist.broadcast_object_list([object() if rank == 0 else None], src=0)
        refused = "sent"
    except TypeError as err:
        refused = str(err)
    return {"received": sent, "refused": refused}


def _default_clipping() -> dict:
    import deepspeed

    config = CLIP_CASE.config()
    del config["gradient_clipping"]  # DeepSpeed's config as clients write it: the key absent
    engine, *_ = deepspeed.initialize(model=make_model(), config=config)
    rank, world, b = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size(), CLIP_CASE.micro_batch
    norms = []
    for x, y in make_batches(CLIP_CASE.steps, world * b):
        engine.backward(engine(x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b]))
        engine.step()
        norms.append(engine.get_global_grad_norm())
    out = {"clip": engine.gradient_clipping(), "norms": norms, "weights": engine.consolidated_state_dict(False)}
    engine.destroy()
    return out


def _cpu_adagrad_offload() -> dict:
    """Accelerate's map_pytorch_optim_to_deepspeed for torch.optim.Adagrad under offload_optimizer."""
    import deepspeed
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad

    model = make_model()
    client = torch.optim.Adagrad(model.parameters(), lr=1e-2)
    defaults = {k: v for k, v in client.defaults.items() if k in ["lr", "weight_decay"]}
    optimizer = DeepSpeedCPUAdagrad(client.param_groups, **defaults)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    for x, y in make_batches(3, world * 2):
        engine.backward(engine(x[rank * 2 : rank * 2 + 2], y[rank * 2 : rank * 2 + 2]))
        engine.step()
    weights = engine.consolidated_state_dict(False)
    engine.destroy()
    return {"weights": weights}


def _engine_calls() -> dict:
    import deepspeed

    out: dict = {}
    config = {**CLIP_CASE.config(), "wall_clock_breakdown": True}
    model = make_model()
    frozen = next(iter(model.parameters()))
    frozen.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    x, y = make_batches(1, 2)[0]
    engine.backward(engine(x, y))
    engine.step()
    state = set(engine.module_state_dict(exclude_frozen_parameters=True))
    named = dict(engine.module.named_parameters())
    out["module_state_dict"] = {n for n, p in named.items() if p.requires_grad} <= state and not {
        n for n, p in named.items() if not p.requires_grad
    } & state
    timers = engine.get_wall_clock_timers()
    out["timers"] = sorted(timers) if all(v >= 0 for v in timers.values()) else "negative"
    engine.offload_states(include="optim_states")  # one state named alone
    engine.reload_states()
    out["offload"] = "ok"
    for label, call in (
        ("backend", lambda: engine.compile(backend=5)),
        ("kwargs", lambda: engine.compile(compile_kwargs={"no_such_option": True})),
    ):
        try:
            call()
            out[label] = "accepted"
        except TypeError as err:
            out[label] = str(err)
    out["compiled"] = engine.is_compiled
    engine.destroy()
    expert = make_model()
    for p in expert.parameters():
        p.allreduce = False  # DeepSpeed's expert-parameter protocol
        break
    try:
        deepspeed.initialize(model=expert, config=config)
        out["experts"] = "accepted"
    except NotImplementedError as err:
        out["experts"] = str(err)
    return out


def client_worker() -> dict:
    import zeroshard
    from zeroshard.testing.hf import tiny_causal_lm

    zeroshard.install_as_deepspeed()
    rank = zeroshard.comm.get_rank()
    out = {
        "attention": _distributed_attention(rank),
        "broadcast": _broadcast_objects(rank),
        "clipping": _default_clipping(),
        "adagrad": _cpu_adagrad_offload(),
        "engine": _engine_calls(),
    }
    tiny = tiny_causal_lm("llama", num_attention_heads=4, num_key_value_heads=2)
    out["alst_reference"] = [  # before the tutorial, which routes every sdpa attention through Ulysses
        copy.deepcopy(tiny)(input_ids=ids[None], labels=ids[None]).loss.item()
        for ids in (torch.tensor([1, 10, 10, 10, 2, 2]), torch.tensor([1, 20, 20, 20, 2, 2]))
    ]
    out["alst"] = _alst_tutorial(tiny)  # last, for the same reason
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_distributed(client_worker, 2, timeout_s=400)


def test_deepspeeds_alst_tutorial_runs_as_written_and_matches_one_process(runs):
    for out in runs:
        losses, (first, second) = out["alst"]["losses"], out["alst_reference"]
        assert len(losses) == 4  # 2 samples x 2 sequence shards, as the tutorial prints
        assert losses[0] == losses[1] and losses[2] == losses[3]
        assert abs(losses[0] - first) <= 1e-5 * first  # the weights before any step: the whole sequence's loss
        assert abs(losses[2] - second) <= 1e-5 * second


def test_a_config_without_gradient_clipping_clips_at_deepspeeds_default(runs):
    clipped = reference_train(CLIP_CASE, 2)
    unclipped = reference_train(ParityCase(stage=2, clip=0.0, lr=CLIP_CASE.lr), 2)
    for out in runs:
        got = out["clipping"]
        assert got["clip"] == 1.0 and max(got["norms"]) > 1.0  # clipping had something to do
        assert model_error(got["weights"], clipped) <= 1e-5
        assert model_error(got["weights"], unclipped) > 1e-4


def test_accelerates_cpu_adagrad_under_offload_equals_torch_adagrad(runs):
    model = make_model()
    reference = torch.optim.Adagrad(model.parameters(), lr=1e-2)
    for x, y in make_batches(3, 4):
        model(x, y).backward()
        reference.step()
        reference.zero_grad()
    for out in runs:
        assert model_error(out["adagrad"]["weights"], model.state_dict()) <= 1e-5


def test_distributed_attention_equals_whole_sequence_attention(runs):
    for out in runs:
        assert out["attention"]["forward"] <= 1e-6 and out["attention"]["grads"] <= 1e-6


def test_broadcast_object_list_sends_plain_data_and_refuses_the_rest_on_every_rank(runs):
    for out in runs:
        assert out["broadcast"]["received"] == ["/runs/exp__0", {"lr": 1e-3, "tags": ["a", "b"]}, None]
        assert "only plain data" in out["broadcast"]["refused"]


def test_engine_calls_clients_make(runs):
    for out in runs:
        got = out["engine"]
        assert got["module_state_dict"] and got["offload"] == "ok"
        assert {"forward", "backward", "optimizer_step"} <= set(got["timers"])
        assert "a backend is a name" in got["backend"] and "no_such_option" in got["kwargs"]
        assert not got["compiled"]
        assert "tagged allreduce=False" in got["experts"]
