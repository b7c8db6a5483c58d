"""Model-state bytes from the engine's own plan (``zeroshard.zero.planning.plan_model``): parameters, gradient
shards, master weights and optimizer state, gathered units and communication buffers, by where they live.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn as nn

from ..zero.stage3.schedule import GatherSchedule
from .result import MemoryEstimate


class ModelState:
    """The engine's flat-group plan for one rank, on a meta model."""

    def __init__(
        self, model: nn.Module, cfg, policy, offload, shard_count: int, tensor_splits=None, expert_parallel: int = 1
    ):
        from ..zero.planning import plan_model

        z = cfg.zero_optimization
        self.cfg, self.policy, self.offload = cfg, policy, offload
        groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
        # the engine's own planning (``tensor_splits``: this rank's experts, sharded over the ranks holding them)
        expert_shards = shard_count // expert_parallel  # the ranks holding the same experts (no tensor folding)
        planned = plan_model(
            model, groups, z, shard_count, tensor_splits=tensor_splits or {}, expert_shard_count=expert_shards
        )
        self.stage, self.shard_count = planned.stage, planned.shard_count
        self.plans, self.frozen_plans = planned.trainable, planned.frozen
        self.layouts, self.frozen_layouts = planned.layouts[: len(self.plans)], planned.layouts[len(self.plans) :]
        unit_of = self.unit_of = {p: i for i, u in enumerate(planned.units) for p in u.params}
        # gathered elements per unit (index 0: the root), trainable and frozen flat groups together
        self.unit_numel: dict[int, int] = {}
        for plan, layout in zip(self.plans + self.frozen_plans, self.layouts + self.frozen_layouts):
            if not plan.resident:
                index = unit_of[plan.params[0]]
                self.unit_numel[index] = self.unit_numel.get(index, 0) + layout.padded_numel
        # the units kept gathered from their forward into their backward, forward taken to run them in the order
        # the model defines them (reuse distance: Note [reuse distance] in zero/stage3/schedule.py)
        order = sorted(i for i in self.unit_numel if i != 0)
        schedule = GatherSchedule(order, self.unit_numel.__getitem__, z.max_reuse_distance)
        self.kept_units = {unit for position, unit in enumerate(order) if schedule.keeps(position)}
        in_flats = {p for plan in self.plans + self.frozen_plans for p in plan.params}
        self.outside = sum(p.numel() for p in model.parameters() if p not in in_flats)
        self.state_tensors = _optimizer_state_tensors(cfg, z.stage)

    def count_model_state(self, out: MemoryEstimate) -> None:
        from ..comm.compression import INT8
        from ..zero.planning import QuantizedComm

        compute = element_size(self.policy.compute)
        grad = element_size(self.policy.grad)
        opt_home = "host" if self.offload.optimizer_device == "cpu" else self.offload.optimizer_device
        opt_home = "device" if opt_home == "none" else opt_home
        param_home = {"none": "device", "cpu": "host", "nvme": "nvme"}[self.offload.param_device]
        kept = self.kept = self._kept_on_device(out)  # offload_optimizer.ratio: their optimizer state stays here
        b = out.bytes
        in_cpu = 0  # offload_param nvme: shards are kept in host memory while they fit max_in_cpu (ShardHomes.place)
        # the shards placed in the parameter swap file: (elements, read once a step, the optimizer's master)
        self.nvme_shards: list[tuple[int, bool, bool]] = []

        def shard_home(numel: int, plan, offloaded: bool) -> str:
            nonlocal in_cpu
            if param_home == "nvme" and in_cpu + numel <= self.offload.max_in_cpu:
                in_cpu += numel
                return "host"
            if param_home == "nvme":
                # NvmeState: an fp32 shard on NVMe that is one optimizer sub-group is its own master
                master = offloaded and opt_home == "nvme" and self.policy.compute == torch.float32
                master = master and numel <= self.offload.sub_group_size
                unit = self.unit_of[plan.params[0]]
                self.nvme_shards.append((numel, unit == 0 or unit in self.kept_units, master))
            return param_home

        self.spilled: list[bool] = []  # per trainable flat group: its gradient waits in the optimizer swap file
        self.shared_master: list[bool] = []  # per trainable flat group: its NVMe shard is the optimizer's master
        for index, (plan, layout) in enumerate(zip(self.plans, self.layouts)):
            shard, where = layout.shard_numel, "device" if index in kept else opt_home
            home = "device" if plan.resident else shard_home(shard, plan, where != "device")
            b["parameters"][home] += (layout.padded_numel if plan.resident else shard) * compute
            # on the device an fp32 master is the shard itself, unless the shard lives elsewhere (offload_param)
            master_aliased = where == "device" and self.policy.compute == torch.float32
            master_aliased = master_aliased and (plan.resident or self.offload.param_device == "none")
            self.shared_master.append(home == "nvme" and where == "nvme" and self.nvme_shards[-1][2])
            if not (master_aliased or self.shared_master[-1]):
                b["optimizer_state"][where] += shard * 4
            # NvmeState.grad_home: the gradient goes where the parameter shard is (on disk in fp32), else host memory
            self.spilled.append(where == "nvme" and home == "nvme")
            if self.spilled[-1]:
                b["gradients"]["nvme"] += shard * 4
            else:
                b["gradients"]["host" if where == "nvme" else where] += shard * grad
            b["optimizer_state"][where] += shard * 4 * self.state_tensors
        quantized = QuantizedComm.from_config(self.cfg.zero_optimization)
        for plan, layout in zip(self.frozen_plans, self.frozen_layouts):
            if quantized.keeps_int8(plan):  # zero_quantized_nontrainable_weights: int8 plus block scales
                b["parameters"]["device"] += INT8.message_nbytes(layout.shard_numel)
            else:
                b["parameters"][shard_home(layout.shard_numel, plan, False)] += layout.shard_numel * compute
        b["parameters"]["device"] += self.outside * compute
        if in_cpu:
            out.notes.append(
                f"offload_param.max_in_cpu ({self.offload.max_in_cpu:.3g}) keeps {in_cpu * compute / 2**30:.2f} GiB "
                "of parameter shards in host memory (0 puts every shard on NVMe)"
            )

    def count_offload(self, out: MemoryEstimate) -> None:
        """NVMe offload: the host staging the swap files go through (bounded by the knobs, not the model), the
        transient buffer a bucket's gradient is accumulated in before it is written behind, and the disk bytes one
        optimizer step moves (``out.disk_per_step``; the engine's ``disk_io`` counts the same)."""
        from ..offload.aio import align_up

        offload, b = self.offload, out.bytes
        compute, keys = element_size(self.policy.compute), 1 + self.state_tensors  # master and the moments
        offloaded = [k not in self.kept for k in range(len(self.layouts))]  # offload_optimizer.ratio
        shards = [layout.shard_numel for layout, away in zip(self.layouts, offloaded) if away]
        spilled_of = [on_disk for on_disk, away in zip(self.spilled, offloaded) if away]
        shared_of = [shared for shared, away in zip(self.shared_master, offloaded) if away]
        read = written = 0

        def regions(numels: list[int]) -> int:  # bytes of one key's regions over the sub-groups of these shards
            step = offload.sub_group_size
            return sum(align_up(min(step, n - start) * 4) for n in numels for start in range(0, n, step))

        if offload.optimizer_device == "nvme" and shards:
            sub = min(max(shards), offload.sub_group_size)
            spilled = [n for n, on_disk in zip(shards, spilled_of) if on_disk]
            staging = offload.optimizer_buffer_count * (keys + bool(spilled)) * align_up(sub * 4)  # + the gradient
            b["optimizer_state"]["host"] += staging
            # the bucket's gradient accumulated before it is written behind: the pool keeps one per shard size
            b["communication_buffers"]["device"] += sum(set(spilled)) * element_size(self.policy.grad)
            # master and moments, read and written in the step; the spilled gradients written in backward, read back
            read += keys * regions(shards) + regions(spilled)
            written += keys * regions(shards) + regions(spilled)
            if offload.speculate is not False:  # the step during backward (on by default with NVMe)
                own = [n for n, shared in zip(shards, shared_of) if not shared]
                # the gradients' own 2 staging slots and buffer_count hand-off buffers (one more kept back)
                staging_more = (3 + offload.optimizer_buffer_count) * bool(spilled) * align_up(sub * 4)
                read += self._count_twins(out, keys * 4 * sum(shards), staging_more, own)
            if offload.sub_group_size >= 1e8 and staging > 2**30:
                out.notes.append(
                    f"sub_group_size ({offload.sub_group_size:.3g}) sizes the NVMe optimizer staging: "
                    f"{staging / 2**30:.2f} GiB of host memory ({offload.optimizer_buffer_count} buffers x "
                    f"{keys + bool(spilled)} tensors x {sub * 4 / 2**20:.0f} MiB); a smaller sub-group needs less"
                )
            if len(spilled) < len(shards):
                kept = sum(n for n, on_disk in zip(shards, spilled_of) if not on_disk)
                out.notes.append(
                    f"{kept * element_size(self.policy.grad) / 2**30:.2f} GiB of gradient shards wait in host memory "
                    "beside parameter shards kept there (offload_param nvme with max_in_cpu 0 puts both on disk)"
                )
        if self.nvme_shards:
            largest = max(n for n, *_ in self.nvme_shards)
            staged = align_up(min(offload.param_buffer_size, largest) * compute)  # O_DIRECT-aligned, as allocated
            b["parameters"]["host"] += offload.param_buffer_count * staged
            # gathered for forward and again for backward; the root unit and the kept ones once
            read += sum((1 if once else 2) * align_up(n * compute) for n, once, _ in self.nvme_shards)
            # the updated shards, but those the step wrote as the optimizer's master
            written += sum(align_up(n * compute) for n, _, master in self.nvme_shards if not master)
        out.disk_per_step = {"read": read, "written": written}
        z = self.cfg.zero_optimization
        if self.stage.partition_params and (offload.param_device != "none") and z.max_live_parameters >= 1e9:
            out.notes.append(
                "stage3_max_live_parameters / stage3_max_reuse_distance (1e9) let gathered units stay in memory "
                "between their uses; a model above 1e9 parameters wants a few units' worth of each"
            )

    def _kept_on_device(self, out: MemoryEstimate) -> frozenset[int]:
        """``offload_optimizer.ratio``: the flat groups whose optimizer state stays on the device, chosen as the
        engine chooses them (``zero.optimizer_home.kept_on_device``; ``"auto"`` against this machine's device),
        with a note saying so."""
        from ..zero.optimizer_home import kept_on_device

        offload = self.offload
        if offload.optimizer_device == "none" or offload.ratio == 1.0:
            return frozenset()
        numels = [layout.shard_numel for layout in self.layouts]
        kept = kept_on_device(numels, offload)
        share = 1 - sum(numels[k] for k in kept) / max(1, sum(numels))
        out.notes.append(
            f"offload_optimizer.ratio {offload.ratio}: {len(kept)} of {len(numels)} flat groups keep their optimizer "
            f"state on the device, the ones reduced last in backward; {share:.3f} of it is offloaded"
        )
        return kept

    def _count_twins(self, out: MemoryEstimate, twins: int, staging: int, own_masters: list[int]) -> int:
        """``super_offload`` with NVMe: a twin of every master and moment region (``twins`` bytes), the gradients'
        own staging slots and hand-off buffers while the step runs during backward (``staging``); returns the bytes a
        committed step reads more: a master that is not its parameter shard is read back to publish it. The disk
        bytes stay an upper bound: a gradient handed off in memory is not read back (Note [gradient hand-off])."""
        from ..offload.aio import align_up

        out.bytes["optimizer_state"]["nvme"] += twins
        out.bytes["optimizer_state"]["host"] += staging
        out.notes.append(
            f"offload_optimizer.super_offload (on by default with NVMe): the optimizer step runs during backward into "
            f"twin regions of the swap file, {twins / 2**30:.2f} GiB more disk (twice the optimizer state); set "
            "super_offload to false to keep one copy"
        )
        step = self.offload.sub_group_size
        return sum(align_up(min(step, n - start) * 4) for n in own_masters for start in range(0, n, step))

    def count_compression(self, out: MemoryEstimate) -> None:
        """A 1-bit optimizer's compression state after its warm-up (Note [1-bit reduction]): a worker and a
        server error covering each flat group (4 bytes per parameter; 0/1 Adam two and its local updates: 12),
        and 1-bit Adam's last averaged momentum as 1-bit messages (1/8 byte and a scale per 256 elements). Every
        rank then keeps its own whole gradient: at stages 1-3 the gradients grow from the shard to the flat."""
        from ..comm.compression import ONE_BIT

        name = self.cfg.optimizer.type.lower() if self.cfg.optimizer is not None else ""
        copies = {"onebitadam": 1, "onebitlamb": 1, "zerooneadam": 3}.get(name, 0)
        if not copies:
            return
        n = out.world_size
        chunks = [-(-layout.padded_numel // n) for layout in self.layouts]
        nbytes = 4 * copies * sum(chunk * n for chunk in chunks)
        if name == "onebitadam":
            nbytes += sum(n * ONE_BIT.message_nbytes(chunk) for chunk in chunks)
        out.bytes["communication_buffers"]["device"] += nbytes
        out.notes.append(f"1-bit compression state: {nbytes / max(out.params, 1):.2f} bytes per parameter")
        if self.stage.partition_optimizer:
            home = {"cpu": "host", "nvme": "nvme"}.get(self.offload.optimizer_device, "device")
            whole = sum(layout.padded_numel - layout.shard_numel for layout in self.layouts)
            out.bytes["gradients"][home] += whole * element_size(self.policy.grad)

    def count_buffers(self, out: MemoryEstimate, gloo: bool) -> None:
        """What ``ReusableBuffers`` holds at the busiest moment. It keeps buffers by size, so flat groups of each size
        count apart: gradient staging for the bucket being filled and, with ``overlap_comm``, the reductions in
        flight (``MAX_IN_FLIGHT``), each with Gloo's reduce-scatter scratch when it is sharded; under stage 3 also
        the root unit, the running unit and the prefetched ones."""
        from ..zero.reducer import MAX_IN_FLIGHT

        compute, reduce = element_size(self.policy.compute), element_size(self.policy.reduce)
        in_flight = MAX_IN_FLIGHT if self.cfg.zero_optimization.overlap_comm else 0
        staging = scratch = 0
        for numel, count in Counter(layout.padded_numel for layout in self.layouts).items():
            busy = min(count, in_flight + 1)
            staging += busy * numel * reduce
            if gloo and self.shard_count > 1:  # the other ranks' chunks of this rank's part
                scratch += busy * (numel // self.shard_count) * (self.shard_count - 1) * reduce
        out.bytes["communication_buffers"]["device"] += staging + scratch
        if not self.stage.partition_params:
            return
        z = self.cfg.zero_optimization
        sharded_units = [n for i, n in self.unit_numel.items() if i != 0]
        unit = max(sharded_units, default=0)
        ahead = min(
            z.prefetch_depth,
            z.prefetch_bucket_size // max(unit, 1),
            max(z.max_live_parameters // max(unit, 1) - 1, 0),
            max(len(sharded_units) - 1, 0),  # no more units ahead than the model has
        )
        # kept units stay until their backward: all of them at the turn from forward to backward, with backward's
        # first prefetch unless every unit is kept; keeping stops where the live budget would be exceeded
        kept = sum(self.unit_numel[i] for i in self.kept_units)
        at_turn = min(kept + (ahead * unit if len(self.kept_units) < len(sharded_units) else 0), z.max_live_parameters)
        gathered = self.unit_numel.get(0, 0) + max((1 + ahead) * unit, at_turn)
        out.bytes["gathered_units"]["device"] += gathered * compute


def _optimizer_state_tensors(cfg, stage: int) -> int:
    """How many per-element state tensors the configured optimizer keeps: stepped once on a 1 x 1 matrix (one
    element Muon's Newton-Schulz takes too)."""
    from ..optim import build_optimizer

    if cfg.optimizer is None:
        return 2  # a client optimizer: Adam's two, the common case
    param = nn.Parameter(torch.zeros(1, 1))
    param.grad = torch.zeros(1, 1)
    optimizer = build_optimizer(
        cfg.optimizer.type, cfg.optimizer.params, [{"params": [param]}], zero_stage=stage, allow_untested=True
    )
    optimizer.step()
    state = optimizer.state[param]
    return sum(1 for v in state.values() if torch.is_tensor(v) and v.numel() == 1 and v.dim() > 0)


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
