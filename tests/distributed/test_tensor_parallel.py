"""Tensor-parallel layers train: their collectives are differentiable (zeroshard.comm.autograd), so outputs and
every gradient on 2 ranks equal a single-process reference's, slice by slice, and the ledger counts the
tensor-parallel bytes."""

import math

import pytest
import torch
import torch.nn.functional as F

from zeroshard.testing import run_distributed

VOCAB, WIDTH, HIDDEN, TOKENS = 10, 8, 12, 6  # a vocabulary that does not divide 2 ranks' padded slices evenly


def reference(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    weights = {
        "embed": torch.randn(VOCAB, WIDTH, generator=g),
        "w1": torch.randn(HIDDEN, WIDTH, generator=g),
        "b1": torch.randn(HIDDEN, generator=g),
        "w2": torch.randn(WIDTH, HIDDEN, generator=g),
        "b2": torch.randn(WIDTH, generator=g),
        "head": torch.randn(VOCAB, WIDTH, generator=g),
    }
    ids = torch.randint(0, VOCAB, (2, TOKENS), generator=g)
    target = torch.randint(0, VOCAB, (2, TOKENS), generator=g)
    return weights, ids, target


def forward(embed, column, row, head, ids, target):
    x = embed(ids)
    y = x + row(F.gelu(column(x)))
    logits = head(y)
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1)), logits


def layers_worker() -> dict:
    from zeroshard import comm
    from zeroshard.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        VocabParallelHead,
    )

    group = comm.tensor_parallel_group(2)
    rank = group.rank
    weights, ids, target = reference()
    half, per = HIDDEN // 2, -(-VOCAB // 2)
    rows = slice(rank * per, min((rank + 1) * per, VOCAB))

    def padded(w):
        return torch.cat([w, w.new_zeros(per - w.shape[0], *w.shape[1:])])

    embed = VocabParallelEmbedding(padded(weights["embed"][rows]), rows.start, rows.stop, group)
    column = ColumnParallelLinear(
        weights["w1"][rank * half : (rank + 1) * half], weights["b1"][rank * half : (rank + 1) * half], group
    )
    row = RowParallelLinear(weights["w2"][:, rank * half : (rank + 1) * half], weights["b2"], group)
    head = VocabParallelHead(padded(weights["head"][rows]), None, VOCAB, group)
    params = [embed.weight, column.weight, column.bias, row.weight, row.bias, head.weight]
    for p in params:
        p.requires_grad_(True)
    before = group.context.ledger.summary()
    loss, logits = forward(embed, column, row, head, ids, target)
    loss.backward()
    calls = {op: t.calls for (op, _), t in group.context.ledger.summary().items()}
    assert not before
    return {
        "loss": loss.item(),
        "logits": logits.detach(),
        "grads": [p.grad.clone() for p in params],
        "rows": (rows.start, rows.stop),
        "calls": calls,
    }


def test_tensor_parallel_layers_match_one_process_forward_and_backward():
    per_rank = run_distributed(layers_worker, 2)
    weights, ids, target = reference()
    full = {k: v.clone().requires_grad_(True) for k, v in weights.items()}
    loss, logits = forward(
        lambda i: F.embedding(i, full["embed"]),
        lambda x: F.linear(x, full["w1"], full["b1"]),
        lambda h: F.linear(h, full["w2"], full["b2"]),
        lambda y: F.linear(y, full["head"]),
        ids,
        target,
    )
    loss.backward()
    half = HIDDEN // 2
    for rank, got in enumerate(per_rank):
        assert abs(got["loss"] - loss.item()) <= 1e-6 * abs(loss.item())
        assert torch.allclose(got["logits"], logits.detach(), rtol=1e-5, atol=1e-6)
        embed, w1, b1, w2, b2, head = got["grads"]
        start, stop = got["rows"]
        cols = slice(rank * half, (rank + 1) * half)
        expected = [
            (embed[: stop - start], full["embed"].grad[start:stop]),
            (w1, full["w1"].grad[cols]),
            (b1, full["b1"].grad[cols]),
            (w2, full["w2"].grad[:, cols]),
            (b2, full["b2"].grad),
            (head[: stop - start], full["head"].grad[start:stop]),
        ]
        for mine, theirs in expected:
            assert torch.allclose(mine, theirs, rtol=1e-5, atol=1e-6)
        assert not embed[stop - start :].any() and not head[stop - start :].any()  # padding rows get nothing
        # forward: the embedding's and the row layer's all-reduce, the head's all-gather; backward: the column
        # layer's and the head's input gradients all-reduced
        assert got["calls"] == {"all_reduce": 4, "all_gather": 1}


