"""Gradients that check themselves: an opt-in test, at the step it happens, that the gradient reduction summed what
every rank's backward produced and divided it by the right count (config block ``gradient_check``).

Note [gradient check]. Reduction is linear. Let ``r`` be a random vector, the same on every rank (seeded by the
step, the flat group and the parameter), ``g_j`` the gradient rank ``j``'s backward produced for a flat group
(summed over the step's micro-batches), and ``G`` the reduced gradient the optimizer is about to apply (each rank
holds its shard). Then ``<G, r> = sum_j <g_j, r> / N`` over the ``N`` ranks of the data-parallel group, whatever the
bucketing, sharding, hybrid groups or accumulation. A flat group of experts sums over the ``n`` ranks holding the
same experts only (the expert-data-parallel group; the other ranks of the data-parallel group hold other experts)
and is still divided by ``N``: ``<G, r> = sum_{j in expert group} <g_j, r> / N``. Each rank projects every gradient
on ``r`` as autograd hands it over (before staging) and its shard of ``G`` at the step; one all-reduce of a few
numbers per flat group over the group that summed it gives both sides on every rank. A dropped bucket, a wrong
divisor (2.9x too low a norm, SP gradients left scaled by the sequence degree), a reduction over the wrong group, a
gradient counted twice: each moves ``<G, r>`` by about its own size, and every rank raises the same
:class:`GradientCheckError`, naming the step, the flat group (its parameters) and the process groups.

Tolerance. Both sides differ by rounding only. The reduction rounds each element's sum of ``n`` values once per
addition in the reduce dtype (unit roundoff ``u``: 2^-24 in fp32, 2^-8 in bf16, 2^-11 in fp16; the larger of the
reduce and gradient dtypes'), and the step's ``R`` reductions accumulate. These errors are independent across
elements, so their projection on a Gaussian ``r`` is close to Gaussian, with standard deviation at most
``sigma = u sqrt((n + 1) R) sqrt(n S) / N``, ``S = sum_j sum_i r_i^2 g_ji^2`` (``sqrt(n S)`` bounds
``|| r * sum_j |g_j| ||``). Below the dtype's smallest normal number rounding is absolute, not relative: each of an
element's ``(n + 1) R / N + 2`` roundings (sums, the division, the accumulation) is off by at most ``t / 2``, ``t``
the dtype's smallest subnormal; independent across elements again, they add a standard deviation of at most
``sigma_t = t sqrt((n + 1) R / N + 2) sqrt(sum_i r_i^2)``. The projections scale each block by a power of two (exact)
to a largest magnitude near 1 before its float32 dot products and sum the blocks in float64 (unscaled, the squares of
gradients near 1e19 overflow float32, and products of subnormal gradients lose their digits), rounding pairwise
within blocks: at most ``2 u32 log2(block) A / N``, ``A = sum_j sum_i |r_i g_ji|``. The check allows
``8 (sigma + sigma_t) + 4 u32 log2(block) A / N``: a false alarm is an 8-sigma event, at any gradient scale a float
can hold. A fault's signal is the projection of what was lost, about ``||lost||``, against
``sigma ~ u ||G||``; several projections (``projections``, default 2) make a miss need every one of them to land
near zero (bf16, a dropped bucket: about 2% per projection).

Gradients a caller writes before the step (``param_access`` setters) are not what backward produced: that step is
not checked. Steps with non-finite gradients (an fp16 overflow) are skipped by the optimizer, not checked here; the
1-bit optimizers' compressed phase reduces nothing, so it is not checked either.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .. import comm

BLOCK = 1 << 20  # elements of a parameter whose projection rows are drawn together (memory: projections x 4 MiB)
SIGMAS = 8.0
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
SMALLEST_SUBNORMAL = {torch.float32: 2.0**-149, torch.bfloat16: 2.0**-133, torch.float16: 2.0**-24}
_MIX = 1_000_003  # mixes (seed, step, flat group, parameter, block) into one generator seed


class GradientCheckError(RuntimeError):
    """A gradient reduction did not sum every rank's gradient and divide by the group size (Note [gradient check])."""


