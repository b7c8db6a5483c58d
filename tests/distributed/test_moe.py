"""Expert parallelism inside ZeRO (AutoEP: ``expert_parallel`` on Hugging Face models with fused experts), on 4 Gloo
ranks against one process training the whole model on the same global batch: the same losses, gradients, aux
losses, pre-clip norms and weights at EP=2 x DP=2 and EP=4, stages 0-3; the token all-to-all's bytes equal the
formula from the one-process router's choices; expert reductions stay in the expert-data group and the expert state
per rank is total / ep (parameters) and total / (ep x edp) (optimizer state, stages 1-2).

One spawn runs every case (process start-up dominates these tiny models); each rank trains the reference itself."""

import math
from typing import Optional

import pytest
import torch

from zeroshard.testing import run_distributed

WORLD, MICRO, SEQ, STEPS, LR, CLIP = 4, 2, 8, 5, 1e-2, 0.05
FAMILIES = {  # E = 4 and 8, top-2, 2 layers, the load-balancing loss in the loss
    "mixtral": dict(num_experts_per_tok=2, output_router_logits=True),
    "qwen3_moe": dict(output_router_logits=True),
}
EXPERT_SIZES = (2, 4)  # EP=2 x DP=2, EP=4
STAGES = (0, 1, 2, 3)
INT64, FP32 = 8, 4


def batches(skewed: bool = False, seed: int = 3) -> list[torch.Tensor]:
    """Random tokens, or (``skewed``) one token repeated: every position of every sample then has the same hidden
    state, so each layer's router sends all tokens of all ranks to the same top-2 experts and the others get none."""
    g = torch.Generator().manual_seed(seed)
    if skewed:
        return [torch.full((WORLD * MICRO, SEQ), 7) for _ in range(STEPS)]
    return [torch.randint(0, 64, (WORLD * MICRO, SEQ), generator=g) for _ in range(STEPS)]


def micro(ids: torch.Tensor, rank: int, uneven: bool = False) -> torch.Tensor:
    """Rank ``rank``'s samples of a global batch; ``uneven``: 1 or 2 of them (odd ranks 2), so the ranks of an
    expert group send different token counts."""
    return ids[rank * MICRO : rank * MICRO + (1 + rank % 2 if uneven else MICRO)]


