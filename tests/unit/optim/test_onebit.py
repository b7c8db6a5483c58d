"""The 1-bit optimizers in one process (no compression partner): DeepSpeed's update rules, the warm-up and
variance schedules, and the named refusals. Compression across ranks: tests/distributed/test_onebit.py."""

import warnings

import pytest
import torch

from zeroshard.optim import OneBitAdam, OneBitLamb, ZeroOneAdam, build_optimizer


def params(seed=0):
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(5))]


def grads(step: int, p: list) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for q in p:
        q.grad = torch.randn(q.shape, generator=gen)


def test_onebit_adam_warms_up_as_adam_without_bias_correction_then_freezes_the_variance():
    p = params()
    ref = [q.detach().clone() for q in p]
    m = [torch.zeros_like(q) for q in ref]
    v = [torch.zeros_like(q) for q in ref]
    opt = OneBitAdam(p, lr=0.01, freeze_step=3, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1)
    for step in range(1, 7):
        assert opt.needs_averaged_gradients() == (step <= 3)
        grads(step, p)
        for k, q in enumerate(p):
            g = q.grad
            m[k] = 0.9 * m[k] + 0.1 * g
            if step <= 3:
                v[k] = 0.99 * v[k] + 0.01 * g * g
            ref[k] = ref[k] - 0.01 * (m[k] / (v[k].sqrt() + 1e-6) + 0.1 * ref[k])
        opt.step()
        for k, q in enumerate(p):
            torch.testing.assert_close(q.detach(), ref[k], rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(opt.state[q]["exp_avg_sq"], v[k])
    assert opt.steps_taken() == 6


def test_zero_one_adam_variance_steps_double_their_interval():
    p = params()
    opt = ZeroOneAdam(p, lr=0.01, var_freeze_step=20, var_update_scaler=2)
    exact = []
    for step in range(1, 21):
        if opt.needs_averaged_gradients():
            exact.append(step)
        v_before = opt.state[p[0]]["exp_avg_sq"].clone() if p[0] in opt.state else None
        grads(step, p)
        opt.step()
        changed = v_before is None or not torch.equal(v_before, opt.state[p[0]]["exp_avg_sq"])
        assert changed == (step in exact)  # the variance moves on exactly the averaged steps
    assert exact == [1, 2, 4, 6, 8, 12, 16]  # interval 1, 2, 4, 8: each for var_update_scaler=2 updates


def test_zero_one_adam_synchronisation_alone_keeps_the_weights_and_averages_the_momenta():
    """One rank: a local-step synchronisation leaves the weights where the local steps took them and sets the
    momentum to the mean of the interval's momenta (the update it implies); before the first interval of two,
    0/1 Adam steps as frozen-variance 1-bit Adam."""
    p, q = params(), params()
    opt = ZeroOneAdam(p, lr=0.01, var_freeze_step=2, local_step_scaler=2, local_step_clipper=4)
    plain = OneBitAdam(q, lr=0.01, freeze_step=2)
    momenta = []
    for step in range(1, 7):
        grads(step, p)
        grads(step, q)
        opt.step()
        plain.step()
        momenta.append(plain.state[q[0]]["exp_avg"].clone())
        for a, b in zip(p, q):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
        if step <= 5:
            torch.testing.assert_close(opt.state[p[0]]["exp_avg"], momenta[-1], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(opt.state[p[0]]["exp_avg"], (momenta[4] + momenta[5]) / 2, rtol=1e-5, atol=1e-7)
    assert opt.state[p[0]]["local_interval"] == 4  # 1 for steps 3-4, 2 for 5-6, then 4 (the clipper)


def test_onebit_lamb_warm_up_trust_ratio_and_its_moving_average():
    p = params()[:1]
    opt = OneBitLamb(p, lr=0.01, freeze_step=5, coeff_beta=0.5, max_coeff=10.0, min_coeff=0.01)
    w = p[0].detach().clone()
    m, v, frozen = torch.zeros_like(w), torch.zeros_like(w), 0.0
    for step in range(1, 4):
        grads(step, p)
        g = p[0].grad
        m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
        update = m / (v.sqrt() + 1e-8)
        coeff = min(max((w.norm() / update.norm()).item(), 0.01), 10.0)
        frozen = 0.5 * frozen + 0.5 * coeff
        w = w - 0.01 * coeff * update
        opt.step()
        torch.testing.assert_close(p[0].detach(), w, rtol=1e-5, atol=1e-6)
    assert opt.state[p[0]]["coeff_freeze"] == [pytest.approx(frozen, rel=1e-5)]


def test_onebit_lamb_compressed_phase_keeps_the_factor_within_its_threshold():
    p = params()
    opt = OneBitLamb(p, lr=0.01, freeze_step=2, factor_threshold=0.1, factor_max=4.0, factor_min=0.5)
    for step in range(1, 9):
        grads(step, p)
        last = [list(opt.state[q]["last_factor"]) for q in p] if step > 2 else None
        opt.step()
        if last is not None:
            for q, before in zip(p, last):
                for old, new in zip(before, opt.state[q]["last_factor"]):
                    assert 0.5 <= new <= 4.0 and abs(new - old) <= 0.1 * old + 1e-9
        assert all(torch.isfinite(q).all() for q in p)


def build(name, stage=0, **kw):
    return build_optimizer(name, kw, [{"params": params()}], zero_stage=stage, allow_untested=False)


def test_names_defaults_and_refusals():
    adam = build("OneBitAdam")
    assert adam.freeze_step == 100000 and adam.defaults["betas"] == (0.9, 0.999) and adam.defaults["eps"] == 1e-8
    assert isinstance(build("OneBitAdam", stage=2, freeze_step=10), OneBitAdam)
    zo = build("ZeroOneAdam")
    assert (zo.var_freeze_step, zo.var_update_scaler, zo.local_step_scaler, zo.local_step_clipper) == (
        100000,
        16,
        32678,
        16,
    )
    lamb = build("OneBitLamb")
    assert (lamb.coeff_beta, lamb.factor_max, lamb.factor_min, lamb.factor_threshold) == (0.9, 4.0, 0.5, 0.1)
    assert (lamb.max_coeff, lamb.min_coeff) == (10.0, 0.01)
    with pytest.raises(ValueError, match="unknown config key 'optimizer.params.var_freeze_step'"):
        build("OneBitAdam", var_freeze_step=5)
    with pytest.raises(ValueError, match="amsgrad"):
        build("OneBitAdam", amsgrad=True)
    with pytest.raises(ValueError, match="comm_backend_name"):
        build("OneBitAdam", comm_backend_name="carrier-pigeon")


def test_cuda_aware_and_backend_name_are_accepted_and_said_to_mean_nothing_here():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build("OneBitAdam", cuda_aware=True, comm_backend_name="mpi")
        build("OneBitAdam")  # the defaults say nothing
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "no effect" in messages[0]
