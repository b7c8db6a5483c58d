"""``python -m deepspeed.checkpoint.ds_to_universal`` (open-instruct runs it before a ``load_universal`` resume;
OpenRLHF ships a script around it): DeepSpeed's arguments, served by
:func:`zeroshard.checkpoint.universal_export.write_universal_folder`. The input may be a zeroshard checkpoint
or DeepSpeed's ZeRO rank files; the output folder and ``latest_universal`` beside it are what DeepSpeed writes.
The worker counts and ``--no_strict`` / ``--inject_missing_state`` are accepted and need nothing here (no worker
pool; a plain model needs no Megatron metadata)."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from zeroshard.checkpoint import CheckpointError
from zeroshard.checkpoint.universal_export import write_universal_folder


def parse_arguments(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ds_to_universal")
    parser.add_argument("--input_folder", type=str, required=True, help="Input DeepSpeed Checkpoint folder")
    parser.add_argument("--output_folder", type=str, required=True, help="Output DeepSpeed checkpoint folder")
    parser.add_argument("--num_extract_workers", default=4, type=int)
    parser.add_argument("--num_merge_workers", default=2, type=int)
    parser.add_argument("--keep_temp_folder", action="store_true")
    parser.add_argument("--no_strict", dest="strict", action="store_false")
    parser.add_argument("--inject_missing_state", action="store_true")
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> None:
    print(write_universal_folder(args.input_folder, args.output_folder))


if __name__ == "__main__":
    try:
        main(parse_arguments())
    except CheckpointError as err:
        print(f"ds_to_universal: {err}", file=sys.stderr)
        sys.exit(2)
