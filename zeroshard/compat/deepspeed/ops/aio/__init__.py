"""``deepspeed.ops.aio``: DeepSpeed's async I/O extension builder (not built here; see ``ops.op_builder``)."""

from ..op_builder import AsyncIOBuilder

__all__ = ["AsyncIOBuilder"]
