"""The ``flops_profiler`` config block: rank 0 profiles the forward of ``profile_step`` and writes the report after
that step; under ZeRO-3 the counts are those of the whole model (full shapes, not the empty shards)."""

from zeroshard.testing import run_distributed
from zeroshard.testing.parity import ParityCase, make_batches, make_model


def profiled_worker(out_dir: str) -> list:
    import os

    import zeroshard
    from zeroshard import comm

    rank = comm.get_rank()
    written = []
    for stage in (0, 3):
        config = ParityCase(stage=stage, zero=(("stage3_param_persistence_threshold", 0),)).config()
        output = f"{out_dir}/profile-stage{stage}.txt"
        config["flops_profiler"] = {
            "enabled": True,
            "profile_step": 2,
            "module_depth": 1,
            "top_modules": 2,
            "detailed": True,
            "output_file": output,
        }
        engine, *_ = zeroshard.initialize(model=make_model(), config=config)
        for step, (x, y) in enumerate(make_batches(4, 4)):
            engine.backward(engine(x[rank * 2 : rank * 2 + 2], y[rank * 2 : rank * 2 + 2]))
            engine.step()
            if step == 1:
                early = os.path.exists(output)  # not yet: two steps taken, the third forward is profiled
        written.append((early, open(output).read() if rank == 0 else None))
        engine.destroy()
    return written


def test_the_config_block_profiles_one_step_with_full_shapes_under_zero3(tmp_path):
    import os

    per_rank = run_distributed(profiled_worker, 2, str(tmp_path))
    from zeroshard.profiling import get_model_profile
    from zeroshard.profiling.flops import number_to_string

    x, _ = make_batches(1, 2)[0]
    flops, _, params = get_model_profile(make_model(), args=[x], print_profile=False, as_string=False)
    for stage, (early, after) in zip((0, 3), per_rank[0]):
        assert not early
        assert after.startswith("zeroshard flops profile\nprofile step: 2\n")
        assert f"forward FLOPs: {number_to_string(flops, 'FLOPs')}\n" in after, (stage, flops)
        assert f"parameters: {number_to_string(params, '')}\n" in after
        assert "depth 1: blocks" in after and "  blocks (ModuleList)" in after and "    0 (Block)" not in after
        assert "iteration latency" in after
    assert sorted(os.listdir(tmp_path)) == ["profile-stage0.txt", "profile-stage3.txt"]  # rank 0's only
