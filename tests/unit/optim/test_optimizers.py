import pytest
import torch

from zeroshard.optim import Lamb, Lion, build_optimizer, check_client_optimizer
from zeroshard.optim.contract import ShardLayout


def params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]


def build(name, p, stage=1, allow=False, **kw):
    return build_optimizer(name, kw, [{"params": p}], zero_stage=stage, allow_untested=allow)


def test_adam_means_adamw_unless_adam_w_mode_false():
    assert isinstance(build("Adam", params()), torch.optim.AdamW)
    assert type(build("Adam", params(), adam_w_mode=False)) is torch.optim.Adam
    assert isinstance(build("adamw", params()), torch.optim.AdamW)
    with pytest.raises(ValueError, match="contradictory"):
        build("AdamW", params(), adam_w_mode=False)


@pytest.mark.parametrize("name", ["Adam", "AdamW", "Lamb", "Lion", "Adagrad", "SGD"])
def test_unset_weight_decay_is_deepspeeds_zero(name):
    """DeepSpeed's FusedAdam, CPU Adam, FusedLamb, Lion and torch's Adagrad / SGD decay nothing unless asked (found by
    the cifar tutorial's one-process reference: before, "Adam" without weight_decay decayed by torch AdamW's 0.01)."""
    built = build(name, params(), lr=0.1)
    assert all(group["weight_decay"] == 0.0 for group in built.param_groups)
    assert build(name, params(), lr=0.1, weight_decay=0.05).param_groups[0]["weight_decay"] == 0.05


def test_names_and_params_validated():
    assert isinstance(build("Lamb", params()), Lamb)
    assert isinstance(build("Lion", params()), Lion)
    assert isinstance(build("SGD", params(), lr=0.1, momentum=0.9), torch.optim.SGD)
    assert isinstance(build("Adagrad", params()), torch.optim.Adagrad)
    with pytest.raises(ValueError, match="unknown config key 'optimizer.params.betaz'"):
        build("Adam", params(), betaz=(0.9, 0.9))
    with pytest.raises(NotImplementedError, match="MuAdam"):
        build("MuAdam", params())
    with pytest.raises(ValueError, match="no such optimizer"):
        build("Nope", params())


def test_untested_torch_optimizer_needs_the_flag_under_zero():
    with pytest.raises(ValueError, match="zero_allow_untested_optimizer"):
        build("RMSprop", params(), stage=1)
    assert isinstance(build("RMSprop", params(), stage=1, allow=True), torch.optim.RMSprop)
    assert isinstance(build("RMSprop", params(), stage=0), torch.optim.RMSprop)
    with pytest.raises(ValueError, match="client optimizer RMSprop"):
        check_client_optimizer(torch.optim.RMSprop(params()), zero_stage=2, allow_untested=False)


def test_lion_matches_its_definition():
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = Lion([p], lr=0.1, betas=(0.9, 0.99), weight_decay=0.5)
    p.grad = torch.tensor([0.3, 0.0])
    opt.step()
    # m=0: update = sign(0.1 * g) ; decay 1 - lr*wd = 0.95
    assert p.detach().tolist() == pytest.approx([1.0 * 0.95 - 0.1, -2.0 * 0.95])
    assert opt.state[p]["exp_avg"].tolist() == pytest.approx([0.003, 0.0])


class OneProcessLayout(ShardLayout):
    """Both "ranks'" shards in one process: the partial norms are already whole."""

    def __init__(self, segments: dict, slot_count: int):
        self._segments, self._slot_count = segments, slot_count

    @property
    def slot_count(self) -> int:
        return self._slot_count

    def segments(self, tensor):
        return self._segments[id(tensor)]

    def complete_norms(self, partial) -> None:
        pass


def test_lamb_on_flat_shards_equals_lamb_on_parameters():
    """The trust ratio is per original parameter even when the tensors are flat shards of many."""
    ps = params()
    grads = [torch.randn_like(p) for p in ps]
    whole = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    ref = Lamb(whole, lr=0.1, weight_decay=0.01)
    for p, g in zip(whole, grads):
        p.grad = g.clone()
    ref.step()

    # one flat buffer of 22 elements split in two "shards" of 11 (rank 0 and rank 1 emulated in one process)
    flat = torch.cat([p.detach().reshape(-1) for p in ps])
    flat_grad = torch.cat([g.reshape(-1) for g in grads])
    shards = [torch.nn.Parameter(flat[:11].clone()), torch.nn.Parameter(flat[11:].clone())]
    for s, g in zip(shards, (flat_grad[:11], flat_grad[11:])):
        s.grad = g.clone()
    # slot 0 = elements [0, 15), slot 1 = [15, 22)
    segments = {id(shards[0]): [(0, 0, 11)], id(shards[1]): [(0, 0, 4), (1, 4, 7)]}
    opt = Lamb(shards, lr=0.1, weight_decay=0.01, layout=OneProcessLayout(segments, 2))
    opt.step()
    got = torch.cat([s.detach() for s in shards])
    want = torch.cat([p.detach().reshape(-1) for p in whole])
    torch.testing.assert_close(got, want)