FAMILIES = ("llama", "gpt2", "qwen3")


def _tiny(family: str):
    from transformers import GPT2Config, GPT2LMHeadModel

    from zeroshard.testing.hf import tiny_causal_lm

    if family != "gpt2":
        return tiny_causal_lm(family)
    torch.manual_seed(0)
    dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}  # the same computation on every rank
    shape = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(GPT2Config(**shape, **dropout))


def _train(model, steps: int = 3) -> list[float]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (steps, 2, 12), generator=g)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for batch in ids:  # every rank of a tensor-parallel group sees the same batch
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def hf_training_worker() -> dict:
    import zeroshard

    out = {}
    for family in FAMILIES:
        model = _tiny(family)
        before = {id(p) for p in model.parameters()}
        zeroshard.tp_model_init(model, tp_size=2, dtype=torch.float32)
        assert {id(p) for p in model.parameters()} <= before  # the model's own parameter objects, sliced
        losses = _train(model)
        state = {n: p.detach().clone() for n, p in model.named_parameters()}
        out[family] = {"losses": losses, "state": state}
    return out


def test_tp_model_init_trains_hf_models_like_one_process():
    """Llama with grouped-query attention, GPT-2 with its fused c_attn and tied head, Qwen3 whose per-head norms
    get their gradients summed over the group (without that, they drift apart: the replicated check fails)."""
    per_rank = run_distributed(hf_training_worker, 2)
    for family in FAMILIES:
        reference = _tiny(family)
        expected = _train(reference)
        full = dict(reference.named_parameters())
        for rank, got in enumerate(per_rank):
            mine = got[family]
            assert mine["losses"] == pytest.approx(expected, rel=1e-5)
            for name, value in mine["state"].items():
                whole = full[name].detach()
                if value.shape == whole.shape:  # replicated: identical to the reference's
                    assert torch.allclose(value, whole, rtol=1e-5, atol=1e-6), name
                elif family != "gpt2" and name.endswith(("q_proj.weight", "up_proj.weight")):  # column: rows
                    rows = whole.shape[0] // 2
                    assert torch.allclose(value, whole[rank * rows : (rank + 1) * rows], rtol=1e-5, atol=1e-6)
                elif family != "gpt2" and name.endswith(("o_proj.weight", "down_proj.weight")):  # row: columns
                    cols = whole.shape[1] // 2
                    assert torch.allclose(value, whole[:, rank * cols : (rank + 1) * cols], rtol=1e-5, atol=1e-6)


# -- tensor parallelism inside ZeRO: zeroshard.initialize with tensor_parallel.autotp_size ------------------------
STEPS, GLOBAL_BATCH, SEQ = 5, 4, 12
LR, CLIP = 1e-3, 0.5
TP_STAGES = (0, 1, 2, 3)
TP_LAYOUTS = (2, 4)  # TP=2 x DP=2 and TP=4 x DP=1 on 4 ranks


def _tp_model(family: str, tp: int):
    """The family's tiny model; at TP=4 with 8 query / 4 key-value heads (grouped-query attention still), since
    every rank holds whole key-value heads."""
    if family == "gpt2" or tp == 2:
        return _tiny(family)
    from zeroshard.testing.hf import tiny_causal_lm

    return tiny_causal_lm(family, num_attention_heads=8, num_key_value_heads=4, head_dim=4)