def reference(family: str, variant: str = "", overrides: Optional[dict] = None) -> dict:
    """One process, the whole global batch as the 4 ranks' micro-batches, each loss / 4 (DDP's mean)."""
    from zeroshard.testing.hf import tiny_causal_lm

    model = tiny_causal_lm(family, **(FAMILIES[family] if overrides is None else overrides))
    params = list(model.parameters())
    if variant == "lamb":
        from zeroshard.optim import Lamb

        optimizer = Lamb(params, lr=LR, weight_decay=0.01)  # one process: each parameter's norms whole
    elif variant == "muon":  # DeepSpeed's Muon (Gram Newton-Schulz: fp32 on the CPU) on whole matrices
        from zeroshard.optim import MuonWithAuxAdam, muon_param_groups

        optimizer = MuonWithAuxAdam(muon_param_groups(model.named_parameters(), [{"params": params}], {"lr": LR}))
    else:
        optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    routes: list[list[torch.Tensor]] = []  # step 0: per rank, per layer, the router's top_k_index
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda m, i, out: routes[-1].append(out[2].detach()))
        for layer in model.model.layers
    ]
    out = {"losses": [], "aux": [], "norms": []}
    uneven = variant == "uneven"
    for step, ids in enumerate(batches(variant == "skewed")):
        optimizer.zero_grad()
        losses, aux = [], []
        for rank in range(WORLD):
            routes.append([])
            part = micro(ids, rank, uneven)
            result = model(input_ids=part, labels=part)
            (result.loss / WORLD).backward()
            losses.append(result.loss.item())
            aux.append(result.aux_loss.item() if result.aux_loss is not None else None)
        if step == 0:
            out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
            out["routes"] = routes[:WORLD]
            for hook in hooks:
                hook.remove()
        out["norms"].append(torch.nn.utils.clip_grad_norm_(params, CLIP).item())
        out["losses"].append(losses)
        out["aux"].append(aux)
        optimizer.step()
    out["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["config"] = model.config
    return out


def all_to_all_formula(routes: list[list[torch.Tensor]], experts: int, ep: int, rank: int, hidden: int) -> tuple:
    """(bytes handed to the collectives, wire bytes) of one forward and backward of every MoE layer on ``rank``,
    from the one-process router's choices: per layer the count exchange (E int64), the dispatch and the combine
    forward, and both again backward; the wire carries the rows that leave this rank."""
    group = range(rank // ep * ep, rank // ep * ep + ep)
    local = experts // ep
    nbytes = wire = 0.0
    for layer in range(len(routes[rank])):
        counts = {r: torch.bincount(routes[r][layer].reshape(-1), minlength=experts).view(ep, local) for r in group}
        position = rank - group[0]
        sent = counts[rank].sum(1)  # rows this rank sends to each rank of its expert group
        received = torch.stack([counts[r][position].sum() for r in group])  # rows each sends to this rank
        rows_out, rows_in = int(sent.sum()), int(received.sum())
        others_out, others_in = rows_out - int(sent[position]), rows_in - int(received[position])
        nbytes += experts * INT64 + 2 * (rows_out + rows_in) * hidden * FP32
        wire += experts * INT64 * (ep - 1) / ep + 2 * (others_out + others_in) * hidden * FP32
    return nbytes, wire


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def run_case(family: str, ep: int, stage: int, ref: dict, variant: str = "") -> dict:
    """One engine trained 5 steps. ``variant``: "" plain; "skewed" every token routed alike; "uneven" ranks with 1
    or 2 samples; "compat" built through ``deepspeed.initialize`` (zeroshard serving ``import deepspeed``), as a
    DeepSpeed script with DeepSpeed's AutoEP block would build it; "lamb" Lamb, whose trust ratio reads each
    experts tensor's whole norms (completed over the expert-parallel ranks); "muon" DeepSpeed's Muon, whose
    Newton-Schulz step reads each experts tensor whole (joined from the expert-parallel ranks)."""
    import zeroshard
    from zeroshard import comm
    from zeroshard.testing.hf import tiny_causal_lm
    from zeroshard.zero import GatheredParameters

    rank = comm.get_rank()
    model = tiny_causal_lm(family, **FAMILIES[family])
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage},
        "expert_parallel": {"enabled": True, "autoep_size": ep, "preset_model": family},
    }
    if variant == "hybrid":  # two replicas of a 2-rank shard group: each holds one expert group
        config["zero_optimization"]["zero_hpz_partition_size"] = 2
    if variant in ("lamb", "muon"):
        params = {"lr": LR, "weight_decay": 0.01} if variant == "lamb" else {"lr": LR}
        config["optimizer"] = {"type": variant.capitalize(), "params": params}
    if variant == "compat":
        zeroshard.install_as_deepspeed()
        import deepspeed

        engine, *_ = deepspeed.initialize(model=model, config=config)
    else:
        engine, *_ = zeroshard.initialize(model=model, config=config)
    mesh = engine.mesh

    def reference_piece(name: str, value: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
        if value.shape == whole.shape:
            return whole
        local = value.shape[0]
        return whole[mesh.expert.rank * local : (mesh.expert.rank + 1) * local]

    result = {"loss": [], "aux": [], "norms": [], "grad": 0.0, "idle_experts": []}
    for step, ids in enumerate(batches(variant == "skewed")):
        engine.comm_ledger.reset()
        part = micro(ids, rank, variant == "uneven")
        output = engine(input_ids=part, labels=part)
        engine.backward(output.loss)
        result["loss"].append(abs(output.loss.item() - ref["losses"][step][rank]) / ref["losses"][step][rank])
        result["aux"].append(abs(output.aux_loss.item() - ref["aux"][step][rank]) / ref["aux"][step][rank])
        if step == 0:
            result["ledger"] = engine.comm_ledger.summary()
            for name, param in engine.module.named_parameters():
                grad = engine.param_access.full_grad(param)
                expected = reference_piece(name, grad, ref["grads"][name])
                result["grad"] = max(result["grad"], relative(grad, expected))
                if ".experts." in name:  # per local expert: (largest gradient here, in the reference)
                    for mine, theirs in zip(grad, expected):
                        result["idle_experts"].append((mine.abs().max().item(), theirs.abs().max().item()))
        engine.step()
        result["norms"].append(abs(engine.get_global_grad_norm() - ref["norms"][step]) / ref["norms"][step])
    squares = torch.zeros(4, dtype=torch.float64)  # (dense diff, dense ref, expert diff, expert ref)
    with GatheredParameters(list(engine.module.parameters())):
        for name, param in engine.module.named_parameters():
            value = param.detach().double()
            expected = reference_piece(name, value, ref["weights"][name]).double()
            row = 2 if value.shape != ref["weights"][name].shape else 0
            squares[row] += (value - expected).pow(2).sum()
            squares[row + 1] += expected.pow(2).sum()
    comm.all_reduce(squares[2:], mesh.expert)  # every expert once: dense tensors are the same on every rank
    result["weights"] = math.sqrt(squares[0] + squares[2]) / math.sqrt(squares[1] + squares[3])
    result["state"] = engine.state_bytes()
    result["state"]["master"] -= engine.stack.optimizer_state.master_bytes_shared_with_params()  # fp32: master = params
    estimate = zeroshard.estimate(lambda: tiny_causal_lm(family, **FAMILIES[family]), config, WORLD, runtime_bytes=0)
    result["estimate"] = {c: sum(estimate.bytes[c].values()) for c in estimate.bytes}
    result["mesh"] = (mesh.expert.size, mesh.expert_shard.size, mesh.shard.size)
    engine.destroy()
    return result


def moe_worker(cases: list[tuple]) -> dict:
    import zeroshard

    references = {}
    out = {}
    for family, ep, stage, variant in cases:
        data = "" if variant in ("compat", "hybrid") else variant  # they train on the plain batches
        if (family, data) not in references:
            references[(family, data)] = reference(family, data)
        out[(family, ep, stage, variant)] = run_case(family, ep, stage, references[(family, data)], variant)
    rank = zeroshard.comm.get_rank()
    formulas = {}
    for (family, data), ref in references.items():
        config = ref["config"]
        experts = getattr(config, "num_local_experts", None) or config.num_experts
        for ep in EXPERT_SIZES:
            formulas[(family, ep, data)] = all_to_all_formula(ref["routes"], experts, ep, rank, config.hidden_size)
    counts = {}
    for (family, _), ref in references.items():
        names = ref["weights"]
        counts[family] = (
            sum(w.numel() for n, w in names.items() if ".experts." not in n),
            sum(w.numel() for n, w in names.items() if ".experts." in n),
        )
    return {"cases": out, "formulas": formulas, "counts": counts}


CASES = [(family, ep, stage, "") for family in FAMILIES for ep in EXPERT_SIZES for stage in STAGES]
SKEWED = [("mixtral", 4, 0, "skewed"), ("mixtral", 4, 3, "skewed")]
COMPAT = [("mixtral", 2, 2, "compat")]
UNEVEN = [("qwen3_moe", 2, 0, "uneven"), ("qwen3_moe", 2, 3, "uneven")]
WHOLE = [("mixtral", 2, 1, "lamb"), ("qwen3_moe", 4, 3, "lamb"), ("mixtral", 2, 2, "muon"), ("qwen3_moe", 2, 3, "muon")]
HYBRID = [(family, 2, stage, "hybrid") for family in FAMILIES for stage in (1, 2, 3)]


@pytest.fixture(scope="module")
def moe_runs():
    return run_distributed(moe_worker, WORLD, CASES + SKEWED + COMPAT + UNEVEN + WHOLE + HYBRID, timeout_s=1500)


@pytest.mark.parametrize("family, ep, stage", [case[:3] for case in CASES])
def test_expert_parallel_training_matches_one_process(moe_runs, family, ep, stage):
    for per_rank in moe_runs:
        run = per_rank["cases"][(family, ep, stage, "")]
        assert run["mesh"] == (ep, WORLD // ep, WORLD)
        assert run["loss"][0] <= 1e-6
        assert max(run["aux"]) <= 1e-6
        assert run["grad"] <= 1e-6
        assert max(run["norms"]) <= 1e-6, "the pre-clip norm covers expert and dense gradients once"
        assert run["weights"] <= 1e-5


@pytest.mark.parametrize("family, ep, stage", [case[:3] for case in HYBRID])
def test_experts_with_hybrid_sharding_match_one_process(moe_runs, family, ep, stage):
    """Before: refused. EP=2 inside a shard group of 2 ranks, 2 replicas of it (zero_hpz_partition_size 2): expert
    shards reduce over the ranks holding the same experts, then the replicas, as dense shards do."""
    for per_rank in moe_runs:
        run = per_rank["cases"][(family, ep, stage, "hybrid")]
        assert run["mesh"] == (2, 1, 2)  # expert group, expert shard group, shard group
        assert run["loss"][0] <= 1e-6 and run["grad"] <= 1e-6 and max(run["norms"]) <= 1e-6
        assert run["weights"] <= 1e-5


@pytest.mark.parametrize("family, ep, stage, variant", WHOLE)
def test_lamb_and_muon_under_expert_parallelism_match_one_process(moe_runs, family, ep, stage, variant):
    """Before: refused (Lamb's trust ratio would have read this rank's experts of a fused tensor, Muon would have
    orthogonalized them alone). The optimizer contract's layout completes each experts tensor's norms, or joins
    the tensor, over the expert-parallel ranks: one process's step."""
    for per_rank in moe_runs:
        run = per_rank["cases"][(family, ep, stage, variant)]
        assert run["loss"][0] <= 1e-6 and run["grad"] <= 1e-6
        assert run["weights"] <= 1e-5


@pytest.mark.parametrize("stage", [0, 3])
def test_an_expert_without_tokens_on_every_rank_gets_a_zero_gradient(moe_runs, stage):
    idle = 0
    for per_rank in moe_runs:
        run = per_rank["cases"][("mixtral", 4, stage, "skewed")]
        assert run["grad"] <= 1e-6 and run["weights"] <= 1e-5
        for mine, reference_grad in run["idle_experts"]:
            if reference_grad == 0.0:  # no token chose this expert on any rank
                assert mine == 0.0
                idle += 1
    assert idle >= 2, "two of the four experts got no token (the premise of the test)"


@pytest.mark.parametrize("family, ep", [(family, ep) for family in FAMILIES for ep in EXPERT_SIZES])
def test_token_all_to_all_bytes_equal_the_routing_formula(moe_runs, family, ep):
    for per_rank in moe_runs:
        nbytes, wire = per_rank["formulas"][(family, ep, "")]
        for stage in STAGES:
            totals = per_rank["cases"][(family, ep, stage, "")]["ledger"][("all_to_all", "expert")]
            assert totals.bytes == nbytes
            assert totals.wire_bytes == pytest.approx(wire, rel=1e-12)


@pytest.mark.parametrize("family, ep, stage, variant", [*CASES, *HYBRID])
def test_the_estimate_counts_expert_state_per_rank_as_the_run_holds_it(moe_runs, family, ep, stage, variant):
    for per_rank in moe_runs:
        run = per_rank["cases"][(family, ep, stage, variant)]
        held, predicted = run["state"], run["estimate"]
        assert predicted["parameters"] == held["params"]
        assert predicted["gradients"] == held["grad_shard"]
        assert predicted["optimizer_state"] == held["master"] + held["optimizer_state"]


def test_expert_reductions_and_state_stay_in_the_expert_data_group(moe_runs):
    family, ep = "qwen3_moe", 2
    edp = WORLD // ep
    for per_rank in moe_runs:
        dense, experts = per_rank["counts"][family]
        for stage in (1, 2):
            run = per_rank["cases"][(family, ep, stage, "")]
            # one flat group of dense parameters (sharded over 4), one of this rank's experts (over its 2 peers)
            dense_shard = -(-dense // WORLD)
            expert_shard = -(-(experts // ep) // edp)
            assert run["state"]["params"] == FP32 * (dense + experts // ep)
            assert run["state"]["optimizer_state"] == 2 * FP32 * (dense_shard + expert_shard)
            ledger = run["ledger"]
            op = "reduce_scatter"
            assert ledger[(op, "expert_shard")].bytes == FP32 * edp * expert_shard
            assert ledger[(op, "shard")].bytes == FP32 * WORLD * dense_shard
            assert {group for kind, group in ledger if kind == op} == {"shard", "expert_shard"}
        ledger = per_rank["cases"][(family, ep, 0, "")]["ledger"]
        assert ledger[("all_reduce", "expert_gradient")].bytes == FP32 * (experts // ep)


def build_engine(family: str, ep: int, stage: int, accumulation: int = 1, replicas: int = 1, **layout):
    """An engine over this process's world; ``ep`` 1: expert parallelism off (every expert on every rank);
    ``replicas`` > 1: hybrid sharding, ZeRO sharding over world / replicas ranks; ``layout``: ``tp`` (tensor
    parallelism), ``micro`` (samples per rank), ``shape`` (the model's config overrides)."""
    import zeroshard
    from zeroshard.testing.hf import tiny_causal_lm

    config = {
        "train_micro_batch_size_per_gpu": layout.get("micro", MICRO),
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage},
        "tensor_parallel": {"autotp_size": layout.get("tp", 1)},
        "expert_parallel": {"enabled": ep > 1, "autoep_size": ep},
    }
    if replicas > 1:
        config["zero_optimization"]["zero_hpz_partition_size"] = WORLD // replicas
    model = tiny_causal_lm(family, **layout.get("shape", FAMILIES[family]))
    engine, *_ = zeroshard.initialize(model=model, config=config)
    return engine


def train_steps(engine, first: int, count: int) -> None:
    """Optimizer steps ``first`` .. ``first + count - 1`` on the global batches; each rank takes its micro-batches
    (one process takes all four, accumulating)."""
    from zeroshard import comm

    world, rank = comm.get_world_size(), comm.get_rank()
    for ids in batches()[first : first + count]:
        for part in range(rank, WORLD, world):
            engine.backward(engine(input_ids=micro(ids, part), labels=micro(ids, part)).loss)
            engine.step()


def whole_weights(engine) -> dict:
    return engine.consolidated_state_dict(rank0_only=False)


def resume_worker(directory: str, stages: tuple, layouts: tuple) -> dict:
    """Per stage: train 3 steps at EP=2 x DP=2 and save, then 2 more (the uninterrupted run); every layout in
    ``layouts`` loads the save and trains the same 2 steps. Returns (weights right after the load vs at the save,
    after the 2 steps vs the uninterrupted run) per (stage, layout)."""
    from zeroshard import comm
    from zeroshard.testing.parity import model_error

    out = {}
    for stage in stages:
        path = f"{directory}/stage{stage}"
        if comm.get_world_size() == WORLD:
            engine = build_engine("qwen3_moe", 2, stage)
            train_steps(engine, 0, 3)
            engine.save_checkpoint(path, tag="t")
            out[(stage, "saved")] = whole_weights(engine)
            train_steps(engine, 3, 2)
            out[(stage, "uninterrupted")] = whole_weights(engine)
            engine.destroy()
        for ep in layouts:  # an expert-parallel degree, or "2x2": EP=2 with hybrid sharding over 2 replicas
            degree, replicas = (2, 2) if ep == "2x2" else (ep, 1)
            accumulation = WORLD // comm.get_world_size()
            engine = build_engine("qwen3_moe", degree, stage, accumulation=accumulation, replicas=replicas)
            engine.load_checkpoint(path, tag="t")
            loaded = whole_weights(engine)
            train_steps(engine, 3, 2)
            out[(stage, ep)] = (loaded, whole_weights(engine))
            engine.destroy()
    if comm.get_world_size() == WORLD:
        for (stage, ep), value in list(out.items()):
            if isinstance(value, tuple):
                loaded, resumed = value
                saved, uninterrupted = out[(stage, "saved")], out[(stage, "uninterrupted")]
                exact = max((loaded[n] - saved[n]).abs().max().item() for n in saved)
                out[(stage, ep)] = (exact, model_error(resumed, uninterrupted))
    return out


RESUME_STAGES = (1, 3)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("moe-checkpoints"))
    four = run_distributed(resume_worker, WORLD, directory, RESUME_STAGES, (4, 2, 1, "2x2"), timeout_s=900)[0]
    one = run_distributed(resume_worker, 1, directory, RESUME_STAGES, (1,), timeout_s=900)[0]
    return four, one, directory


@pytest.mark.parametrize("stage", RESUME_STAGES)
def test_a_save_at_ep2_resumes_at_ep4_ep2_ep1_hybrid_and_in_one_process(resumed, stage):
    """Experts are saved whole (pieces per expert rank, like tensor-parallel splits), so any layout reads them:
    EP=4, EP=2, no expert parallelism at DP=4, EP=2 over 2 hybrid replicas, one process."""
    from zeroshard.testing.parity import model_error

    four, one, _ = resumed
    for ep in (4, 2, 1, "2x2"):
        exact, drift = four[(stage, ep)]
        assert exact == 0.0, f"EP={ep}: weights right after the load differ from the saved ones"
        assert drift <= 1e-6, f"EP={ep}: 2 steps after the load drift {drift} from the uninterrupted run"
    loaded, resumed_one = one[(stage, 1)]
    assert max((loaded[n] - four[(stage, "saved")][n]).abs().max().item() for n in loaded) == 0.0
    assert model_error(resumed_one, four[(stage, "uninterrupted")]) <= 1e-6


def _swap_expert_files(body: dict) -> dict:
    name = next(n for n, e in body["params"].items() if (e.get("split") or {}).get("axis") == "ep")
    pieces = body["params"][name]["pieces"]
    first, last = pieces[0][0], pieces[-1][0]
    for piece in pieces:
        piece[0] = last if piece[0] == first else first if piece[0] == last else piece[0]
    return body


def _expert_split(change):
    def edit(body: dict) -> dict:
        for entry in body["params"].values():
            if (entry.get("split") or {}).get("axis") == "ep":
                change(entry)
        return body

    return edit


EXPERT_TAMPERING = {
    "expert dim": (_expert_split(lambda e: e["split"].update(dim=1)), "experts are cut along dim 0 only"),
    "expert fused": (_expert_split(lambda e: e["split"].update(fused=2)), "experts are cut along dim 0 only"),
    "parts": (_expert_split(lambda e: e["split"].update(parts=4)), "the checkpoint was saved by 2 expert-parallel"),
    "axis": (_expert_split(lambda e: e["split"].update(axis="tp")), "saved without tensor parallelism"),
    "unknown axis": (_expert_split(lambda e: e["split"].update(axis="pp")), "axis is one of"),
    "size": (lambda body: {**body, "expert_parallel_size": 1}, "saved without expert parallelism"),
    "size type": (lambda body: {**body, "expert_parallel_size": "2"}, "expert_parallel_size"),
    "pieces swapped": (_swap_expert_files, "pieces moved between ranks"),
    "tensor ranks": (lambda body: {**body, "expert_tensor_ranks": 2}, "expert_tensor_ranks': ep_in_tp=2 must divide"),
    "tensor ranks type": (lambda body: {**body, "expert_tensor_ranks": True}, "field 'expert_tensor_ranks'"),
    "tensor ranks zero": (lambda body: {**body, "expert_tensor_ranks": 0}, "field 'expert_tensor_ranks'"),
    "tensor ranks huge": (lambda body: {**body, "expert_tensor_ranks": 2**70}, "field 'expert_tensor_ranks'"),
}


@pytest.mark.parametrize("case", sorted(EXPERT_TAMPERING))
def test_edited_expert_records_are_refused_even_resealed(resumed, case):
    """A manifest edited and given a fresh checksum still describes experts the run could have written, or is
    refused naming the field, before anything is read."""
    import json
    import os

    from zeroshard.checkpoint.manifest import seal, validate
    from zeroshard.checkpoint.safetensors_io import CheckpointError

    path = os.path.join(resumed[2], "stage1", "t", "manifest.json")
    with open(path) as f:
        data = json.load(f)
    body = {k: v for k, v in data.items() if k != "checksum"}
    validate(seal(json.loads(json.dumps(body))), path)  # the original is valid
    change, message = EXPERT_TAMPERING[case]
    with pytest.raises(CheckpointError, match=message):
        validate(seal(change(json.loads(json.dumps(body)))), path)


def transformers_split_worker(path: str) -> str:
    """A model whose experts transformers split itself (``DistributedConfig(ep_size=2)``: DTensor experts, its own
    token exchange) handed to initialize, with and without zeroshard's expert_parallel block."""
    import transformers
    from transformers.distributed import DistributedConfig

    import zeroshard

    messages = []
    for block in ({}, {"expert_parallel": {"enabled": True, "autoep_size": 2}}):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, distributed_config=DistributedConfig(ep_size=2, tp_size=2, tp_plan={})
        )
        config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
        try:
            zeroshard.initialize(model=model, config={**config, **block})
        except NotImplementedError as err:
            messages.append(str(err))
    return messages


def test_experts_transformers_already_split_are_refused_by_name_never_split_twice(tmp_path):
    from zeroshard.testing.hf import tiny_causal_lm

    tiny_causal_lm("mixtral", **FAMILIES["mixtral"]).save_pretrained(tmp_path)
    for messages in run_distributed(transformers_split_worker, 2, str(tmp_path)):
        assert len(messages) == 2
        assert all(
            "model.layers.0.mlp.experts is already split over an expert-parallel group by transformers" in m
            for m in messages
        )


# -- route 2: DeepSpeed's expert-parameter protocol, as ArcticTraining drives it ------------------------------------
ARCTIC = dict(num_experts_per_tok=2)  # Qwen3-MoE, 8 experts, top-2; the client's block has no HF router to record


class _AllToAllRows(torch.autograd.Function):
    """The client's own uneven all-to-all (ArcticTraining's ``AlltoAllV``), on the torch group deepspeed gave it."""

    @staticmethod
    def forward(ctx, x, group, received, sent):
        import torch.distributed as dist

        ctx.group, ctx.received, ctx.sent = group, received, sent
        out = x.new_empty((sum(received), x.shape[1]))
        dist.all_to_all_single(out, x.contiguous(), received, sent, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        out = grad.new_empty((sum(ctx.sent), grad.shape[1]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.sent, ctx.received, group=ctx.group)
        return out, None, None, None


class ArcticStyleMoE(torch.nn.Module):
    """A client MoE block in ArcticTraining's unified layout: ``router_gate [E, H]``, this rank's experts stacked as
    ``expert_gate_up [L, H, 2I]`` (gate and up interleaved on the last dim) and ``expert_down [L, I, H]``; routing as
    Qwen3-MoE's (softmax, top-k); tokens exchanged with torch's all_to_all_single on the group
    ``deepspeed.utils.groups`` returns."""

    def __init__(self, block, ep_size: int, ep_rank: int, ep_group):
        super().__init__()
        experts, total = block.experts, block.experts.gate_up_proj.shape[0]
        local = total // ep_size
        self.ep_size, self.ep_group, self.local, self.total = ep_size, ep_group, local, total
        self.top_k, self.norm = block.gate.top_k, block.gate.norm_topk_prob
        self.act = experts.act_fn
        mine = slice(ep_rank * local, (ep_rank + 1) * local)
        gate, up = experts.gate_up_proj.detach()[mine].chunk(2, dim=1)  # [L, I, H] each
        self.router_gate = torch.nn.Parameter(block.gate.weight.detach().clone())
        self.expert_gate_up = torch.nn.Parameter(
            torch.stack((gate.transpose(1, 2), up.transpose(1, 2)), dim=-1).flatten(-2).contiguous()
        )
        self.expert_down = torch.nn.Parameter(experts.down_proj.detach()[mine].transpose(1, 2).contiguous())

    def forward(self, hidden):
        import torch.distributed as dist

        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        probs = torch.softmax(torch.nn.functional.linear(x, self.router_gate).float(), dim=-1)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        if self.norm:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.total)
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=self.ep_group)
        received_counts = received_counts.view(self.ep_size, self.local)
        sent = counts.view(self.ep_size, self.local).sum(1).tolist()
        received = received_counts.sum(1).tolist()
        rows = _AllToAllRows.apply(x[order // self.top_k], self.ep_group, received, sent)
        expert_of_row = torch.arange(self.local).repeat(self.ep_size).repeat_interleave(received_counts.reshape(-1))
        regroup = torch.argsort(expert_of_row, stable=True)
        outputs = []
        for e, chunk in enumerate(rows[regroup].split(received_counts.sum(0).tolist())):
            h = chunk @ self.expert_gate_up[e]
            outputs.append((self.act(h[:, 0::2]) * h[:, 1::2]) @ self.expert_down[e])
        back = torch.empty_like(rows).index_copy(0, regroup, torch.cat(outputs))
        returned = _AllToAllRows.apply(back, self.ep_group, sent, received)
        out = x.new_zeros(x.shape).index_add(0, order // self.top_k, returned * weights.reshape(-1)[order, None])
        return out.reshape(shape)


def arctic_client(ep: int, ep_rank: int, ep_group) -> torch.nn.Module:
    """Qwen3-MoE with every MoE block remapped to the client's layout, its experts tagged as ArcticTraining's
    ``identify_expert_params`` tags them."""
    from zeroshard.testing.hf import tiny_causal_lm

    model = tiny_causal_lm("qwen3_moe", **ARCTIC)
    for layer in model.model.layers:
        layer.mlp = ArcticStyleMoE(layer.mlp, ep, ep_rank, ep_group)
        for param in (layer.mlp.expert_gate_up, layer.mlp.expert_down):
            param.allreduce, param.group_name = False, f"ep_size_{ep}"
    return model


def arctic_worker(stages: tuple) -> dict:
    """ArcticTraining's sequence, in compat mode: expert groups before the engine, the client's blocks over the
    groups' torch handles, tags by ``identify_expert_params``' rule, optimizer groups split by
    ``split_params_into_different_moe_groups_for_optimizer``, then ``deepspeed.initialize``."""
    import zeroshard

    zeroshard.install_as_deepspeed()
    import deepspeed
    from deepspeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer
    from deepspeed.utils import groups

    from zeroshard import comm

    rank, ep = comm.get_rank(), 2
    ref = reference("qwen3_moe", overrides=ARCTIC)
    groups._create_expert_data_and_model_parallel(ep, mpu=None, use_data_before_expert_parallel_=False)
    name = f"ep_size_{ep}"
    ep_rank, ep_group = groups._get_expert_parallel_rank(name), groups._get_expert_parallel_group(name)
    out = {
        "groups": (
            groups._get_expert_parallel_group_ranks(name),
            groups._get_expert_data_parallel_group_ranks(name),
            groups._get_expert_parallel_world_size(name),
            groups._get_expert_data_parallel_world_size(name),
            groups._get_expert_broadcast_src_rank(name),
            groups._get_max_expert_size_name(),
        )
    }
    for stage in stages:
        model = arctic_client(ep, ep_rank, ep_group)
        params = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(model.parameters()), "name": "params"}
        )
        config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_clipping": CLIP,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
            "zero_optimization": {"stage": stage},
        }
        # the client's modules hold its torch group (not copyable): the estimate builds one from a factory
        estimate = zeroshard.estimate(lambda: arctic_client(ep, ep_rank, ep_group), config, WORLD, runtime_bytes=0)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=config)
        losses, norms = [], []
        for step, ids in enumerate(batches()):
            loss = engine(input_ids=micro(ids, rank), labels=micro(ids, rank)).loss
            engine.backward(loss)
            engine.step()
            losses.append(abs(loss.item() - ref["losses"][step][rank]) / ref["losses"][step][rank])
            norms.append(abs(engine.get_global_grad_norm() - ref["norms"][step]) / ref["norms"][step])
        error = _arctic_weight_error(engine, ref["weights"], ep, ep_rank)
        out[stage] = {
            "losses": losses,
            "norms": norms,
            "weights": error,
            "moe_groups": [g.get("moe", False) for g in params],
            "tagged": sum(is_moe_param(p) for p in model.parameters()),
            "mesh": (engine.mesh.expert.size, engine.mesh.expert_shard.size),
            "state": _held(engine),
            "estimate": {c: sum(estimate.bytes[c].values()) for c in estimate.bytes},
        }
        engine.destroy()
    return out


def _held(engine) -> dict:
    held = engine.state_bytes()
    held["master"] -= engine.stack.optimizer_state.master_bytes_shared_with_params()  # fp32: master = params
    return held


def assert_estimate_matches(run: dict) -> None:
    held, predicted = run["state"], run["estimate"]
    assert predicted["parameters"] == held["params"]
    assert predicted["gradients"] == held["grad_shard"]
    assert predicted["optimizer_state"] == held["master"] + held["optimizer_state"]


def _arctic_weight_error(engine, expected: dict, ep: int, ep_rank: int) -> float:
    """The client's layout mapped back to Hugging Face names, against the one-process weights (all experts)."""
    from zeroshard import comm
    from zeroshard.zero import GatheredParameters

    squares = torch.zeros(4, dtype=torch.float64)
    with GatheredParameters(list(engine.module.parameters())):
        for name, param in engine.module.named_parameters():
            value = param.detach().double()
            if name.endswith("router_gate"):
                squares[0] += (value - expected[name.replace("router_gate", "gate.weight")]).pow(2).sum()
                squares[1] += expected[name.replace("router_gate", "gate.weight")].double().pow(2).sum()
                continue
            if ".mlp." not in name:
                squares[0] += (value - expected[name]).pow(2).sum()
                squares[1] += expected[name].double().pow(2).sum()
                continue
            prefix = name.rsplit(".", 1)[0]
            local = value.shape[0]
            mine = slice(ep_rank * local, (ep_rank + 1) * local)
            if name.endswith("expert_gate_up"):
                whole = expected[f"{prefix}.experts.gate_up_proj"][mine].double()
                gate, up = whole.chunk(2, dim=1)
                ref = torch.stack((gate.transpose(1, 2), up.transpose(1, 2)), dim=-1).flatten(-2)
            else:
                ref = expected[f"{prefix}.experts.down_proj"][mine].double().transpose(1, 2)
            squares[2] += (value - ref).pow(2).sum()
            squares[3] += ref.pow(2).sum()
    comm.all_reduce(squares[2:], engine.mesh.expert)
    return math.sqrt(squares[0] + squares[2]) / math.sqrt(squares[1] + squares[3])


ARCTIC_STAGES = (2, 3)  # ArcticTraining runs ZeRO-2; stage 3 shards the same tagged tensors


@pytest.fixture(scope="module")
def arctic_runs():
    return run_distributed(arctic_worker, WORLD, ARCTIC_STAGES, timeout_s=900)


def test_deepspeed_expert_groups_are_laid_out_as_deepspeed_lays_them(arctic_runs):
    for rank, per_rank in enumerate(arctic_runs):
        expert, expert_data, ep, edp, src, largest = per_rank["groups"]
        assert expert == [rank // 2 * 2, rank // 2 * 2 + 1] and expert_data == [rank % 2, rank % 2 + 2]
        assert (ep, edp, src, largest) == (2, 2, rank % 2, "ep_size_2")


@pytest.mark.parametrize("stage", ARCTIC_STAGES)
def test_arctic_training_style_expert_parameters_train_as_one_process(arctic_runs, stage):
    """Route 2: the client splits its experts and exchanges its tokens; zeroshard shards and reduces the tagged
    tensors over the ranks holding the same experts and averages over the whole data-parallel group."""
    for per_rank in arctic_runs:
        run = per_rank[stage]
        assert run["tagged"] == 4 and run["moe_groups"] == [False, True]
        assert run["mesh"] == (2, 2)
        assert run["losses"][0] <= 1e-6
        assert max(run["norms"]) <= 1e-6
        assert run["weights"] <= 1e-5
        assert_estimate_matches(run)  # zeroshard estimate splits the tagged experts as initialize does


def test_autoep_through_deepspeed_initialize_trains_as_one_process(moe_runs):
    """Route 3 in compat mode: DeepSpeed's expert_parallel block handed to ``deepspeed.initialize``."""
    for per_rank in moe_runs:
        run = per_rank["cases"][("mixtral", 2, 2, "compat")]
        assert run["mesh"] == (2, 2, WORLD)
        assert run["loss"][0] <= 1e-6 and max(run["aux"]) <= 1e-6 and run["grad"] <= 1e-6
        assert max(run["norms"]) <= 1e-6 and run["weights"] <= 1e-5


# -- route 1: DeepSpeed's MoE layer, capacity-gated, experts over ep_size ranks ---------------------------------------
ROUTE1_CASES = ("top2_cf1_drop", "top1_residual")  # the case (k=2, capacity 1.0, dropping) and Residual MoE
ROUTE1_STAGES = (0, 1, 2, 3)


class MoENet(torch.nn.Module):
    """DeepSpeed's layer as a model: the loss of ``tests/fixtures/deepspeed_moe/shapes.py`` on one micro-batch."""

    def __init__(self, layer):
        super().__init__()
        self.moe = layer

    def forward(self, x, target):
        out, l_aux, _ = self.moe(x)
        return (out - target).pow(2).mean() + 0.1 * l_aux  # shapes.loss


def _moe_shapes():
    from pathlib import Path

    from zeroshard.testing.fixtures import module_from_file

    path = Path(__file__).resolve().parent.parent / "fixtures" / "deepspeed_moe" / "shapes.py"
    return module_from_file(path, "tests_moe_shapes", register=True), path.parent / "expected.safetensors"


def route1_worker(stages: tuple) -> dict:
    """Per case and stage: the layer at ep_size 2 on 4 ranks (EP=2 x DP=2), built as a DeepSpeed script builds it
    (``deepspeed.moe.layer.MoE`` then ``deepspeed.initialize``), each rank one micro-batch of the fixture: its
    step-0 output, ``l_aux`` and ``exp_counts`` against DeepSpeed's on that micro-batch, every gradient against the
    mean of DeepSpeed's four (experts by global index), then 3 AdamW steps against one process accumulating the
    four micro-batches through the same layer at ep_size 1."""
    import zeroshard

    zeroshard.install_as_deepspeed()
    import deepspeed
    from deepspeed.moe.layer import MoE
    from safetensors.torch import load_file

    from zeroshard import comm
    from zeroshard.testing.parity import model_error

    shapes, expected_path = _moe_shapes()
    expected = load_file(str(expected_path))
    x, target = expected["x"], expected["target"]
    rank = comm.get_rank()
    out = {}
    for case in ROUTE1_CASES:
        state = {k.removeprefix(f"{case}.weight."): v for k, v in expected.items() if k.startswith(f"{case}.weight.")}
        reference = MoENet(shapes.build(MoE, case))  # one process, every expert
        reference.moe.load_state_dict(state)
        optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.0)
        for _ in range(3):
            optimizer.zero_grad()
            for b in range(WORLD):
                (reference(x[b], target[b]) / WORLD).backward()
            optimizer.step()
        for stage in stages:
            model = MoENet(shapes.build(MoE, case, ep_size=2))
            ep_rank = rank % 2
            model.moe.load_state_dict(shapes.local(state, 2, ep_rank))
            config = {
                "train_micro_batch_size_per_gpu": 1,
                "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
                "gradient_clipping": 0.0,
                "zero_optimization": {"stage": stage},
            }
            estimate = zeroshard.estimate(model, config, WORLD, runtime_bytes=0)
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
            result = {
                "mesh": (engine.mesh.expert.size, engine.mesh.expert_shard.size),
                "estimate": {c: sum(estimate.bytes[c].values()) for c in estimate.bytes},
            }
            layer_out, l_aux, counts = engine.module.moe(x[rank])
            result["out"] = relative(layer_out.detach(), expected[f"{case}.{rank}.out"])
            result["l_aux"] = abs(l_aux.item() - expected[f"{case}.{rank}.l_aux"].item())
            result["counts"] = counts.tolist() == expected[f"{case}.{rank}.counts"].tolist()
            engine.backward(engine(x[rank], target[rank]))
            worst = 0.0
            for name, param in engine.module.named_parameters():
                grad = engine.param_access.full_grad(param)
                key = name.removeprefix("moe.")
                global_key = shapes_global_name(key, ep_rank, shapes.EXPERTS // 2)
                mean = sum(expected[f"{case}.{b}.grad.{global_key}"] for b in range(WORLD)) / WORLD
                worst = max(worst, relative(grad, mean))
            result["grad"] = worst
            engine.step()
            for _ in range(2):
                engine.backward(engine(x[rank], target[rank]))
                engine.step()
            result["state"] = _held(engine)
            whole = {n.removeprefix("moe."): v for n, v in engine.consolidated_state_dict(rank0_only=False).items()}
            result["weights"] = model_error(
                whole, {n.removeprefix("moe."): p.detach() for n, p in reference.named_parameters()}
            )
            out[(case, stage)] = result
            engine.destroy()
    return out


def shapes_global_name(name: str, ep_rank: int, local: int) -> str:
    """A local expert's parameter name under its global index (rank r's copy i is expert r * L + i)."""
    marker = "deepspeed_experts."
    if marker not in name:
        return name
    head, tail = name.split(marker)
    index, rest = tail.split(".", 1)
    return f"{head}{marker}{ep_rank * local + int(index)}.{rest}"


@pytest.fixture(scope="module")
def route1_runs():
    return run_distributed(route1_worker, WORLD, ROUTE1_STAGES, timeout_s=900)


@pytest.mark.parametrize("case", ROUTE1_CASES)
@pytest.mark.parametrize("stage", ROUTE1_STAGES)
def test_deepspeeds_moe_layer_over_two_expert_ranks_matches_deepspeed_in_one_process(route1_runs, case, stage):
    """Route 1: ``deepspeed.moe.layer.MoE(ep_size=2)`` under ``deepspeed.initialize`` on 4 ranks computes what
    DeepSpeed 0.19.8's own layer computes in one process on each micro-batch (capacity drops included), and trains
    as one process accumulating the four."""
    for per_rank in route1_runs:
        run = per_rank[(case, stage)]
        assert run["mesh"] == (2, 2)
        assert run["out"] <= 1e-6 and run["l_aux"] <= 1e-6 and run["counts"]
        assert run["grad"] <= 1e-6
        assert run["weights"] <= 1e-5  # the consolidated weights name every expert by its global index
        assert_estimate_matches(run)  # zeroshard estimate counts the layer's copies as experts


def route1_resume_worker(directory: str, stage: int) -> dict:
    """DeepSpeed's layer saved at ep_size 2 on 4 ranks after 2 steps, then 2 more (the uninterrupted run); loaded at
    ep_size 4, at ep_size 1 (every expert on every rank) and, on one rank, in one process accumulating the four
    micro-batches: each expert is saved whole under its global index, so every layout reads it."""
    import zeroshard

    zeroshard.install_as_deepspeed()
    import deepspeed
    from deepspeed.moe.layer import MoE
    from safetensors.torch import load_file

    from zeroshard import comm

    shapes, expected_path = _moe_shapes()
    expected = load_file(str(expected_path))
    x, target = expected["x"], expected["target"]
    case, world, rank = "top2_cf1_drop", comm.get_world_size(), comm.get_rank()
    state = {k.removeprefix(f"{case}.weight."): v for k, v in expected.items() if k.startswith(f"{case}.weight.")}
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": WORLD // world,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage},
    }

    def engine_at(ep: int):
        model = MoENet(shapes.build(MoE, case, ep_size=ep))
        model.moe.load_state_dict(shapes.local(state, ep, rank % ep))
        return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)[0]

    def train(engine, steps: int) -> None:
        for _ in range(steps):
            for b in range(rank, WORLD, world):
                engine.backward(engine(x[b], target[b]))
                engine.step()

    out = {}
    if world == WORLD:
        engine = engine_at(2)
        train(engine, 2)
        engine.save_checkpoint(directory, tag="t")
        out["saved"] = engine.consolidated_state_dict(rank0_only=False)
        train(engine, 2)
        out["uninterrupted"] = engine.consolidated_state_dict(rank0_only=False)
        engine.destroy()
    out.update(load_and_continue(engine_at, train, directory, (4, 1) if world == WORLD else (1,)))
    return out


def load_and_continue(build, train, directory: str, layouts: tuple) -> dict:
    """Per expert-parallel size in ``layouts``: an engine ``build(ep)`` loads the save, and (its whole weights right
    after the load, after 2 more steps of ``train(engine, 2)``)."""
    out = {}
    for ep in layouts:
        engine = build(ep)
        engine.load_checkpoint(directory, tag="t")
        loaded = engine.consolidated_state_dict(rank0_only=False)
        train(engine, 2)
        out[ep] = (loaded, engine.consolidated_state_dict(rank0_only=False))
        engine.destroy()
    return out


@pytest.mark.parametrize("stage", [1, 3])
def test_deepspeeds_moe_layer_resumes_at_any_expert_parallel_size(tmp_path, stage):
    from zeroshard.testing.parity import model_error

    four = run_distributed(route1_resume_worker, WORLD, str(tmp_path), stage, timeout_s=900)[0]
    one = run_distributed(route1_resume_worker, 1, str(tmp_path), stage, timeout_s=900)[0]
    saved, uninterrupted = four["saved"], four["uninterrupted"]
    assert sum("deepspeed_experts." in n for n in saved) == 4 * 4  # 4 experts x (2 weights, 2 biases), global names
    for loaded, resumed in (four[4], four[1], one[1]):
        assert set(loaded) == set(saved)
        assert max((loaded[n] - saved[n]).abs().max().item() for n in saved) == 0.0
        assert model_error(resumed, uninterrupted) <= 1e-6


@pytest.mark.parametrize("stage", [0, 3])
def test_ranks_of_an_expert_group_may_send_different_token_counts(moe_runs, stage):
    """No group needs equal batches: the counts go first, so ranks with 1 and 2 samples (8 and 16 tokens) in one
    expert group exchange what they have, and training matches one process on the same uneven global batch."""
    for per_rank in moe_runs:
        run = per_rank["cases"][("qwen3_moe", 2, stage, "uneven")]
        assert run["loss"][0] <= 1e-6 and run["grad"] <= 1e-6
        assert max(run["norms"]) <= 1e-6 and run["weights"] <= 1e-5


def arctic_resume_worker(directory: str) -> dict:
    """Route 2's checkpoints: an ArcticTraining-style client at EP=2 x DP=2 (ZeRO-2) saves after 2 steps and trains 2
    more; the same client rebuilt at EP=4 (groups ``ep_size_4``, 2 local experts per rank) and at EP=2 loads the
    save and trains the same 2 steps. The tagged stacks are saved whole (dim-0 pieces per expert rank)."""
    import zeroshard

    zeroshard.install_as_deepspeed()
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from deepspeed.utils import groups

    from zeroshard import comm

    rank = comm.get_rank()
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 2},
    }

    def client(ep: int):
        groups._create_expert_data_and_model_parallel(ep, mpu=None)
        name = f"ep_size_{ep}"
        ep_rank, ep_group = groups._get_expert_parallel_rank(name), groups._get_expert_parallel_group(name)
        model = arctic_client(ep, ep_rank, ep_group)
        params = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "p"})
        return deepspeed.initialize(model=model, model_parameters=params, config=config)[0]

    def train(engine, first: int) -> None:
        for ids in batches()[first : first + 2]:
            engine.backward(engine(input_ids=micro(ids, rank), labels=micro(ids, rank)).loss)
            engine.step()

    engine = client(2)
    train(engine, 0)
    engine.save_checkpoint(directory, tag="t")
    out = {"saved": engine.consolidated_state_dict(rank0_only=False)}
    train(engine, 2)
    out["uninterrupted"] = engine.consolidated_state_dict(rank0_only=False)
    engine.destroy()
    out.update(load_and_continue(client, train, directory, (4, 2)))
    return out


