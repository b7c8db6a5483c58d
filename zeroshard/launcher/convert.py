"""``zeroshard convert``: a zeroshard checkpoint's weights as safetensors (or fp16 / bf16), a DeepSpeed checkpoint
imported as a zeroshard one, or a zeroshard checkpoint exported as DeepSpeed's universal folder. It imports no torch
until it runs (the launcher's rule)."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence


def _convert_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zeroshard convert",
        description="Write a checkpoint's fp32 weights as safetensors (streaming); with --from-deepspeed, import a "
        "DeepSpeed checkpoint (ZeRO rank files, a pipeline's stage and layer files, or a universal folder) as a "
        "zeroshard checkpoint (optimizer state included) to resume from; with --to deepspeed-universal, write a "
        "zeroshard checkpoint as a DeepSpeed universal folder (OUT_DIR/<tag>_universal and OUT_DIR/latest_universal) "
        "that DeepSpeed resumes with "
        '"checkpoint": {"load_universal": true}.',
    )
    parser.add_argument("checkpoint_dir")
    parser.add_argument(
        "output",
        help="a .safetensors file, or a directory for (sharded) HF-style files; with --from-deepspeed the "
        "directory to write the zeroshard checkpoint into",
    )
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: the one in 'latest')")
    parser.add_argument("--max_shard_size", default="5GB")
    parser.add_argument("--no_progress", action="store_true", help="no progress bar (on stderr)")
    parser.add_argument(
        "--from-deepspeed",
        dest="from_deepspeed",
        action="store_true",
        help="CHECKPOINT_DIR holds DeepSpeed's files (read without running any pickled code)",
    )
    parser.add_argument(
        "--dtype",
        choices=["fp32", "fp16", "bf16"],
        default="fp32",
        help="the floating-point weights' dtype in the safetensors written (DeepSpeed 0.19.8's zero_to_torch --dtype)",
    )
    parser.add_argument(
        "--to",
        choices=["safetensors", "deepspeed-universal"],
        default="safetensors",
        help="what to write from a zeroshard checkpoint: its fp32 weights (default), or the whole training state as "
        "a DeepSpeed universal checkpoint",
    )
    parser.add_argument(
        "--pipeline_stages",
        type=int,
        default=None,
        help="with --to deepspeed-universal, a pipeline's checkpoint for DeepSpeed's pipeline engine at this many "
        "stages: its layer files and one engine state per stage beside the universal folder",
    )
    return parser


def convert_main(argv: Sequence[str]) -> int:
    """``zeroshard convert CKPT_DIR OUT [--tag T] [--max_shard_size 5GB] [--dtype bf16] [--no_progress]``,
    ``zeroshard convert --from-deepspeed DS_DIR OUT_DIR [--tag T]`` (a ZeRO or universal checkpoint of DeepSpeed's), or
    ``zeroshard convert CKPT_DIR OUT_DIR --to deepspeed-universal [--tag T] [--pipeline_stages N]``."""
    parser = _convert_parser()
    args = parser.parse_args(argv)
    if args.from_deepspeed and args.to != "safetensors":
        parser.error("--from-deepspeed writes a zeroshard checkpoint; --to applies to zeroshard checkpoints")
    if args.pipeline_stages is not None and args.to != "deepspeed-universal":
        parser.error("--pipeline_stages applies to --to deepspeed-universal")
    if args.dtype != "fp32" and (args.from_deepspeed or args.to != "safetensors"):
        parser.error("--dtype applies to the weights written as safetensors, not to whole training states")
    from ..checkpoint import (
        CheckpointError,
        convert_deepspeed_checkpoint,
        convert_zero_checkpoint_to_fp32_state_dict,
        export_universal_checkpoint,
    )

    try:
        if args.from_deepspeed:
            print(convert_deepspeed_checkpoint(args.checkpoint_dir, args.output, tag=args.tag))
            return 0
        if args.to == "deepspeed-universal":
            stages = args.pipeline_stages
            print(export_universal_checkpoint(args.checkpoint_dir, args.output, tag=args.tag, pipeline_stages=stages))
            return 0
        files = convert_zero_checkpoint_to_fp32_state_dict(
            args.checkpoint_dir,
            args.output,
            tag=args.tag,
            max_shard_size=args.max_shard_size,
            progress=not args.no_progress,
            dtype=args.dtype,
        )
    except (CheckpointError, ValueError) as err:
        print(f"zeroshard convert: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"zeroshard convert: cannot write {err.filename or args.output}: {err.strerror or err}", file=sys.stderr)
        return 2
    for path in files:
        print(path)
    return 0
