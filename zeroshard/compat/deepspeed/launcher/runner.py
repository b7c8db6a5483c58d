"""``deepspeed.launcher.runner``."""

DEEPSPEED_ENVIRONMENT_NAME = ".deepspeed_env"  # file of KEY=VALUE lines exported to every rank

__all__ = ["DEEPSPEED_ENVIRONMENT_NAME"]
