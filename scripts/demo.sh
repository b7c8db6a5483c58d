#!/usr/bin/env bash
# Set up, then train the small GPT example on 2 CPU processes with ZeRO stage 2.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec zeroshard --num_gpus 2 examples/train_gpt.py --deepspeed_config examples/configs/stage2.json "$@"