def test_arctic_training_style_checkpoints_resume_at_another_expert_parallel_size(tmp_path):
    from zeroshard.testing.parity import model_error

    out = run_distributed(arctic_resume_worker, WORLD, str(tmp_path), timeout_s=900)[0]
    saved, uninterrupted = out["saved"], out["uninterrupted"]
    assert saved["model.layers.0.mlp.expert_gate_up"].shape[0] == 8  # every expert, joined from the expert ranks
    for ep in (4, 2):
        loaded, resumed = out[ep]
        assert max((loaded[n] - saved[n]).abs().max().item() for n in saved) == 0.0, f"EP={ep}"
        assert model_error(resumed, uninterrupted) <= 1e-6, f"EP={ep}"


def _frozen_experts_engine(ep: int, stage: int):
    """DeepSpeed's layer (4 experts) with its experts frozen, as a fine-tune of a MoE base trains the gate only; the
    default stage3_param_persistence_threshold (these experts are far below it)."""
    import zeroshard
    from zeroshard.moe import MoE

    shapes, _ = _moe_shapes()
    torch.manual_seed(0)
    model = MoENet(MoE(shapes.HIDDEN, shapes.expert(), num_experts=shapes.EXPERTS, ep_size=ep, k=1, use_rts=False))
    for name, param in model.named_parameters():
        param.requires_grad_(".experts." not in name)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": LR}},
              "zero_optimization": {"stage": stage}}  # fmt: skip
    engine, *_ = zeroshard.initialize(model=model, config=config)
    return engine


