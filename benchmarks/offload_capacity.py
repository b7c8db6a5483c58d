"""How many bytes of RAM and disk each parameter costs under ZeRO-3 with NVMe (and CPU) offload, measured as a
user starts the run: ``zeroshard --num_gpus 2 <this file> --worker ...``, with no environment variable set here
(the ranks inherit this process's environment minus any ``MALLOC_*`` tuning).

    python benchmarks/offload_capacity.py [--layers 4 16] [--width 1024] [--knobs large defaults] [--nvme_path /tmp]
    python benchmarks/offload_capacity.py --check 300 --width 1024 --modes nvme --steps 2   # one size, measured

Every run is ZeRO stage 3 with the model built under ``zero.Init`` (no rank ever holds the whole model), or stage 2
(``--stage 2``), fp32, AdamW, one micro-batch of 1 x 64 tokens, gradient clipping 1.0 (DeepSpeed's HF default). Modes:

- none: everything in RAM (16 bytes per parameter over the ranks);
- cpu: ``offload_optimizer`` + ``offload_param`` to ``cpu`` (``--stage 2``: the optimizer alone; on a machine without
  a GPU "device" and "host" are the same RAM: this shows the cost of the copies, not a capacity gain, unless
  ``--host_link_gbps`` makes the copies as slow as a PCIe link: ``zeroshard.testing.slow_host_link``);
- cpu-optimizer: ``offload_optimizer`` alone to ``cpu``;
- nvme: ``offload_optimizer`` + ``offload_param`` to ``nvme``.

Knob sets (``--knobs``): ``large``, what a model far above 1e9 parameters is run with (3 blocks of live parameters,
prefetch of 1 block, reuse distance 0, ``sub_group_size`` of 1 block, ``max_in_cpu`` 0); ``defaults``, DeepSpeed's
documented defaults (1e9 for ``sub_group_size``, live parameters, reuse distance and ``max_in_cpu``).

Per run the ranks report the peak RSS of ``initialize`` and of the steps separately (VmHWM, reset between them
through ``/proc/self/clear_refs``), the step time, and the disk bytes read and written per step (the offload
ledger). The slope between two sizes, summed over both ranks, is the RAM cost per parameter.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from zeroshard.testing.models import GPT, GPTConfig

RAM_BUDGET = 22 * 2**30  # of the 24 GiB: leave room for the OS and the launcher
SEQ = 64
VOCAB = 8192


def config(
    mode: str,
    knobs: str,
    nvme_path: str,
    block_numel: int,
    verify_reads: bool = False,
    super_offload=None,
    clip: float = 1.0,
    stage: int = 3,
) -> dict:
    zero: dict = {"stage": stage}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, gather_unit_classes=["Block"])
    if knobs == "large":
        zero["sub_group_size"] = block_numel
        if stage == 3:
            zero.update(
                stage3_prefetch_bucket_size=block_numel, stage3_max_live_parameters=3 * block_numel,
                stage3_max_reuse_distance=0,
            )  # fmt: skip
    device = mode.split("-")[0]  # cpu-optimizer: the optimizer alone
    if device in ("cpu", "nvme"):
        extra = {"nvme_path": nvme_path} if device == "nvme" else {}
        zero["offload_optimizer"] = {"device": device, **extra, "super_offload": super_offload}
    if device in ("cpu", "nvme") and stage == 3 and not mode.endswith("-optimizer"):
        zero["offload_param"] = {"device": device, **extra, **({"max_in_cpu": 0} if knobs == "large" else {})}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": zero,
        "aio": {"verify_reads": verify_reads},  # the swap checksums (off by default): --verify_reads on for an A/B
        "steps_per_print": 1_000_000,
    }


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def worker(args) -> None:
    """One rank, started by the zeroshard launcher."""
    import zeroshard
    from zeroshard import comm
    from zeroshard.accelerator import host_peak_rss
    from zeroshard.testing import slow_host_link

    cfg = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=args.layers, n_head=16, n_embd=args.width)
    block_numel = 12 * args.width**2 + 10 * args.width  # attention and MLP weights, their biases, two LayerNorms
    super_offload = {"on": True, "off": False, "default": None}[args.super_offload]
    ds_config = config(
        args.mode, args.knobs, args.nvme_path, block_numel, args.verify_reads == "on", super_offload, args.clip,
        args.stage,
    )  # fmt: skip
    link = slow_host_link(args.host_link_gbps * 1e9)  # 0: the copies take what they take
    remote = ds_config["zero_optimization"].get("offload_param", {}).get("device")
    # stage 3: built under zero.Init, as DeepSpeed's Megatron example does
    build = zeroshard.zero.Init(remote_device=remote, config_dict_or_path=ds_config) if args.stage == 3 else None
    with build or contextlib.nullcontext():
        model = GPT(cfg)
    assert block_numel == sum(p.numel() for p in model.blocks[0].parameters())
    engine, *_ = zeroshard.initialize(model=model, config=ds_config)
    init_peak = host_peak_rss()
    _reset_peak()
    x = torch.randint(0, cfg.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(x, x))  # the first step makes the optimizer state: not timed
    engine.step()
    comm.barrier(engine.mesh.world)
    before = engine.disk_io()  # waits for a step running behind the forward
    moved_before, waited_before = dict(link.moved), link.waited_s
    cpu_before = os.times()
    started = time.perf_counter()
    timed = max(1, args.steps - 1)
    for _ in range(timed):  # back to back: a step running behind the next forward is timed where it is waited for
        engine.backward(engine(x, x))
        engine.step()
    after = engine.disk_io()  # ... and the last one here
    elapsed = time.perf_counter() - started
    cpu_after = os.times()
    where = engine.state_bytes_by_location()
    result = {
        "params": sum(p.numel() for p in model.parameters()),
        "step_s": elapsed / timed,
        # CPU seconds of all the rank's threads (compute, I/O, the step's worker) per step: with as many ranks as
        # cores, a step cannot take less than the ranks' sum over the cores
        "cpu_s": (cpu_after.user + cpu_after.system - cpu_before.user - cpu_before.system) / timed,
        "init_peak_rss": init_peak,
        "step_peak_rss": host_peak_rss(),
        "ram_state": sum(where["device"].values()) + sum(where["host"].values()),
        "nvme_state": sum(where["nvme"].values()),
        "disk_per_step": {k: (after[k] - before[k]) / timed for k in after},  # checksum_s: aio.verify_reads' cost
        "link_per_step": {
            **{k: (link.moved[k] - moved_before[k]) / timed for k in link.moved},
            "waited_s": (link.waited_s - waited_before) / timed,
        },
    }
    with open(os.path.join(args.out, f"rank{comm.get_rank()}.json"), "w") as f:
        json.dump(result, f)


def launch(
    mode: str,
    knobs: str,
    layers: int,
    width: int,
    steps: int,
    nvme_path: str,
    verify: str = "off",
    super_offload: str = "default",
    clip: float = 1.0,
    stage: int = 3,
    host_link_gbps: float = 0.0,
) -> dict:
    """Both ranks' results, started as a user starts them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable, "-m", "zeroshard", "--num_gpus", "2", os.path.abspath(__file__), "--worker",
            "--mode", mode, "--knobs", knobs, "--layers", str(layers), "--width", str(width),
            "--steps", str(steps), "--nvme_path", nvme_path, "--out", out, "--verify_reads", verify,
            "--super_offload", super_offload, "--clip", str(clip), "--stage", str(stage),
            "--host_link_gbps", str(host_link_gbps),
        ]  # fmt: skip
        subprocess.run(command, env=env, check=True)
        ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]
    result = dict(ranks[0])
    for key in ("init_peak_rss", "step_peak_rss", "ram_state", "nvme_state"):
        result[key] = sum(r[key] for r in ranks)  # both ranks
    result["peak_rss"] = max(result["init_peak_rss"], result["step_peak_rss"])
    result["disk_per_step"] = {k: sum(r["disk_per_step"][k] for r in ranks) for k in ranks[0]["disk_per_step"]}
    result["link_per_step"] = {k: max(r["link_per_step"][k] for r in ranks) for k in ranks[0]["link_per_step"]}
    result["step_s"] = max(r["step_s"] for r in ranks)
    result["cpu_s"] = sum(r["cpu_s"] for r in ranks)  # both ranks
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument(
        "--modes", nargs="+", default=["none", "cpu", "nvme"], choices=["none", "cpu", "cpu-optimizer", "nvme"]
    )
    parser.add_argument("--knobs", nargs="+", default=["large"], choices=["large", "defaults"])
    parser.add_argument("--nvme_path", default="/tmp")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--check", type=int, metavar="LAYERS", help="only run this size (e.g. one past a projection)")
    parser.add_argument(
        "--verify_reads", choices=["on", "off"], default="off", help="aio.verify_reads: the swap files' checksums"
    )
    parser.add_argument(
        "--super_offload", choices=["on", "off", "default"], default="default",
        help="offload_optimizer.super_offload: the optimizer step during backward (default: zeroshard's choice)",
    )  # fmt: skip
    parser.add_argument(
        "--clip", type=float, default=1.0, help="gradient_clipping (1.0 clips this model; 1e9 never; 1e-6 always)"
    )
    parser.add_argument("--stage", type=int, choices=[2, 3], default=3, help="ZeRO stage (2: no offload_param)")
    parser.add_argument(
        "--host_link_gbps", type=float, default=0.0,
        help="the link between device and host slowed to this many GB/s (zeroshard.testing.slow_host_link); 0: off",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=1, help="run the modes this many times, interleaved")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.layers, args.knobs = args.layers[0], args.knobs[0]
        return worker(args)
    free_disk = shutil.disk_usage(args.nvme_path).free
    print(
        f"2 ranks (zeroshard --num_gpus 2), stage {args.stage}, fp32, width {args.width}, {os.cpu_count()} cores; "
        f"RAM budget {RAM_BUDGET / 2**30:.0f} GiB, free disk at {args.nvme_path}: {free_disk / 2**30:.0f} GiB\n"
    )
    print(
        "| mode | knobs | parameters | step s | peak RSS, both ranks GiB (init / steps) | model state in RAM GiB "
        "| on disk GiB | disk read + written per step GB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    slopes, steps = [], {}  # steps: (knobs, mode, layers) -> step seconds of each round
    for knobs, _round, mode in [(k, n, m) for k in args.knobs for n in range(args.rounds) for m in args.modes]:
        points = []
        for layers in [args.check] if args.check else args.layers:
            r = launch(mode, knobs, layers, args.width, args.steps, args.nvme_path, args.verify_reads,
                       args.super_offload, args.clip, args.stage, args.host_link_gbps)  # fmt: skip
            points.append(r)
            steps.setdefault((knobs, mode, layers), []).append(r["step_s"])
            disk = r["disk_per_step"]
            print(
                f"| {mode} | {knobs} | {r['params'] / 1e6:.0f}M | {r['step_s']:.2f} | "
                f"{r['init_peak_rss'] / 2**30:.2f} / {r['step_peak_rss'] / 2**30:.2f} | "
                f"{r['ram_state'] / 2**30:.2f} | {r['nvme_state'] / 2**30:.2f} | "
                f"{disk['read'] / 1e9:.2f} + {disk['written'] / 1e9:.2f} |",
                flush=True,
            )
            print(f"  CPU seconds per step, both ranks' threads: {r['cpu_s']:.2f} ({os.cpu_count()} cores: at least "
                  f"{r['cpu_s'] / os.cpu_count():.2f} s per step)", flush=True)  # fmt: skip
            if args.host_link_gbps and mode != "none":
                link = r["link_per_step"]
                print(f"  host link at {args.host_link_gbps:g} GB/s: {link['to_host'] / 1e9:.3f} GB to the host, "
                      f"{link['to_device'] / 1e9:.3f} GB to the device per rank per step, the copies' threads "
                      f"waited {link['waited_s']:.3f} s for the link", flush=True)  # fmt: skip
            if mode == "nvme":
                share = disk["checksum_s"] / 2 / r["step_s"]  # per rank: both ranks' seconds summed above
                print(f"  swap checksums (aio.verify_reads): {disk['checksum_s'] / 2:.3f} s of I/O-thread time "
                      f"per rank per step, {100 * share:.1f}% of the step", flush=True)  # fmt: skip
            if mode != "none":  # per rank and step (both ranks' counts summed above)
                print(f"  step during backward (super_offload {args.super_offload}): sub-groups "
                      f"{disk['speculated'] / 2:.1f} speculated, {disk['committed'] / 2:.1f} committed, "
                      f"{disk['replayed'] / 2:.1f} replayed; training waited {disk['speculation_wait_s'] / 2:.3f} "
                      f"s for it and {disk['wait_s'] / 2:.3f} s for the disk", flush=True)  # fmt: skip
        if len(points) == 2:
            small, large = points
            span = large["params"] - small["params"]
            ram = (large["peak_rss"] - small["peak_rss"]) / span
            disk = large["nvme_state"] / large["params"]
            io = (large["disk_per_step"]["read"] + large["disk_per_step"]["written"]) / large["params"]
            fit_ram = (RAM_BUDGET - (small["peak_rss"] - ram * small["params"])) / max(ram, 1e-9)
            fit = min(fit_ram, free_disk / disk) if disk else fit_ram
            slopes.append((mode, knobs, ram, disk, io, fit))
    if "none" in args.modes and len(args.modes) > 1:
        print("\n| mode | knobs | parameters | step s (each round) | mean step / mean step without offload |")
        print("|---|---|---|---|---|")
        for (knobs, mode, layers), times in steps.items():
            base = steps[(knobs, "none", layers)]
            ratio = sum(times) / len(times) / (sum(base) / len(base))
            print(f"| {mode} | {knobs} | {layers} blocks | {', '.join(f'{t:.2f}' for t in times)} | {ratio:.3f} |")
    if slopes:
        print(
            "\n| mode | knobs | RAM bytes / parameter (both ranks) | disk bytes / parameter | disk bytes moved / "
            "parameter / step | largest model (projected) |"
        )
        print("|---|---|---|---|---|---|")
        for mode, knobs, ram, disk, io, fit in slopes:
            print(f"| {mode} | {knobs} | {ram:.2f} | {disk:.1f} | {io:.1f} | {fit / 1e9:.2f}B |")


if __name__ == "__main__":
    main()