class GradientCheck:
    """Projections of one engine's gradients, before and after reduction; owned by its :class:`GradientReducer`."""

    def __init__(
        self,
        buckets: list,
        group: comm.Group,
        world: comm.Group,
        names: list[list[str]],
        interval: int = 1,
        projections: int = 2,
        seed: int = 0,
        expert_group: Optional[comm.Group] = None,
    ):
        self.buckets = buckets  # GradBucket, one per flat group
        self.group = group  # the data-parallel group the reduction averages over
        # per flat group, the ranks whose gradients it sums: the data-parallel group, or for experts the ranks
        # holding the same experts (``expert_group``)
        self.expert_group = expert_group
        self.summed_over = [
            expert_group if expert_group is not None and b.layout.split_axis == "ep" else group for b in buckets
        ]
        self.world = world  # every rank: a failure in one data-parallel group (tensor parallelism) stops them all
        self.names = names  # per flat group, its parameters' names (for the error)
        self.interval, self.projections, self.seed = interval, projections, seed
        self.steps = 0  # optimizer steps seen, checked or not
        self.reductions = 0  # reductions in the current step (micro-batches under stages 2-3)
        self.forgotten = False  # a caller wrote gradients this step: nothing to compare
        self.largest_ratio = 0.0  # the largest difference seen, in tolerances (a margin to monitor: below 1 passes)
        # per flat group and projection: <g, r>, sum r^2 g^2, sum |r g|, sum r^2 (float64)
        self._sums: Optional[torch.Tensor] = None

    @property
    def active(self) -> bool:
        return self.steps % self.interval == 0

    def note_reduction(self) -> None:
        if self.active:
            self.reductions += 1

    def observe(self, index: int, position: int, grad: torch.Tensor) -> None:
        """A gradient autograd handed over for parameter ``position`` of flat group ``index`` (before staging)."""
        if not self.active:
            return
        if self._sums is None:
            device = self.buckets[index].flat.device
            self._sums = torch.zeros(len(self.buckets), 4, self.projections, dtype=torch.float64, device=device)
        values = grad.detach().reshape(-1)
        self._sums[index] += self._project(index, position, 0, values, values.numel())

    def forget(self) -> None:
        """Gradients were written by the caller this step (``param_access``): they are not backward's to check."""
        self.forgotten = True

    def reset(self) -> None:
        self._sums, self.reductions, self.forgotten = None, 0, False

    def verify(self, step: int, reduced: bool) -> None:
        """At the optimizer step, before the gradients are used: compare both sides on every rank (a collective
        over the data-parallel group on checked steps; ``reduced`` False: the 1-bit phase reduced nothing)."""
        checked = self.active and reduced  # the same on every rank: the collective below is never one-sided
        try:
            if checked:
                self._verify(step)
        finally:
            self.steps += 1
            self.reset()

    def _verify(self, step: int) -> None:
        if not self.buckets:  # nothing trained (every rank alike): nothing reduced
            return
        device = self.buckets[0].flat.device
        count = len(self.buckets)
        sums = self._sums
        if sums is None:
            sums = torch.zeros(count, 4, self.projections, dtype=torch.float64, device=device)
        # the same rows as observed (this step's seed); stacked on the device: no host round trip per flat group
        reduced_side = torch.stack([self._reduced_projection(k) for k in range(count)]).to(device)
        packed = torch.cat([sums.to(device), reduced_side.unsqueeze(1)], dim=1)  # [K, 5, m]
        forgotten = torch.tensor([float(self.forgotten)], dtype=torch.float64, device=device)
        summed = torch.empty_like(packed)
        # one all-reduce per group that sums flat groups, the data-parallel group first (every rank in the same order)
        groups = [g for g in (self.group, self.expert_group) if any(s is g for s in self.summed_over)]
        for group in groups:
            rows = [k for k in range(count) if self.summed_over[k] is group]
            message = torch.cat([packed[rows].reshape(-1), forgotten])
            comm.all_reduce(message, group)
            summed[rows] = message[:-1].reshape(len(rows), *packed.shape[1:])
            forgotten = message[-1:].clone()
        failure = None
        if forgotten.item() == 0:  # else a rank's caller wrote gradients (param_access): not backward's to compare
            per_flat = summed.cpu()
            for k, bucket in enumerate(self.buckets):
                failure = failure or self._compare(step, k, bucket, per_flat[k], max(self.reductions, 1))
        if self.world.size > min(g.size for g in groups):  # other groups checked other pieces: agree on a verdict
            verdict = torch.tensor([1.0 if failure else 0.0], device=device)
            comm.all_reduce(verdict, self.world, op="max")
            if verdict.item() and failure is None:
                failure = (
                    f"rank {comm.get_rank()}: gradient check failed at optimizer step {step} in another data-parallel "
                    f"group than '{self.group.name}' ranks {list(self.group.ranks)} (its ranks name the flat group); "
                    "this rank's own reductions checked out"
                )
        if failure is not None:
            raise GradientCheckError(failure)

    # -- the two sides --------------------------------------------------------------------------------
    def _rows(self, index: int, position: int, block: int, numel: int, device: torch.device) -> torch.Tensor:
        """Projection rows for one block of one parameter: the same numbers on every rank."""
        generator = torch.Generator(device=device)
        seed = self.seed
        for part in (self.steps, index, position, block):
            seed = (seed * _MIX + part) % (1 << 62)
        generator.manual_seed(seed)
        return torch.randn(self.projections, numel, generator=generator, device=device)

    def _project(self, index: int, position: int, start: int, values: torch.Tensor, numel: int) -> torch.Tensor:
        """[4, m], float64: <v, r>, sum r^2 v^2, sum |r v|, sum r^2 for ``values`` lying at ``start`` of parameter
        ``position`` (of ``numel`` elements: a block's rows are drawn whole, so both sides draw the same numbers).
        Each block is scaled by a power of two (exact) to a largest magnitude in [0.5, 1) before its float32 dot
        products, which then neither overflow (gradients near 1e19) nor lose their digits (subnormal gradients); the
        sums are scaled back in float64."""
        device = self.buckets[index].flat.device
        values = values.to(device, torch.float32)
        out = torch.zeros(4, self.projections, dtype=torch.float64, device=device)
        stop = start + values.numel()
        for block in range(start // BLOCK, -(-stop // BLOCK)):
            lo, hi = max(start, block * BLOCK), min(stop, (block + 1) * BLOCK)
            length = min(BLOCK, numel - block * BLOCK)
            rows = self._rows(index, position, block, length, device)[:, lo - block * BLOCK : hi - block * BLOCK]
            part = values[lo - start : hi - start]
            exponent = torch.frexp(part.abs().amax()).exponent  # 0 for a block of zeros
            part = rows * torch.ldexp(part, -exponent)
            scale = torch.ldexp(torch.ones((), dtype=torch.float64, device=device), exponent)
            out[0] += part.sum(dim=1).double() * scale
            out[1] += part.pow(2).sum(dim=1).double() * scale.square()
            out[2] += part.abs().sum(dim=1).double() * scale
            out[3] += rows.pow(2).sum(dim=1).double()
        return out

    def _reduced_projection(self, index: int) -> torch.Tensor:
        """[m]: <G, r> over this rank's shard of flat group ``index``, divided by the ranks holding each copy."""
        bucket = self.buckets[index]
        flat, layout = bucket.flat, bucket.layout
        summed_over = self.summed_over[index]
        out = torch.zeros(self.projections, dtype=torch.float64, device=flat.device)
        grad = bucket.grad  # read once (a copy where the gradient waits on disk)
        if bucket.holds_whole:  # stage 0: every rank holds the whole reduced gradient
            for position, slot in enumerate(layout.slots):
                out += self._project(index, position, 0, grad[slot.offset : slot.end], slot.numel)[0]
            return out / summed_over.size
        positions = {slot.name: position for position, slot in enumerate(layout.slots)}
        for segment in layout.segments(flat.shard_rank):
            values = grad[segment.shard_start : segment.shard_start + segment.numel]
            start = segment.flat_start - segment.slot.offset
            out += self._project(index, positions[segment.slot.name], start, values, segment.slot.numel)[0]
        copies = summed_over.size // flat.shard_group.size  # hybrid sharding: each shard is held once per replica
        return out / copies

    def _compare(self, step: int, k: int, bucket, sums: torch.Tensor, reductions: int) -> Optional[str]:
        """The failure message for flat group ``k``, or None when both sides agree within the tolerance."""
        produced, squares, absolute, rows, reduced = sums
        if not (torch.isfinite(sums).all()):
            return None  # an fp16 overflow: the optimizer skips this step
        n, divisor = self.summed_over[k].size, self.group.size
        dtypes = (bucket.reduce_dtype, bucket.home.dtype)
        unit = max(UNIT_ROUNDOFF.get(d, 2.0**-24) for d in dtypes)
        subnormal = max(SMALLEST_SUBNORMAL.get(d, 2.0**-149) for d in dtypes)
        sigma = unit * math.sqrt((n + 1) * reductions) * torch.sqrt(n * squares) / divisor
        # rows: the n ranks' sum r^2, each over the elements it observed
        sigma_subnormal = subnormal * math.sqrt((n + 1) * reductions / divisor + 2) * torch.sqrt(rows / n)
        dot_rounding = 4 * UNIT_ROUNDOFF[torch.float32] * math.log2(BLOCK) * absolute / divisor
        tolerance = SIGMAS * (sigma + sigma_subnormal) + dot_rounding
        expected = produced / divisor
        difference = (reduced - expected).abs()
        ratio = torch.where(tolerance > 0, difference / tolerance.clamp(min=1e-300), difference * math.inf)
        self.largest_ratio = max(self.largest_ratio, float(ratio.nan_to_num(0.0).max()))
        if bool((difference <= tolerance).all()):
            return None
        worst = int(torch.argmax(difference - tolerance))
        names = self.names[k]
        shard, summed_over = bucket.group, self.summed_over[k]
        experts = (
            "" if summed_over is self.group else " (the ranks holding its experts; divided by the data-parallel size)"
        )
        return (
            f"rank {comm.get_rank()}: gradient check failed at optimizer step {step} for flat group {k} "
            f"({names[0]} .. {names[-1]}, {len(names)} parameters, {bucket.layout.numel} elements), reduced over "
            f"process group '{shard.name}' ranks {list(shard.ranks)} and averaged over '{summed_over.name}' ranks "
            f"{list(summed_over.ranks)}{experts}: the reduced "
            f"gradient projects to {float(reduced[worst]):.6g}, the ranks' "
            f"gradients to {float(produced[worst]):.6g} / {divisor} = {float(expected[worst]):.6g} (difference "
            f"{float(difference[worst]):.3g}, tolerance {float(tolerance[worst]):.3g}): the reduction lost, scaled "
            "or mixed gradients (a dropped bucket, a wrong divisor, the wrong process group)"
        )


__all__ = ["GradientCheck", "GradientCheckError"]