def frozen_experts_worker(directory: str) -> dict:
    """Frozen experts saved with every expert on each rank (ep_size 1) load at ep_size 2 at stages 1 and 3 (before:
    AttributeError 'ModuleList has no attribute 2'); saved at stage 3 and ep_size 2 (before: refused, telling the
    stage-3 run to use stage 3) they load at ep_size 1; below stage 3 at ep_size 2 the refusal names the stage."""
    from zeroshard.zero import GatheredParameters

    out = {}
    for ep, stage in ((1, 1), (2, 3)):
        engine = _frozen_experts_engine(ep, stage)
        experts = [p for n, p in engine.module.named_parameters() if ".experts." in n]
        with GatheredParameters(experts, modifier_rank=0):
            for i, param in enumerate(experts):
                param.data.fill_(float(i + 4 * engine.mesh.expert.rank))  # every global expert its own value
        saved = engine.consolidated_state_dict(rank0_only=False)
        engine.save_checkpoint(f"{directory}/ep{ep}-stage{stage}")
        engine.destroy()
        for load_ep, load_stage in ((2, 1), (2, 3)) if ep == 1 else ((1, 1),):
            engine = _frozen_experts_engine(load_ep, load_stage)
            engine.load_checkpoint(f"{directory}/ep{ep}-stage{stage}")
            loaded = engine.consolidated_state_dict(rank0_only=False)
            out[(ep, stage, load_ep, load_stage)] = sorted(n for n in saved if not torch.equal(loaded[n], saved[n]))
            engine.destroy()
    engine = _frozen_experts_engine(2, 1)
    try:
        engine.save_checkpoint(f"{directory}/refused")
    except NotImplementedError as err:
        out["refused"] = str(err)
    engine.destroy()
    return out


