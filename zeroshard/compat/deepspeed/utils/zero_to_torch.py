"""``deepspeed.utils.zero_to_torch`` (DeepSpeed 0.19.8): the command line that writes a checkpoint's weights in fp32,
fp16 or bf16 (``python -m deepspeed.utils.zero_to_torch CKPT_DIR OUT_DIR --dtype bf16``), over
``zero_to_fp32.convert_zero_checkpoint_to_state_dict``. The checkpoint is zeroshard's; DeepSpeed's own files are
imported first with ``zeroshard convert --from-deepspeed``."""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

from . import zero_to_fp32


def main(args: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="Convert a ZeRO checkpoint to fp32, fp16 or bf16 PyTorch weights.")
    parser.add_argument("checkpoint_dir", type=str, help="the checkpoint folder (the one holding 'latest')")
    parser.add_argument("output_dir", type=str, help="directory for the converted state_dict files")
    parser.add_argument("--dtype", type=str, choices=sorted(zero_to_fp32.OUTPUT_DTYPE_NAMES), required=True)
    parser.add_argument("--max_shard_size", type=str, default="5GB", help="such as 5GB or 500MB")
    parser.add_argument("--safe_serialization", default=False, action="store_true", help="write safetensors")
    parser.add_argument("-t", "--tag", type=str, default=None, help="the checkpoint tag, e.g. global_step1")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="exclude frozen parameters")
    parser.add_argument("-d", "--debug", action="store_true", help="accepted (zeroshard prints nothing more)")
    parsed = parser.parse_args(args)
    zero_to_fp32.convert_zero_checkpoint_to_state_dict(
        parsed.checkpoint_dir,
        parsed.output_dir,
        dtype=parsed.dtype,
        max_shard_size=parsed.max_shard_size,
        safe_serialization=parsed.safe_serialization,
        tag=parsed.tag,
        exclude_frozen_parameters=parsed.exclude_frozen_parameters,
    )


if __name__ == "__main__":
    main()
