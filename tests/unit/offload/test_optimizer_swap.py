"""The NVMe optimizer swapper's speculation side (zeroshard/offload/optimizer_swap.py): twin regions written by a
shadow step and made current by a commit, the optimizer's state set aside and given back, and the gradient hand-off
(Note [gradient hand-off] in docs/design.md), on a real swap file. The bit-for-bit runs are
tests/distributed/test_speculation.py."""

import torch

from zeroshard.offload import MASTER, SubGroup, SwapFile
from zeroshard.offload.aio import AioSettings
from zeroshard.offload.optimizer_swap import GRAD, NvmeOptimizerSwapper

NUMEL = 1024


def swapper(tmp_path, buffer_count: int = 2) -> tuple[NvmeOptimizerSwapper, SubGroup, torch.optim.Optimizer]:
    file = SwapFile(str(tmp_path), "optimizer.swap", AioSettings())
    swap = NvmeOptimizerSwapper(file, buffer_count, NUMEL, pin=False, synchronize=lambda: None)
    sub = SubGroup(0, 0, NUMEL, torch.nn.Parameter(torch.empty(0)))
    swap.write(sub, {MASTER: torch.ones(NUMEL)})
    swap.reserve(sub, GRAD)
    optimizer = torch.optim.SGD([sub.param], lr=0.5, momentum=0.9)
    return swap, sub, optimizer


def step(swap, sub, optimizer, shadow: bool, grad_scale: float = 1.0) -> None:
    for stepped in swap.steps(optimizer, [sub], with_grad=frozenset({id(sub.param)}), into_shadow=shadow):
        stepped.param.grad = swap.staged_grad(stepped) * grad_scale
        optimizer.step()
        stepped.param.grad = None


def test_a_shadow_step_leaves_the_state_it_read_and_a_commit_makes_it_current(tmp_path):
    swap, sub, optimizer = swapper(tmp_path)
    swap.enable_shadow([sub])
    swap.write_grad(sub, torch.full((NUMEL,), 2.0), final=True)
    step(swap, sub, optimizer, shadow=True)
    assert swap.read(sub)[MASTER].eq(1.0).all()  # the current region: untouched
    assert sub.param not in optimizer.state  # the first step's state is set aside for the verdict
    swap.discard(sub)
    assert swap.state_keys.get(id(sub.param)) == []  # the discarded first step's keys are gone again
    step(swap, sub, optimizer, shadow=True)  # speculated again (the gradient read back from the file)
    swap.commit(sub, optimizer)
    read = swap.read(sub)
    assert read[MASTER].eq(0.0).all() and read["momentum_buffer"].eq(2.0).all()  # 1 - 0.5 * 2; the buffer = grad
    swap.file.close()


def test_the_final_gradient_is_handed_off_in_memory_and_a_stale_one_dropped(tmp_path):
    swap, sub, optimizer = swapper(tmp_path)
    swap.enable_shadow([sub])
    swap.write_grad(sub, torch.full((NUMEL,), 7.0), final=True)  # a skipped step's: no step takes it
    swap.write_grad(sub, torch.full((NUMEL,), 2.0), final=True)  # the next step's drops it
    before = swap.file.stats.read
    staged = []
    for stepped in swap.steps(optimizer, [sub], with_grad=frozenset({id(sub.param)}), into_shadow=True):
        staged.append(swap.staged_grad(stepped).clone())
    moved = swap.file.stats.read - before
    assert staged[0].eq(2.0).all()
    assert moved == 4096  # the master only: the gradient came from memory
    swap.discard(sub)
    before = swap.file.stats.read  # the replay reads it back from the file, where it was written too
    for stepped in swap.steps(optimizer, [sub], with_grad=frozenset({id(sub.param)})):
        assert swap.staged_grad(stepped).eq(2.0).all()
    assert swap.file.stats.read - before == 2 * 4096
    swap.file.close()