def test_frozen_experts_save_and_load_across_expert_parallel_sizes(tmp_path):
    runs = run_distributed(frozen_experts_worker, 2, str(tmp_path))
    for out in runs:
        for key in ((1, 1, 2, 1), (1, 1, 2, 3), (2, 3, 1, 1)):
            assert out[key] == [], (key, out[key])
        assert "save_checkpoint at ZeRO stage 1: frozen tensor- or expert-parallel parameters" in out["refused"]


# -- experts with tensor parallelism: DeepSpeed's folding, each tensor rank routing its block of the tokens ---------
TP_FAMILIES = {family: {**shape, "num_key_value_heads": 2} for family, shape in FAMILIES.items()}  # heads divide 2
TP4_FAMILIES = {name: {**shape, "num_attention_heads": 4, "num_key_value_heads": 4} for name, shape in FAMILIES.items()}
TP_LAYOUTS = {  # (ep, tp) -> the stages each family trains at; the mesh it must build (tensor, expert, expert shard)
    (2, 2): ((1, 2, 3), (2, 2, 2)),  # each tensor pair is an expert group; the experts shard over the data ranks
    (4, 2): ((3,), (2, 4, 1)),  # an expert group of 2 data ranks x 2 tensor ranks: one expert shard per rank
    (2, 4): ((0, 1), (4, 2, 2)),  # expert groups inside the tensor group; its other pair holds the same experts
}


