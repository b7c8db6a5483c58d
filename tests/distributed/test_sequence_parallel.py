"""Ulysses sequence parallelism trains a Hugging Face Llama exactly as one process does on whole sequences
(SP=2, SP=2 x DP=2, SP=4 with its 2 key-value heads repeated; stages 0, 2, 3; an SFT sample whose prompt fills
whole pieces), its all-to-all bytes equal the analytic value, and stage 3 shards over every rank.

Tiled MLPs inside the ZeRO engine: parameter gradients arrive once per tile from nested backwards, which the
reducer adds before reducing; the same training as untiled at stages 2 and 3, and every rank agrees on the tile
count (ZeRO-3 regathers the weights per tile, so a rank running more tiles would wait forever)."""

import math

import pytest
import torch

from zeroshard.testing import run_distributed

STEPS = 2
SP_STEPS, SP_SEQ, SP_LR = 3, 64, 1e-3
SP_STAGES = (0, 2, 3)
PROMPT = 40  # sample 0 of rank 0: its first 40 labels are -100, so whole pieces hold no counted token


def sp_model(family: str = "llama", **overrides):
    """A tiny Llama, or (``mixtral``, ``qwen3_moe``) a mixture of 4 experts, top-2, without the router's
    load-balancing loss (a mean over the tokens a rank holds: under sequence parallelism each rank holds part of a
    sample's)."""
    from zeroshard.testing.hf import tiny_causal_lm

    shape = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
    if family == "mixtral":
        shape.update(num_local_experts=4, num_experts_per_tok=2, output_router_logits=False)
    if family == "qwen3_moe":
        shape.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, output_router_logits=False)
    return tiny_causal_lm(family, max_position_embeddings=SP_SEQ, attn_implementation="sdpa", **{**shape, **overrides})


