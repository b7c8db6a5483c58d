#!/usr/bin/env bash
# The GPU check, one command, under 10 minutes on one GPU: the GPU-marked tests (NCCL, CUDA, pinned-memory
# offload, TP inference) and a bf16 stage 0-3 benchmark of a ~1B-parameter GPT (tokens/s, MFU, peak device
# memory), CPU optimizer offload at stages 2 and 3 with the step during the GPU's backward and after it (a 0.6B
# GPT, against the same stage without offload), stage 3 eager and with engine.compile() (the ~1B GPT, inductor), then
# bf16 inference tokens/s of a 124M GPT-2 config.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible'; print(torch.cuda.get_device_name(0))"
timeout 240 python3 -m pytest -q -m gpu tests/distributed/test_gpu.py
timeout 300 python3 benchmarks/gpu_bench.py "$@"
timeout 240 python3 benchmarks/gpu_bench.py --stages 2 3 --offload cpu --layers 12 --steps 6
timeout 240 python3 benchmarks/gpu_bench.py --stages 3 --compile --steps 8
timeout 90 python3 benchmarks/tp_inference.py --tp 1 --dtype bf16 --repeats 2
