"""``deepspeed.env_report`` (``ds_report``): zeroshard's environment report under DeepSpeed's name."""

from zeroshard.env_report import main, report


def cli_main() -> None:
    main()


__all__ = ["cli_main", "main", "report"]
