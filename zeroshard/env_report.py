"""``zeroshard report`` / ``python -m zeroshard.env_report``: what this machine offers a training job, each line
OK or WARNING with the fix (DeepSpeed's ``ds_report``, with measurements instead of build flags).

Versions, the accelerator and its devices, communication backends, the CPU (cores, vector extensions, host
memory, ``/dev/shm``), the fused CPU Adam kernel (a short timed probe), and with ``--nvme_path`` whether O_DIRECT
works there and its read/write bandwidth. ``--json`` prints the same as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import Optional, Sequence

import torch

from .accelerator import proc_field_kib

OK, WARNING = "OK", "WARNING"
SHM_MINIMUM = 1 << 30  # below this, data-loader workers sharing tensors fail
_OPTIONAL_PACKAGES = ("transformers", "accelerate", "lightning", "safetensors", "deepspeed")
_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


@dataclass(frozen=True)
class Line:
    section: str
    name: str
    value: str
    status: str = OK
    fix: str = ""


def _verdict(section: str, name: str, value: str, ok: bool, fix: str) -> Line:
    """OK, or a WARNING carrying the fix."""
    return Line(section, name, value, OK if ok else WARNING, "" if ok else fix)


def _version(package: str) -> Optional[str]:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def versions() -> list[Line]:
    from . import __version__

    lines = [
        Line("versions", "python", platform.python_version()),
        Line("versions", "torch", torch.__version__),
        Line("versions", "zeroshard", __version__),
    ]
    for package in _OPTIONAL_PACKAGES:
        found = _version(package)
        lines.append(Line("versions", package, found or "not installed"))
    return lines


def accelerator() -> list[Line]:
    if not torch.cuda.is_available():
        return [Line("accelerator", "GPU", "none (training runs on the CPU with Gloo)")]
    lines = []
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "unknown"
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        lines.append(
            Line(
                "accelerator",
                f"cuda:{index}",
                f"{props.name}, {props.total_memory / 2**30:.1f} GiB, compute capability {props.major}.{props.minor}",
            )
        )
    bf16 = torch.cuda.is_bf16_supported()
    fix = 'use "fp16" (with loss scaling) instead of "bf16" on this GPU'
    lines.append(_verdict("accelerator", "bf16", "supported" if bf16 else "not supported", bf16, fix))
    lines.append(Line("accelerator", "fp16", "supported"))
    lines.append(Line("accelerator", "NCCL", nccl))
    return lines


def communication() -> list[Line]:
    from .comm.backend import available_backends

    backends = available_backends()
    lines = [
        Line("communication", name, "available" if ok else "not built into torch") for name, ok in backends.items()
    ]
    if torch.cuda.is_available() and not backends["nccl"]:
        lines.append(
            Line("communication", "GPU backend", "missing", WARNING, "install a CUDA build of torch with NCCL")
        )
    if not backends["gloo"]:
        lines.append(Line("communication", "CPU backend", "missing", WARNING, "install a torch build with Gloo"))
    return lines


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu() -> list[Line]:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    flags = _cpu_flags()
    extensions = ", ".join(f for f in _CPU_FLAGS if f in flags) or "none of " + "/".join(_CPU_FLAGS)
    capability = torch.backends.cpu.get_cpu_capability()
    native_bf16 = bool({"avx512_bf16", "amx_bf16"} & flags)
    lines = [
        Line("cpu", "cores", f"{usable} usable of {os.cpu_count()}"),
        Line("cpu", "vector extensions", f"{extensions}; torch uses {capability}"),
    ]
    bf16 = "native (avx512_bf16 or AMX)" if native_bf16 else "emulated (slow)"
    lines.append(_verdict("cpu", "bf16 on the CPU", bf16, native_bf16 or torch.cuda.is_available(), "train in fp32"))
    total = proc_field_kib("/proc/meminfo", "MemTotal")
    available = proc_field_kib("/proc/meminfo", "MemAvailable")
    if total is not None:
        free = f"{(available or 0) / 2**20:.1f} GiB available"
        lines.append(Line("cpu", "host memory", f"{total / 2**20:.1f} GiB, {free}"))
    try:
        shm = shutil.disk_usage("/dev/shm").total
    except OSError:
        return lines
    fix = "data loader workers will fail; run docker with --shm-size=8g (or --ipc=host)"
    lines.append(_verdict("cpu", "/dev/shm", f"{shm / 2**20:.0f} MB", shm >= SHM_MINIMUM, fix))
    return lines


def adam_probe(seconds: float = 1.0, numel: int = 1 << 22) -> list[Line]:
    """Time torch's fused CPU AdamW (what ``CPUAdam`` and offloaded optimizer steps run) on ``numel`` elements."""
    param = torch.zeros(numel, requires_grad=True)
    param.grad = torch.randn(numel)
    try:
        optimizer = torch.optim.AdamW([param], lr=1e-3, fused=True)
        optimizer.step()
    except (RuntimeError, TypeError) as err:
        return [Line("cpu adam", "fused kernel", f"unavailable ({err})", WARNING, "upgrade torch to >= 2.4")]
    steps, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        optimizer.step()
        steps += 1
    elapsed = time.perf_counter() - started
    moved = steps * numel * 4 * 7  # reads param, grad, exp_avg, exp_avg_sq; writes param, exp_avg, exp_avg_sq
    return [
        Line(
            "cpu adam", "fused kernel", f"present, {moved / elapsed / 1e9:.1f} GB/s ({steps} steps of {numel} elements)"
        )
    ]