def _tp_batches() -> torch.Tensor:
    return torch.randint(0, 64, (STEPS, GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def _tp_config(stage: int, tp: int, dtype: str = "fp32") -> dict:
    """``dtype``: fp32, bf16, fp16 (dynamic loss scale), offload (fp32 with the optimizer state on the host), or lamb
    (fp32 with Lamb, whose trust ratios need each split matrix's whole norms)."""
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if dtype == "offload":
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // (4 // tp),
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "Lamb" if dtype == "lamb" else "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == "bf16"},
        "fp16": {"enabled": dtype == "fp16", "initial_scale_power": 8},
        "tensor_parallel": {"autotp_size": tp},
    }


def tp_zero_worker(cases: list[tuple], directory: str) -> dict:
    import zeroshard
    from zeroshard.tensor_parallel import tensor_splits

    out = {"checkpoints": tp_checkpoint_worker(directory), "groups": tp_groups_worker()}
    batches = _tp_batches()
    for family, tp, stage, dtype in cases:
        model = _tp_model(family, tp)
        engine, *_ = zeroshard.initialize(model=model, config=_tp_config(stage, tp, dtype))
        dp, per = engine.mesh.batch.rank, GLOBAL_BATCH // engine.dp_world_size
        losses, norms = [], []
        for step, batch in enumerate(batches):
            if step == 1:
                engine.comm_ledger.reset()  # steady-state steps: the first one also checked the batch
            local = batch[dp * per : (dp + 1) * per]
            loss = engine(input_ids=local, labels=local).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            norms.append(engine.get_global_grad_norm())
        traffic = {f"{op}/{g}": (t.calls, t.bytes, t.wire_bytes) for (op, g), t in engine.comm_ledger.summary().items()}
        splits = tensor_splits(engine.module)
        replicated = {
            name: engine.param_access.full_fp32_param(p).clone()
            for name, p in engine.module.named_parameters()
            if name not in splits
        }
        out[(family, tp, stage, dtype)] = {
            "losses": losses,
            "norms": norms,
            "state": engine.consolidated_state_dict(rank0_only=True),
            "replicated": replicated,
            "autotp_size": engine.autotp_size(),
            "ledger": traffic,
            "state_bytes": engine.state_bytes(),
        }
        engine.destroy()
    return out


def _tp_reference(family: str, tp: int, dtype: str = "fp32") -> dict:
    model = _tp_model(family, tp)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("sdpa")
    if dtype == "lamb":
        from zeroshard.optim import Lamb

        optimizer = Lamb(model.parameters(), lr=LR, weight_decay=0.01)  # one process: each parameter whole
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses, norms = [], []
    for batch in _tp_batches():
        halves = batch.chunk(4 // tp)  # the data-parallel ranks' batches: the engine averages their mean losses
        loss = sum(model(input_ids=h, labels=h).loss for h in halves) / len(halves)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "state": {n: p.detach() for n, p in model.named_parameters()}}


TP_CASES = [(family, tp, stage, "fp32") for family in FAMILIES for tp in TP_LAYOUTS for stage in TP_STAGES]
TP_CASES += [("llama", 2, 2, "bf16"), ("qwen3", 2, 1, "fp16"), ("llama", 2, 3, "offload"), ("gpt2", 4, 2, "offload")]
TP_CASES += [("llama", 2, stage, "lamb") for stage in TP_STAGES] + [("gpt2", 4, 3, "lamb")]


@pytest.fixture(scope="module")
def tp_directory(tmp_path_factory):
    return tmp_path_factory.mktemp("tensor-parallel")


@pytest.fixture(scope="module")
def tp_runs(tp_directory):
    return run_distributed(tp_zero_worker, 4, TP_CASES, str(tp_directory), timeout_s=900)


@pytest.mark.parametrize("case", TP_CASES, ids=["-".join(map(str, c)) for c in TP_CASES])
def test_tensor_parallel_inside_zero_matches_one_process(tp_runs, case):
    """Step-0 loss within 1e-6, gradient norms before clipping within 1e-5, parameters after 5 AdamW steps within
    1e-5 (bf16: 1e-2); the replicated parameters identical on every rank of a tensor-parallel group."""
    family, tp, stage, dtype = case
    expected = _tp_reference(family, tp, dtype)
    tol = 1e-5 if dtype in ("fp32", "offload", "lamb") else 2e-2
    leaders = [tp_runs[d * tp][case] for d in range(4 // tp)]  # tensor-parallel rank 0 of each data-parallel rank
    mean_losses = [sum(r["losses"][i] for r in leaders) / len(leaders) for i in range(STEPS)]
    assert mean_losses[0] == pytest.approx(expected["losses"][0], rel=1e-6 if tol < 1e-4 else 1e-2)
    assert tp_runs[0][case]["norms"] == pytest.approx(expected["norms"], rel=tol)
    state = tp_runs[0][case]["state"]
    assert set(state) >= set(expected["state"])
    from zeroshard.testing.parity import model_error

    assert model_error(state, expected["state"]) < tol
    for rank in range(1, tp):  # same tensor-parallel group as rank 0
        for name, value in tp_runs[rank][case]["replicated"].items():
            assert torch.equal(value, tp_runs[0][case]["replicated"][name]), name
    assert all(r[case]["autotp_size"] == tp for r in tp_runs)


def _local_elements(family: str, tp: int) -> tuple[dict[str, list[int]], int, list[int]]:
    """Per gather unit (each decoder layer, and the root for the rest): this rank's [replicated, split / tp]
    elements; tensor-parallel all-reduces of one activation per step; the sizes of the per-head norms' weights whose
    gradients are summed over the group."""
    import re

    from zeroshard.tensor_parallel import plan_tensor_parallel

    model = _tp_model(family, tp)
    plan = plan_tensor_parallel(model, tp, split_vocabulary=False)
    split = {f"{layer.name}.weight" for layer in plan.layers}
    split |= {f"{layer.name}.bias" for layer in plan.layers if layer.style == "column"}
    units: dict[str, list[int]] = {}
    for name, param in model.named_parameters():
        layer = re.match(r"(.*\.(?:layers|h)\.\d+)\.", name)
        counts = units.setdefault(layer.group(1) if layer else "<root>", [0, 0])
        counts[name in split] += param.numel() // (tp if name in split else 1)
    # forward: one all-reduce per row layer's output; backward: one per column layer's input gradient
    summed = [p.numel() for name in plan.grad_allreduce for p in model.get_submodule(name).parameters()]
    return units, len(plan.layers), summed


@pytest.mark.parametrize("case", [c for c in TP_CASES if c[3] == "fp32"], ids=str)
def test_tensor_parallel_bytes_equal_the_analytic_values(tp_runs, case):
    """Per steady-state step: the tensor-parallel all-reduces (activations and the per-head norms' gradients, plus
    the norm's partial sum) and ZeRO's traffic over the data-parallel group for replicated + split/t elements (stage
    3: every decoder layer gathered twice but the last, the root once, everything reduce-scattered once); model-state
    bytes per rank: the same elements, /dp where ZeRO shards them. Exactly."""
    family, tp, stage, _ = case
    dp, elem, steps = 4 // tp, 4, STEPS - 1
    units, activations, summed = _local_elements(family, tp)
    local = [sum(u[kind] for u in units.values()) for kind in (0, 1)]  # stages 0-2: one flat group per kind
    ledger = tp_runs[0][case]["ledger"]
    activation = GLOBAL_BATCH // dp * SEQ * 32 * elem  # one [batch, sequence, hidden] tensor
    # + one all-reduce per summed norm weight (Qwen3's q_norm, k_norm), + the gradient norm's split part
    calls = activations + len(summed) + 1
    tensor = steps * (activations * activation + sum(summed) * elem + elem)
    assert ledger.pop("all_reduce/tensor")[:2] == (steps * calls, tensor)
    ring = (dp - 1) / dp
    padded = {name: sum(math.ceil(n / dp) * dp for n in kinds) for name, kinds in units.items()}
    if stage == 3:
        last = [name for name in padded if name != "<root>"][-1]  # the last decoder layer stays gathered too
        gathers = 2 * sum(padded.values()) - padded["<root>"] - padded[last]  # the root stays gathered throughout
        wire = steps * ((gathers + sum(padded.values())) * elem * ring + 2 * ring * 8)
        assert sum(w for _, _, w in ledger.values()) == pytest.approx(wire, rel=1e-12)
        held = sum(padded.values()) // dp
    else:
        expected = {}
        if dp > 1 and stage == 0:
            expected["all_reduce/gradient"] = (steps * 2, steps * sum(local) * elem)
        elif dp > 1:
            flats = sum(math.ceil(n / dp) * dp for n in local)
            expected["reduce_scatter/shard"] = (steps * 2, steps * flats * elem)
            expected["all_gather/shard"] = (steps * 2, steps * flats * elem)
            expected["all_reduce/shard"] = (steps, steps * 2 * 4)  # (split, replicated) squared norms
        assert {k: v[:2] for k, v in ledger.items()} == expected
        for key, (_, message, wire) in ledger.items():
            factor = 2 if key.startswith("all_reduce") else 1
            assert wire == pytest.approx(factor * ring * message, rel=1e-12)
        held = sum(local) if stage == 0 else sum(math.ceil(n / dp) for n in local)
    state = tp_runs[0][case]["state_bytes"]
    # fp32 master weights: their own shards below stage 3, the compute shards themselves at stage 3
    assert state["master"] + (state["params"] if stage == 3 else 0) == 4 * held
    assert state["optimizer_state"] == 8 * held


def tp_refusals_worker() -> dict:
    import warnings

    import zeroshard
    from zeroshard.runtime.batch_check import BatchMismatchError
    from zeroshard.tensor_parallel import PlacementError
    from zeroshard.testing.hf import tiny_causal_lm

    def config(**block):
        base = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": LR}}}
        return {**base, **({"tensor_parallel": block} if block else {})}

    out, batch = {}, _tp_batches()[0][:2]
    rank = zeroshard.comm.get_rank()

    def caught(fn, kind):
        try:
            fn()
        except kind as err:
            return str(err)
        return None

    engine, *_ = zeroshard.initialize(model=tiny_causal_lm("llama"), config=config(autotp_size=2))
    out["config_loss"] = engine(input_ids=batch, labels=batch).loss.item()
    engine.destroy()
    # the legacy order: tp_model_init first; initialize adopts its split (with or without the config block)
    for block in ({"autotp_size": 2}, {}):
        model = zeroshard.tp_model_init(tiny_causal_lm("llama"), tp_size=2, dtype=torch.float32)
        engine, *_ = zeroshard.initialize(model=model, config=config(**block))
        out[f"legacy_loss_{bool(block)}"] = engine(input_ids=batch, labels=batch).loss.item()
        engine.step()  # no backward: nothing to apply, but the engine is usable
        out[f"legacy_size_{bool(block)}"] = engine.autotp_size()
        engine.destroy()
    model = zeroshard.tp_model_init(tiny_causal_lm("llama"), tp_size=2)
    out["disagree"] = caught(lambda: zeroshard.initialize(model=model, config=config(autotp_size=1)), ValueError)
    engine, *_ = zeroshard.initialize(model=tiny_causal_lm("llama"), config=config(autotp_size=2))
    other = _tp_batches()[1][:2]
    out["mismatch"] = caught(lambda: engine(input_ids=batch if rank == 0 else other), BatchMismatchError)
    engine.destroy()
    uneven = tiny_causal_lm("llama", hidden_size=24, num_attention_heads=3, num_key_value_heads=3)
    out["uneven"] = caught(lambda: zeroshard.initialize(model=uneven, config=config(autotp_size=2)), PlacementError)
    out["indivisible"] = caught(lambda: zeroshard.comm.ParallelDims.for_world(2, tp=3), ValueError)
    with zeroshard.zero.Init():
        lazy = tiny_causal_lm("llama")
    out["zero_init"] = caught(
        lambda: zeroshard.initialize(model=lazy, config=config(autotp_size=2)), NotImplementedError
    )
    with warnings.catch_warnings(record=True) as seen:  # the HF Trainer's count: world x micro x accumulation
        warnings.simplefilter("always")
        counted = {**config(autotp_size=2), "train_batch_size": 4, "gradient_accumulation_steps": 1}
        engine, *_ = zeroshard.initialize(model=tiny_causal_lm("llama"), config=counted)
    out["corrected_batch"] = (
        engine.train_batch_size(),
        [str(w.message) for w in seen if "counted all" in str(w.message)],
    )
    engine.destroy()
    out.update(_spec_refusals(config, caught))
    out.update(_optimizer_refusals(config, caught))
    return out


def _optimizer_refusals(config, caught) -> dict:
    """Under tensor parallelism an optimizer is refused only where its declared needs cannot be met (1-bit LAMB);
    Muon, AdamW and Lamb (test_tensor_parallel_inside_zero_...) are built."""
    import zeroshard
    from zeroshard.testing.hf import tiny_causal_lm

    def with_optimizer(kind: str, **params) -> dict:
        return {**config(autotp_size=2), "optimizer": {"type": kind, "params": {"lr": LR, **params}}}

    def refused(cfg: dict, optimizer=None) -> str:
        model = tiny_causal_lm("llama")
        client = optimizer(model) if optimizer is not None else None
        return caught(lambda: zeroshard.initialize(model=model, config=cfg, optimizer=client), NotImplementedError)

    plain = config(autotp_size=2)
    plain.pop("optimizer")
    return {
        "muon": refused(with_optimizer("Muon")),
        "onebit_lamb": refused({**with_optimizer("OneBitLamb"), "zero_optimization": {"stage": 0}}),
        "torch_muon": refused(plain, lambda m: torch.optim.Muon([p for p in m.parameters() if p.dim() == 2])),
        "adamw": refused(with_optimizer("AdamW")),
    }


def _spec_refusals(config, caught) -> dict:
    """Layer specs that leave the model inconsistent are refused at initialize (before: the first forward failed
    with "mat1 and mat2 shapes cannot be multiplied"); a spec matching an embedding or a norm is named as ignored;
    a pattern that backtracks without bound is refused by the config (before: initialize ran for minutes)."""
    import warnings

    import zeroshard
    from zeroshard.tensor_parallel import PlacementError
    from zeroshard.testing.hf import tiny_causal_lm

    def specs(*entries):
        return config(autotp_size=2, partition_config={"layer_specs": [dict(e) for e in entries]})

    def refused(*entries):
        model = tiny_causal_lm("llama")
        return caught(lambda: zeroshard.initialize(model=model, config=specs(*entries)), PlacementError)

    out = {
        "all_column": refused({"patterns": [".*"], "partition_type": "column"}),
        "all_row": refused({"patterns": [".*"], "partition_type": "row"}),
        "q_row": refused({"patterns": [r".*\.q_proj$"], "partition_type": "row"}),
        "redos": caught(
            lambda: zeroshard.initialize(model=tiny_causal_lm("llama"), config=specs({"patterns": ["(.*.*)*Z"]})),
            ValueError,
        ),
    }
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        norm = {"patterns": [r".*embed_tokens$", r".*input_layernorm$"], "partition_type": "column"}
        engine, *_ = zeroshard.initialize(model=tiny_causal_lm("llama"), config=specs(norm))
    batch = _tp_batches()[0][:2]
    out["ignored"] = [str(w.message) for w in seen if "stay replicated" in str(w.message)]
    out["ignored_trains"] = bool(torch.isfinite(engine(input_ids=batch, labels=batch).loss))
    engine.destroy()
    return out


@pytest.fixture(scope="module")
def tp_refusals() -> list:
    return run_distributed(tp_refusals_worker, 2)


def test_tensor_parallel_refusals_and_the_legacy_order(tp_refusals):
    """tp_model_init before initialize (OpenRLHF, the HF Trainer) gives the same model as the config alone; a size
    that disagrees, different batches in one group, heads that do not divide, zero.Init, a degree that does not
    divide the ranks: each a named error on every rank, no hang; a batch size that counted every rank is corrected
    with a warning."""
    for rank, out in enumerate(tp_refusals):
        assert out["legacy_loss_True"] == out["config_loss"] == out["legacy_loss_False"]
        assert out["legacy_size_True"] == out["legacy_size_False"] == 2
        assert "tensor_parallel.autotp_size is 1" in out["disagree"]
        assert "rank 0 and rank 1 of tensor-parallel group [0, 1] got different batches" in out["mismatch"]
        assert "num_attention_heads = 3 is not divisible by tp_size 2" in out["uneven"]
        assert "autotp_size 3 must divide the number of ranks 2" in out["indivisible"]
        assert "zero.Init with tensor_parallel.autotp_size > 1" in out["zero_init"]
        batch, warned = out["corrected_batch"]
        assert batch == 2 and len(warned) == 1 and "train_batch_size 4 -> 2" in warned[0], (rank, warned)


def test_only_what_the_optimizer_contract_cannot_meet_is_refused_under_tensor_parallelism(tp_refusals):
    """Muon (by name and torch's) gets whole matrices from the layout and trains (tests/distributed/test_muon.py);
    1-bit LAMB, which averages whole tensors itself, is refused from its declared needs."""
    for out in tp_refusals:
        message = out["onebit_lamb"]
        assert "optimizer OneBitLamb with tensor parallelism (tensor_parallel.autotp_size 2)" in message, message
        assert "it averages whole tensors itself" in message and "Use OneBitAdam or AdamW" in message
        assert out["muon"] is None and out["torch_muon"] is None and out["adamw"] is None


def test_layer_specs_that_cannot_work_are_refused_at_initialize(tp_refusals):
    for out in tp_refusals:
        assert "with column-parallel layers" in out["all_column"] and "no row-parallel layer" in out["all_column"]
        assert "with row-parallel layers" in out["all_row"] and "no column-parallel layer" in out["all_row"]
        assert "a forward of 4 tokens fails" in out["q_row"] and "layer_specs" in out["q_row"]
        assert "'(.*.*)*Z' can take exponential time" in out["redos"]
        assert len(out["ignored"]) == 1 and "embed_tokens (Embedding)" in out["ignored"][0], out["ignored"]
        assert "input_layernorm (LlamaRMSNorm)" in out["ignored"][0] and out["ignored_trains"]


# -- checkpoints across tensor-parallel degrees ----------------------------------------------------------------------
SAVED_AT, RESUMED = 3, 2  # steps before the save, steps after the load


def _train_engine(engine, batches) -> None:
    dp, per = engine.mesh.batch.rank, GLOBAL_BATCH // engine.dp_world_size
    for batch in batches:
        local = batch[dp * per : (dp + 1) * per]
        engine.backward(engine(input_ids=local, labels=local).loss)
        engine.step()


def _resume(family: str, directory: str, tp: int, stage: int) -> dict:
    """Load the TP=2 x DP=2 checkpoint at ``tp`` x (world / tp) and ``stage``, train the remaining steps."""
    import zeroshard

    engine, *_ = zeroshard.initialize(model=_tp_model(family, 4), config=_tp_config(stage, tp))
    engine.load_checkpoint(directory, tag=family)
    loaded = engine.consolidated_state_dict(rank0_only=True)
    _train_engine(engine, _tp_batches()[SAVED_AT : SAVED_AT + RESUMED])
    state = engine.consolidated_state_dict(rank0_only=True)
    engine.destroy()
    return {"loaded": loaded, "resumed": state}


def tp_checkpoint_worker(directory: str) -> dict:
    """On 4 ranks: per family, an uninterrupted TP=2 x DP=2 run; one saved after 3 steps (and its 16-bit weights);
    that checkpoint resumed at TP=1 x DP=4 (stage 3) and TP=4 x DP=1 (stage 1). The models have 8 query / 4
    key-value heads, so every degree holds whole heads."""
    import os

    import zeroshard

    batches, out = _tp_batches(), {}
    for family in ("llama", "gpt2"):
        engine, *_ = zeroshard.initialize(model=_tp_model(family, 4), config=_tp_config(2, 2))
        _train_engine(engine, batches[: SAVED_AT + RESUMED])
        uninterrupted = engine.consolidated_state_dict(rank0_only=True)
        engine.destroy()
        engine, *_ = zeroshard.initialize(model=_tp_model(family, 4), config=_tp_config(2, 2))
        _train_engine(engine, batches[:SAVED_AT])
        engine.save_checkpoint(directory, tag=family)
        weights = os.path.join(directory, f"{family}-16bit")
        engine.save_16bit_model(weights)
        if zeroshard.comm.get_rank() == 0:
            engine.module.config.save_pretrained(weights)
        saved = engine.consolidated_state_dict(rank0_only=True)
        engine.destroy()
        out[family] = {
            "uninterrupted": uninterrupted,
            "saved": saved,
            "tp1": _resume(family, directory, 1, 3),
            "tp4": _resume(family, directory, 4, 1),
        }
    return out


def tp_resume_worker(directory: str) -> dict:
    """On 2 ranks: the TP=2 x DP=2 checkpoint at TP=2 x DP=1 (stage 0)."""
    return {family: _resume(family, directory, 2, 0) for family in ("llama", "gpt2")}


def _close(actual: dict, expected: dict, rel: float) -> bool:
    from zeroshard.testing.parity import model_error

    return set(actual) == set(expected) and model_error(actual, expected) <= rel


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_checkpoints_resume_at_other_tensor_parallel_degrees(tp_runs, tp_directory, family):
    """Saved at TP=2 x DP=2: loaded at TP=1 x DP=4 (stage 3), TP=4 x DP=1 (stage 1) and TP=2 x DP=1 (stage 0), the
    weights are the saved ones exactly and continued training stays within 1e-6 of the uninterrupted run;
    consolidation and save_16bit_model give full weights that from_pretrained loads (GPT-2's fused, transposed
    c_attn included)."""
    import transformers

    from zeroshard.checkpoint import get_fp32_state_dict_from_zero_checkpoint

    runs = tp_runs[0]["checkpoints"][family]
    on_two = run_distributed(tp_resume_worker, 2, str(tp_directory))[0][family]
    for name, resumed in (("tp1", runs["tp1"]), ("tp4", runs["tp4"]), ("tp2 on 2 ranks", on_two)):
        for key, value in runs["saved"].items():
            assert torch.equal(resumed["loaded"][key], value), (name, key)
        assert _close(resumed["resumed"], runs["uninterrupted"], 1e-6), name
    consolidated = get_fp32_state_dict_from_zero_checkpoint(tp_directory, tag=family)
    for key, value in runs["saved"].items():
        assert torch.equal(consolidated[key], value), key
    model_class = transformers.LlamaForCausalLM if family == "llama" else transformers.GPT2LMHeadModel
    loaded = model_class.from_pretrained(tp_directory / f"{family}-16bit").state_dict()
    assert set(loaded) >= set(runs["saved"])
    for key, value in runs["saved"].items():
        assert torch.equal(loaded[key], value), key


def tp_groups_worker() -> dict:
    """DeepSpeed's names on 4 ranks at TP=2 x DP=2: the config, tp_model_init with the config, the group getters, the
    engine's size and the consolidated 16-bit state dict Accelerate saves through."""
    import torch.distributed as dist

    import zeroshard.compat.deepspeed as deepspeed
    from zeroshard.compat.deepspeed.utils import groups

    deepspeed.set_autotp_mode(training=True)
    config = _tp_config(1, 2)
    model = deepspeed.tp_model_init(_tp_model("llama", 2), tp_size=2, dtype=torch.float32, config=config)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    tensor, data = groups.get_tensor_model_parallel_group(), groups.get_data_parallel_group()
    out = {
        "tensor": (groups.get_tensor_model_parallel_world_size(), groups.get_tensor_model_parallel_rank()),
        "data": (groups.get_data_parallel_world_size(), groups.get_data_parallel_rank()),
        "model": (groups.get_model_parallel_world_size(), groups.get_tensor_model_parallel_src_rank()),
        "handles": (dist.get_process_group_ranks(tensor), dist.get_process_group_ranks(data)),
        "same": groups.get_model_parallel_group() is tensor,
        "autotp_size": engine.autotp_size(),
        "consolidated": sorted(engine._consolidated_16bit_state_dict().items()),
        "shapes": {n: tuple(p.shape) for n, p in engine.module.named_parameters()},
    }
    engine.destroy()
    return out


def test_deepspeed_names_for_tensor_parallel_training(tp_runs):
    """Ranks laid out as DeepSpeed does: tensor-parallel groups consecutive, data-parallel groups strided."""
    full = dict(_tp_model("llama", 2).named_parameters())
    for rank, out in enumerate(r["groups"] for r in tp_runs):
        assert out["tensor"] == (2, rank % 2) and out["data"] == (2, rank // 2)
        assert out["model"] == (2, rank - rank % 2) and out["same"] and out["autotp_size"] == 2
        assert out["handles"] == ([rank - rank % 2, rank - rank % 2 + 1], [rank % 2, rank % 2 + 2])
        assert out["shapes"]["model.layers.0.self_attn.q_proj.weight"] == (16, 32)  # 4 heads of 8: 2 per rank
        consolidated = dict(out["consolidated"])
        if rank == 0:  # whole weights, as the model defines them
            assert {n: tuple(t.shape) for n, t in consolidated.items()} == {n: tuple(p.shape) for n, p in full.items()}
        else:
            assert consolidated == {}