def ep_tp_engine(family: str, stage: int, ep: int, tp: int, micro: int, accumulation: int = 1, aux: bool = True):
    shape = {**(TP4_FAMILIES if tp == 4 else TP_FAMILIES)[family], "output_router_logits": aux}
    return build_engine(family, ep, stage, accumulation, tp=tp, micro=micro, shape=shape)


def ep_tp_reference(family: str, tp: int = 2) -> tuple[list, dict]:
    """One process, each global batch as the data ranks' parts (``WORLD / tp`` of them: the load-balancing loss is
    per forward), their mean losses averaged."""
    from zeroshard.testing.hf import tiny_causal_lm

    parts = WORLD // tp
    model = tiny_causal_lm(family, **(TP4_FAMILIES if tp == 4 else TP_FAMILIES)[family])
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for ids in batches():
        optimizer.zero_grad()
        outs = [model(input_ids=part, labels=part) for part in ids.chunk(parts)]
        (sum(out.loss for out in outs) / parts).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        losses.append([out.loss.item() for out in outs])
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def ep_tp_train(engine, steps: range, parts: int) -> list[float]:
    """``steps`` of the global batches, this rank's data-parallel part of ``parts`` (the ranks of a tensor group
    share theirs); one process takes every part, accumulating."""
    from zeroshard import comm

    mine = [engine.mesh.batch.rank] if comm.get_world_size() > 1 else range(parts)
    losses = []
    for ids in batches()[steps.start : steps.stop]:
        for part in mine:
            chunk = ids.chunk(parts)[part]
            out = engine(input_ids=chunk, labels=chunk)
            engine.backward(out.loss)
            engine.step()
            losses.append(out.loss.item())
    return losses