def sp_samples(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per rank, its loader's samples: ids and labels [world, loader batches, 1, tokens]."""
    batches = math.ceil(SP_STEPS / 2)  # SP >= 2 computes one loader batch per SP micro-steps
    ids = torch.randint(0, 64, (world, batches, 1, SP_SEQ), generator=torch.Generator().manual_seed(11))
    labels = ids.clone()
    labels[0, 0, :, :PROMPT] = -100
    return ids, labels


def sp_reference(world: int, sp: int, family: str = "llama") -> dict:
    """One process on whole sequences: at step s data-parallel group d computes rank (d * sp + s % sp)'s loader
    batch s // sp (the adapter's order); the loss is the mean over groups of each sample's token mean."""
    ids, labels = sp_samples(world)
    model = sp_model(family)
    optimizer = torch.optim.AdamW(model.parameters(), lr=SP_LR, weight_decay=0.0)
    losses, norms = [], []
    for step in range(SP_STEPS):
        owners = [d * sp + step % sp for d in range(world // sp)]
        per_group = [model(input_ids=ids[r, step // sp], labels=labels[r, step // sp]).loss for r in owners]
        optimizer.zero_grad()
        (sum(per_group) / len(owners)).backward()
        norms.append(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters())).item())
        optimizer.step()
        losses.append([loss.item() for loss in per_group])
    return {"losses": losses, "norms": norms, "state": {k: v.clone() for k, v in model.state_dict().items()}}


SP_VARIANTS = ("bf16", "offload", "checkpointing")  # with SP=2 x DP=2 at stage 3 (bf16: stage 2)


def _variant_config(stage: int, variant: str, tp: int = 1, ep: int = 1, family: str = "llama") -> dict:
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if variant == "offload":
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        **({"tensor_parallel": {"autotp_size": tp}} if tp > 1 else {}),
        **({"expert_parallel": {"enabled": True, "autoep_size": ep, "preset_model": family}} if ep > 1 else {}),
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,  # the reference does not clip (DeepSpeed's default would clip at 1.0)
        "optimizer": {"type": "AdamW", "params": {"lr": SP_LR, "weight_decay": 0.0}},
        "zero_optimization": zero,
        "bf16": {"enabled": variant == "bf16"},
    }


def sp_worker(
    sp: int,
    reference: dict,
    variants: tuple = (),
    tp: int = 1,
    stages: tuple = SP_STAGES,
    family: str = "llama",
    ep: int = 1,
) -> dict:
    """Every stage at ``sp``-way sequence parallelism (inside ``tp``-way tensor parallelism) over this world, then
    ``variants`` (``reference``: computed before any registration, which replaces the process's sdpa attention).
    The ranks of a tensor-parallel group share their samples: rank r reads the loader of sample rank r // tp."""
    import zeroshard
    from zeroshard.sequence_parallel import UlyssesSPDataLoaderAdapter, register_with_transformers, token_weighted_loss

    world = zeroshard.comm.get_world_size()
    out = {"reference": reference}
    ids, labels = sp_samples(world // tp)
    rank = zeroshard.comm.get_rank()
    samples = [
        {"input_ids": i, "labels": t, "position_ids": torch.arange(SP_SEQ)[None]}
        for i, t in zip(ids[rank // tp], labels[rank // tp])
    ]
    mpu = register_with_transformers(sp_model(family), "sdpa", sp, micro_batch_size=1, tensor_parallel_size=tp)
    cases = [(stage, "fp32") for stage in stages] + [(2 if v == "bf16" else 3, v) for v in variants]
    for stage, variant in cases:
        model = sp_model(family)
        if variant == "checkpointing":
            model.gradient_checkpointing_enable()
        engine, *_ = zeroshard.initialize(model=model, config=_variant_config(stage, variant, tp, ep, family), mpu=mpu)
        loader = UlyssesSPDataLoaderAdapter(
            torch.utils.data.DataLoader(samples, batch_size=None), mpu.sequence.rank, mpu.sequence, sp, "cpu"
        )
        losses, norms = [], []
        for step, batch in zip(range(SP_STEPS), loader):
            if step == 1:
                engine.comm_ledger.reset()
            shift = batch["shift_labels"]
            out_ = engine(
                input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=shift, shift_labels=shift
            )
            loss = token_weighted_loss(out_.loss, shift, mpu.sequence)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            norms.append(engine.get_global_grad_norm())
        out[stage if variant == "fp32" else variant] = {
            "data_rank": rank // (sp * tp),
            "losses": losses,
            "norms": norms,
            "state": engine.consolidated_state_dict(rank0_only=False),
            "ledger": {
                f"{op}/{g}": (t.calls, t.bytes, t.wire_bytes) for (op, g), t in engine.comm_ledger.summary().items()
            },
            "state_bytes": engine.state_bytes(),
            "padded": sum(flat.layout.padded_numel for flat in engine.stack.flat_groups),
            "mesh": _mesh_kind(engine.mesh, mpu),
            "sizes": (
                engine.sequence_parallel_size,
                engine.dp_world_size,
                engine.seq_dp_world_size,
                engine.train_batch_size(),
            ),
        }
        engine.destroy()
    return out


def _mesh_kind(mesh, mpu) -> str:
    """``registered``: the engine runs on the registration's mesh; ``refined``: on a mesh refining it (more
    dimensions), its sequence group the registration's own (the same process group and ledger)."""
    if mesh is mpu.mesh and mesh.gradient is mpu.sequence_data:
        return "registered"
    if mesh.base is mpu.mesh and mesh.sequence.handle is mpu.sequence.handle and mesh.context is mpu.mesh.context:
        return "refined"
    return "other"


@pytest.fixture(scope="module")
def sp_runs() -> dict:
    """4 ranks, one spawn: SP=2 x DP=2 and SP=4 (2 key-value heads repeated twice)."""
    return run_distributed(sp_four_rank_worker, 4)


def sp_four_rank_worker() -> dict:
    references = {sp: sp_reference(4, sp) for sp in (2, 4)}
    tensor_and_sequence = sp_reference(2, 2)  # TP=2 x SP=2: one data-parallel group, two sample ranks
    # EP=2 x SP=2: the expert groups are the two data-parallel ranks
    experts = {family: sp_reference(4, 2, family) for family in ("mixtral", "qwen3_moe")}
    folded = sp_reference(2, 2, "qwen3_moe")  # EP=2 x TP=2 x SP=2: the expert group is each tensor pair
    return {
        2: sp_worker(2, references[2], SP_VARIANTS),
        4: sp_worker(4, references[4]),
        "tp2": sp_worker(2, tensor_and_sequence, tp=2, stages=(0, 1, 2, 3)),
        **{family: sp_worker(2, ref, stages=(1, 2, 3), family=family, ep=2) for family, ref in experts.items()},
        "tp2_experts": sp_worker(2, folded, tp=2, stages=(1, 3), family="qwen3_moe", ep=2),
    }


def _check_parity(run: dict, case, first: float = 1e-6, bound: float = 1e-5) -> None:
    from zeroshard.testing.parity import model_error

    reference, got = run["reference"], run["sp"][case] if "sp" in run else run[case]
    expected = [per_group[got["data_rank"]] for per_group in reference["losses"]]  # this rank's sample's loss
    assert abs(got["losses"][0] - expected[0]) <= first * abs(expected[0])
    for loss, want in zip(got["losses"], expected):
        assert abs(loss - want) <= bound * abs(want), (got["losses"], expected)
    for norm, want in zip(got["norms"], reference["norms"]):
        assert abs(norm - want) <= bound * want, (got["norms"], reference["norms"])
    assert model_error(got["state"], reference["state"]) <= bound


@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("stage", SP_STAGES)
def test_ulysses_matches_one_process_on_whole_sequences(sp_runs, sp, stage):
    for run in sp_runs:
        _check_parity(run[sp], stage)


def test_the_engine_runs_on_the_mesh_the_registration_built(sp_runs):
    """register_with_transformers builds the mesh once (tp given once, each group created once); every engine
    initialized with it runs on that mesh, or, where the config adds experts, on a mesh refining it whose sequence
    group is the registration's; destroying one leaves the registration whole for the next (each case here is a new
    engine on the same registration)."""
    for run in sp_runs:
        for layout, kind in ((2, "registered"), (4, "registered"), ("tp2", "registered"), ("mixtral", "refined"),
                             ("qwen3_moe", "refined"), ("tp2_experts", "refined")):  # fmt: skip
            engines = [case for case in run[layout].values() if isinstance(case, dict) and "mesh" in case]
            assert len(engines) >= 2 and all(case["mesh"] == kind for case in engines), layout


@pytest.mark.parametrize("family", ("mixtral", "qwen3_moe"))
@pytest.mark.parametrize("stage", (1, 2, 3))
def test_experts_and_sequence_parallelism_together_match_one_process(sp_runs, stage, family):
    """Before: refused. ALST on a mixture of experts: EP=2 x SP=2 on 4 ranks (tiny Mixtral and Qwen3-MoE),
    each rank routing its half of a sample's tokens to the expert group of the two data-parallel ranks; experts
    shard over the ranks holding them and the sequence ranks, as dense parameters shard over data x sequence."""
    for run in sp_runs:
        _check_parity(run[family], stage)
        assert run[family][stage]["sizes"][:3] == (2, 2, 4)  # sequence, data-parallel, sequence x data
        exchanged = {op for op in run[family][stage]["ledger"] if op.endswith("/expert")}
        assert exchanged, run[family][stage]["ledger"]  # the tokens went over the expert group


@pytest.mark.parametrize("stage", (1, 3))
def test_experts_tensor_and_sequence_parallelism_together_match_one_process(sp_runs, stage):
    """EP=2 x TP=2 x SP=2 on 4 ranks (tiny Qwen3-MoE): AutoEP folds each tensor pair into an expert group; each
    tensor rank routes its block of the sequence piece the pair shares; attention split over the tensor ranks and
    Ulysses over the sequence ranks: within 1e-5 of one process (DeepSpeed 0.19.8 refuses AutoEP with AutoTP and
    Ulysses together)."""
    for run in sp_runs:
        _check_parity(run["tp2_experts"], stage)
        assert run["tp2_experts"][stage]["sizes"][:3] == (2, 1, 2)
        ledger = run["tp2_experts"][stage]["ledger"]
        assert {"all_to_all/expert", "all_gather/tensor"} <= set(ledger), ledger


@pytest.mark.parametrize("stage", (0, 1, 2, 3))
def test_tensor_and_sequence_parallelism_together_match_one_process(sp_runs, stage):
    """TP=2 x SP=2 on 4 ranks is a mesh shape: tensor groups are consecutive ranks, sequence groups stride by tp,
    ZeRO shards over the sequence ranks of one tensor position; each rank holds one of the 4 query heads."""
    for run in sp_runs:
        _check_parity(run["tp2"], stage)
        assert run["tp2"][stage]["sizes"][:3] == (2, 1, 2)  # sequence, data-parallel, sequence x data
        tensor_pieces = {op for op in run["tp2"][stage]["ledger"] if op.endswith("/tensor")}
        assert tensor_pieces, run["tp2"][stage]["ledger"]  # the row-parallel sums ran over the tensor group


@pytest.mark.parametrize("variant", SP_VARIANTS)
def test_ulysses_with_bf16_offload_and_activation_checkpointing(sp_runs, variant):
    """SP=2 x DP=2: bf16 at stage 2 (against the fp32 reference: 2e-2), the optimizer offloaded at stage 3 and HF
    gradient checkpointing at stage 3 (recomputation runs the exchanges again) within the fp32 bounds."""
    for run in sp_runs:
        if variant == "bf16":
            _check_parity(run[2], variant, first=2e-2, bound=2e-2)
        else:
            _check_parity(run[2], variant)


@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("stage", SP_STAGES)
def test_ulysses_all_to_all_bytes_and_stage3_shards_over_every_rank(sp_runs, sp, stage):
    """Per steady-state step: per attention layer, 2 x (q + k + v + output) message bytes, key-value heads
    repeated to the degree; (P-1)/P of it on the wire. ZeRO state: 1/world of the padded model at stages 1-3."""
    from zeroshard.sequence_parallel import HeadLayout, attention_all_to_all_bytes

    heads, layers, steps = HeadLayout(4, 2, sp), 2, SP_STEPS - 1
    per_layer = attention_all_to_all_bytes(1, SP_SEQ // sp, 16, heads, 4)
    for run in sp_runs:
        got = run[sp][stage]
        calls, message, wire = got["ledger"]["all_to_all/sequence"]
        assert (calls, message) == (steps * layers * 8, steps * layers * per_layer)
        assert wire == pytest.approx(message * (sp - 1) / sp, rel=1e-12)
        assert got["sizes"] == (sp, 4 // sp, 4, 4 // sp)
        if stage > 0:  # fp32 masters (at stage 3 the compute shards themselves) and Adam: a quarter each
            state = got["state_bytes"]
            assert state["master"] + (state["params"] if stage == 3 else 0) == 4 * got["padded"] // 4
            assert state["optimizer_state"] == 8 * got["padded"] // 4


class Tiled(torch.nn.Module):
    """An MLP run in tiles: how a user plugs ``tiled_mlp`` into a model (a module wrapping the model's own)."""

    def __init__(self, mlp: torch.nn.Module, tiles: int):
        super().__init__()
        self.mlp, self.tiles = mlp, tiles

    def forward(self, x):
        from zeroshard.sequence_parallel import tiled_mlp

        return tiled_mlp(self.mlp, x, self.tiles)


def worker() -> dict:
    import zeroshard
    from zeroshard.sequence_parallel import agreed_tile_count
    from zeroshard.testing.hf import tiny_causal_lm

    rank = zeroshard.comm.get_rank()
    g = torch.Generator().manual_seed(5)
    batches = torch.randint(0, 64, (STEPS, 2, 2, 24), generator=g)  # step, rank, batch, tokens
    out = {"tiles": agreed_tile_count(24 + 40 * rank, 16, zeroshard.comm.group_of(None, "world"))}
    for stage in (2, 3):
        for tiles in (None, 3):
            model = tiny_causal_lm("llama")
            if tiles is not None:
                for layer in model.model.layers:
                    layer.mlp = Tiled(layer.mlp, tiles)
            config = {
                "train_micro_batch_size_per_gpu": 2,
                "gradient_clipping": 0.0,  # the reference does not clip
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            }
            engine, *_ = zeroshard.initialize(model=model, config=config)
            losses = []
            for batch in batches[:, rank]:
                loss = engine(input_ids=batch, labels=batch).loss
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            state = engine.consolidated_state_dict(rank0_only=False)
            out[(stage, tiles)] = (losses, {k.replace(".mlp.mlp.", ".mlp."): v for k, v in state.items()})
            engine.destroy()
    return out


def two_rank_worker() -> dict:
    """One spawn of 2 ranks: tiled MLPs in the engine, then SP=2 alone (its reference before registering), then
    the refusals."""
    out = {"tiled": worker(), "reference": sp_reference(2, 2)}
    out["sp"] = sp_worker(2, out["reference"])
    out["refusals"] = sp_refusals()
    out["zero_init"] = zero_init_on_the_registered_mesh()
    return out


def zero_init_on_the_registered_mesh() -> dict:
    """zero.Init(mpu=...) agrees on initial values over the registration's mesh (its broadcasts counted in that
    mesh's ledger, not the process-wide one), and the model it built trains at stage 3 on that mesh."""
    import zeroshard
    from zeroshard.sequence_parallel import register_with_transformers

    mpu = register_with_transformers(sp_model(), "sdpa", 2, micro_batch_size=1)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3}}  # fmt: skip
    mpu.mesh.context.ledger.reset()
    with zeroshard.zero.Init(config_dict_or_path=config, mpu=mpu):
        model = sp_model()
    counted = sum(t.calls for (op, _), t in mpu.mesh.context.ledger.summary().items() if op == "broadcast")
    engine, *_ = zeroshard.initialize(model=model, config=config, mpu=mpu)
    ids = torch.randint(0, 64, (1, SP_SEQ // 2), generator=torch.Generator().manual_seed(0))
    places = torch.arange(SP_SEQ // 2)[None] + mpu.sequence.rank * (SP_SEQ // 2)  # this rank's half of the sequence
    engine.backward(engine(input_ids=ids, position_ids=places, labels=ids, shift_labels=ids).loss)
    engine.step()
    out = {"broadcasts": counted, "one_mesh": engine.mesh is mpu.mesh}
    engine.destroy()
    return out


def sp_refusals() -> dict:
    """Each refusal's message (on every rank: nothing hangs)."""
    import zeroshard
    from zeroshard.sequence_parallel import register_with_transformers

    def message(call) -> str:
        try:
            call()
        except (ValueError, TypeError, NotImplementedError) as error:
            return f"{type(error).__name__}: {error}"
        return "accepted"

    mpu = register_with_transformers(sp_model(), "sdpa", 2, micro_batch_size=1)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}

    class MegatronStyle:
        def get_model_parallel_world_size(self):
            return 2

    return {
        **_exchange_refusals(mpu, message),
        "other_mpu": message(lambda: zeroshard.initialize(model=sp_model(), config=config, mpu=MegatronStyle())),
        "disagree": message(
            lambda: zeroshard.initialize(model=sp_model(), config={**config, "sequence_parallel_size": 1}, mpu=mpu)
        ),
        "indivisible": message(
            lambda: zeroshard.initialize(model=sp_model(), config={**config, "sequence_parallel_size": 3})
        ),
        "heads": message(
            lambda: register_with_transformers(
                sp_model(num_attention_heads=3, num_key_value_heads=3, hidden_size=48), "sdpa", 2, 1
            )
        ),
    }


def _exchange_refusals(mpu, message) -> dict:
    """Batches the ranks' loaders disagree on, exchanged by the Ulysses adapter: every rank raises, naming the rank
    and entry (before: int64 labels arrived as float64 denormals, int32 ones aborted both ranks in Gloo, a batch
    refused on one rank left the other waiting); and ``token_weighted_loss`` over the torch ProcessGroup DeepSpeed's
    code passes."""
    from zeroshard import comm
    from zeroshard.sequence_parallel import UlyssesSPDataLoaderAdapter, token_weighted_loss

    rank, group = comm.get_rank(), mpu.get_sequence_parallel_group()
    ids = torch.arange(8).view(1, 8)

    def batch(labels_dtype=torch.int64, **extra):
        return {"input_ids": ids, "position_ids": ids, "labels": ids.to(labels_dtype), **extra}

    def first(batches) -> str:
        return message(lambda: next(iter(UlyssesSPDataLoaderAdapter(batches, rank, group, 2))))

    loss, labels = torch.tensor(float(rank + 1), requires_grad=True), torch.tensor([[1, -100, 2][: 3 - rank]])
    by_torch_group = token_weighted_loss(loss, labels, group)
    by_own_group = token_weighted_loss(loss, labels, comm.as_group(group, "sequence"))
    return {
        "same_item_size": first([batch(torch.int64 if rank == 0 else torch.float64)]),
        "other_item_size": first([batch(torch.int64 if rank == 0 else torch.int32)]),
        "refused_on_one_rank": first([batch() if rank == 0 else {"input_ids": ids}]),
        "not_plain_on_one_rank": first([batch(note="x" if rank == 0 else object())]),
        "agreeing": first([batch()]),
        "loss_over_torch_group": (by_torch_group.item(), by_own_group.item()),
        "loss_over_a_string": message(lambda: token_weighted_loss(loss, labels, "sequence")),
    }


@pytest.fixture(scope="module")
def two_rank_runs() -> list:
    return run_distributed(two_rank_worker, 2)


def test_tiled_mlps_train_like_untiled_ones_under_zero(two_rank_runs):
    from zeroshard.testing.parity import model_error

    for run in two_rank_runs:
        out = run["tiled"]
        assert out["tiles"] == 4  # rank 1's 64 tokens need 4 tiles of 16; rank 0 runs 4 too
        for stage in (2, 3):
            losses, state = out[(stage, None)]
            tiled_losses, tiled_state = out[(stage, 3)]
            assert tiled_losses == losses  # the forward is the same computation
            assert model_error(tiled_state, state) <= 1e-6


@pytest.mark.parametrize("stage", SP_STAGES)
def test_ulysses_on_two_ranks_matches_one_process(two_rank_runs, stage):
    for run in two_rank_runs:
        _check_parity(run, stage)
        assert run["sp"][stage]["sizes"] == (2, 1, 2, 1)


def test_zero_init_is_handed_the_registered_mesh(two_rank_runs):
    for run in two_rank_runs:
        assert run["zero_init"]["broadcasts"] > 0 and run["zero_init"]["one_mesh"], run["zero_init"]


def test_ulysses_refusals_name_what_is_wrong(two_rank_runs):
    for run in two_rank_runs:
        got = run["refusals"]
        assert got["other_mpu"].startswith("NotImplementedError") and "MegatronStyle" in got["other_mpu"]
        assert "sequence_parallel_size 1 in the config but the mpu's sequence-parallel group has 2" in got["disagree"]
        assert "sequence_parallel_size 3 must divide the number of ranks 2" in got["indivisible"]
        assert "3 attention heads do not divide over sequence_parallel_size 2" in got["heads"]


def test_ulysses_batch_exchange_names_the_rank_whose_batch_disagrees(two_rank_runs):
    for rank, run in enumerate(two_rank_runs):
        got = run["refusals"]
        for case, dtype in (("same_item_size", "float64"), ("other_item_size", "int32")):
            assert got[case].startswith("ValueError"), got[case]
            assert f"'labels' is {dtype} on sequence-parallel rank 1" in got[case]
        other = "the batch has no ['position_ids'" if rank == 1 else "sequence-parallel rank 1's batch was refused"
        assert got["refused_on_one_rank"].startswith("ValueError") and other in got["refused_on_one_rank"]
        assert "batch entry 'note' is a object" in got["not_plain_on_one_rank"]
        assert got["agreeing"] == "accepted"
        by_torch, by_own = got["loss_over_torch_group"]
        assert by_torch == by_own == pytest.approx(4 / 3)  # rank 0: loss 1 over 2 tokens, rank 1: loss 2 over 1
        string = got["loss_over_a_string"]
        assert string.startswith("TypeError") and "expected a torch ProcessGroup" in string