def nvme_probe(directory: str, nbytes: int = 64 << 20) -> list[Line]:
    """Whether O_DIRECT works in ``directory`` and its write/read bandwidth (through zeroshard's swap file)."""
    from .offload.aio import AioSettings, SwapFile, aligned_empty

    if not os.path.isdir(directory):
        return [Line("nvme", directory, "not a directory", WARNING, "pass an existing directory on the NVMe disk")]
    try:
        file = SwapFile(directory, f"zeroshard-report-{os.getpid()}.probe", AioSettings())
        buffer = aligned_empty(nbytes)
        buffer.fill_(7)
        offset = file.reserve(nbytes)
        started = time.perf_counter()
        file.submit(True, buffer, offset).wait()
        os.fsync(file.fd)
        write = nbytes / (time.perf_counter() - started)
        started = time.perf_counter()
        file.submit(False, buffer, offset).wait()
        read = nbytes / (time.perf_counter() - started)
        direct = file.direct
        file.close()
    except Exception as err:  # the report names whatever the disk refuses
        return [Line("nvme", directory, f"unusable: {err}", WARNING, "choose a writable local disk for nvme_path")]
    refused = "refused by this filesystem (buffered I/O is used: reads may hit the page cache)"
    fix = "point nvme_path at a local ext4/xfs NVMe mount"
    return [
        _verdict("nvme", "O_DIRECT", "works" if direct else refused, direct, fix),
        Line("nvme", "write", f"{write / 1e9:.2f} GB/s ({nbytes >> 20} MB)"),
        Line("nvme", "read", f"{read / 1e9:.2f} GB/s ({nbytes >> 20} MB)"),
    ]


def report(nvme_path: Optional[str] = None, probe_seconds: float = 1.0) -> list[Line]:
    lines = versions() + accelerator() + communication() + cpu() + adam_probe(probe_seconds)
    if nvme_path is not None:
        lines += nvme_probe(nvme_path)
    return lines


def format_lines(lines: list[Line]) -> str:
    out, section = [], None
    width = max(len(line.name) for line in lines)
    for line in lines:
        if line.section != section:
            section = line.section
            out.append(f"--- {section}")
        fix = f"  -> {line.fix}" if line.fix else ""
        out.append(f"[{line.status:<7}] {line.name:<{width}}  {line.value}{fix}")
    warnings = sum(line.status == WARNING for line in lines)
    out.append(f"{warnings} warning(s)" if warnings else "no warnings")
    return "\n".join(out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="zeroshard report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--nvme_path", default=None, help="also probe O_DIRECT and bandwidth in this directory")
    parser.add_argument("--probe_seconds", type=float, default=1.0, help="length of the CPU Adam probe (default 1 s)")
    args = parser.parse_args(argv)
    lines = report(args.nvme_path, args.probe_seconds)
    print(json.dumps([asdict(line) for line in lines], indent=1) if args.json else format_lines(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