def ep_tp_worker(directory: str) -> dict:
    """Every layout of :data:`TP_LAYOUTS` against one process, then a save at EP=2 x TP=2 loaded at
    EP=1 x TP=1 x DP=4 (and, by the one-process run of the test, in one process)."""
    from zeroshard.testing.parity import model_error

    out = {}
    for (ep, tp), (stages, _) in TP_LAYOUTS.items():
        parts = WORLD // tp
        for family in FAMILIES:
            reference_losses, reference = ep_tp_reference(family, tp)
            for stage in stages:
                engine = ep_tp_engine(family, stage, ep=ep, tp=tp, micro=len(batches()[0]) // parts)
                losses = ep_tp_train(engine, range(STEPS), parts=parts)
                gathers = engine.comm_ledger.summary().get(("all_gather", "tensor"))  # before consolidating
                data = engine.mesh.batch.rank
                expected = [step[data] for step in reference_losses]
                out[(ep, tp, family, stage)] = {
                    "loss": max(abs(a - b) / b for a, b in zip(losses, expected)),
                    "weights": model_error(engine.consolidated_state_dict(rank0_only=False), reference),
                    "mesh": (engine.mesh.tensor.size, engine.mesh.expert.size, engine.mesh.expert_shard.size),
                    "experts": {m.num_experts for m in engine.module.modules() if hasattr(m, "num_global_experts")},
                    "gathers": gathers,
                }
                engine.destroy()
    engine = ep_tp_engine("qwen3_moe", 3, ep=2, tp=2, micro=4, aux=False)
    ep_tp_train(engine, range(3), parts=2)
    engine.save_checkpoint(directory, tag="ep2tp2")
    out["saved"] = engine.consolidated_state_dict(rank0_only=False)
    ep_tp_train(engine, range(3, 5), parts=2)
    out["uninterrupted"] = engine.consolidated_state_dict(rank0_only=False)
    engine.destroy()
    out["dp4"] = ep_tp_resume(directory, parts=4, micro=2)
    out["ep4"] = ep_tp_resume(directory, parts=4, micro=2, ep=4)
    out["ep4tp2"] = ep_tp_resume(directory, parts=2, micro=4, ep=4, tp=2)
    return out


def ep_tp_resume(
    directory: str, parts: int, micro: int, accumulation: int = 1, ep: int = 1, tp: int = 1
) -> tuple[dict, dict]:
    """Load the EP=2 x TP=2 save at ``ep`` x ``tp`` (by default without expert or tensor parallelism); (weights right
    after the load, after the last 2 steps)."""
    engine = ep_tp_engine("qwen3_moe", 3, ep=ep, tp=tp, micro=micro, accumulation=accumulation, aux=False)
    engine.load_checkpoint(directory, tag="ep2tp2")
    loaded = engine.consolidated_state_dict(rank0_only=False)
    ep_tp_train(engine, range(3, 5), parts=parts)
    resumed = engine.consolidated_state_dict(rank0_only=False)
    engine.destroy()
    return loaded, resumed


@pytest.fixture(scope="module")
def ep_tp_runs(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("ep-tp"))
    four = run_distributed(ep_tp_worker, WORLD, directory, timeout_s=900)
    one = run_distributed(ep_tp_resume, 1, directory, 4, 2, 4, timeout_s=600)[0]
    return four, one, directory


TP_CASES = [(ep, tp, stage) for (ep, tp), (stages, _) in TP_LAYOUTS.items() for stage in stages]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("layout", TP_CASES)
def test_experts_with_tensor_parallelism_match_one_process(ep_tp_runs, family, layout):
    """Before: refused, then experts whole on both ranks of a tensor pair (each computing every token twice). Now
    DeepSpeed's folding on 4 ranks: EP=2 x TP=2 (each tensor pair an expert group), EP=4 x TP=2 (2 data ranks x 2
    tensor ranks), EP=2 x TP=4 (two expert groups inside the tensor group); each tensor rank routes its block of the
    tokens and holds E / ep experts; attention split over the tensor ranks, the load-balancing loss included: 5 steps
    within 1e-5 of one process."""
    four, *_ = ep_tp_runs
    ep, tp, stage = layout
    experts = {"mixtral": 4, "qwen3_moe": 8}[family]
    for per_rank in four:
        got = per_rank[(ep, tp, family, stage)]
        assert got["mesh"] == TP_LAYOUTS[(ep, tp)][1]
        assert got["experts"] == {experts // ep}  # experts per rank in every layer
        assert got["loss"] <= 1e-6 and got["weights"] <= 1e-5, got


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_tensor_groups_token_gathers_equal_the_formula(ep_tp_runs, family):
    """The folding's only new traffic, exact in the ledger: per MoE layer and step, forward gathers the experts'
    outputs over the tensor group (T rows of H, fp32; T = 4 samples x 8 tokens, 16 routed by each tensor rank) and
    backward gathers the gradients of the hidden states (T x H) and of the routing weights (T x k), each gather's
    output counted, (tp - 1) / tp of it on the wire; beside them, the first forward's check that the tensor ranks
    hold the same batch (one gather of 4 float64 per rank)."""
    four, *_ = ep_tp_runs
    tokens, hidden, top_k, layers, tp = 4 * SEQ, 16, 2, 2, 2
    total = STEPS * layers * FP32 * tokens * (hidden + hidden + top_k) + tp * 4 * 8
    for per_rank in four:
        gathers = per_rank[(2, 2, family, 1)]["gathers"]
        assert (gathers.calls, gathers.bytes) == (STEPS * layers * 3 + 1, total)
        assert gathers.wire_bytes == pytest.approx(total * (tp - 1) / tp, rel=1e-12)


def test_a_save_at_ep2_tp2_loads_at_every_layout_and_in_one_process(ep_tp_runs):
    """Saved at EP=2 x TP=2 (folded), loaded at EP=4 x TP=2 (folded over data ranks too), at EP=4 without tensor
    parallelism, without either at DP=4 and in one process: the weights exact, 2 more steps within 1e-6 of the
    uninterrupted run (the load-balancing loss off: it is per forward, and the forwards hold other samples at another
    layout)."""
    from zeroshard.testing.parity import model_error

    four, one, _ = ep_tp_runs
    saved, uninterrupted = four[0]["saved"], four[0]["uninterrupted"]
    for loaded, resumed in (four[0]["ep4tp2"], four[0]["ep4"], four[0]["dp4"], one):
        assert all(torch.equal(loaded[name], saved[name]) for name in saved)
        assert model_error(resumed, uninterrupted) <= 1e-6


def test_expert_pieces_of_an_ep2_tp2_save_lie_with_the_expert_ranks_that_wrote_them(ep_tp_runs):
    """Folded EP=2 x TP=2 at stage 3: expert rank e is tensor rank e, its experts sharded over the two data ranks
    (ranks e and e + 2). The manifest records how many tensor ranks an expert group takes in and checks each expert
    piece against its file's rank's coordinate on the expert axis; swapping the files is refused even with the
    checksum recomputed."""
    import json
    import os

    from zeroshard.checkpoint.manifest import seal, validate
    from zeroshard.checkpoint.safetensors_io import CheckpointError

    path = os.path.join(ep_tp_runs[2], "ep2tp2", "manifest.json")
    with open(path) as f:
        body = {k: v for k, v in json.load(f).items() if k != "checksum"}
    validate(seal(json.loads(json.dumps(body))), path)
    assert (body["expert_parallel_size"], body["tensor_parallel_size"], body["expert_tensor_ranks"]) == (2, 2, 2)
    experts = [e for e in body["params"].values() if (e.get("split") or {}).get("axis") == "ep"]
    holders = [{"rank00000.safetensors", "rank00002.safetensors"}, {"rank00001.safetensors", "rank00003.safetensors"}]
    files = [(p[0], holders[p[3] // (math.prod(e["shape"]) // 2)]) for e in experts for p in e["pieces"]]
    assert experts and all(file in allowed for file, allowed in files)
    assert {file for file, _ in files} == {f"rank0000{r}.safetensors" for r in range(4)}
    with pytest.raises(CheckpointError, match="pieces moved between ranks"):
        validate(seal(_swap_expert_files(json.loads(json.dumps(body)))), path)
    unfolded = {**json.loads(json.dumps(body)), "expert_tensor_ranks": 1}  # read as experts over data ranks
    with pytest.raises(CheckpointError, match="pieces moved between ranks"):
        validate(seal(unfolded), path)
