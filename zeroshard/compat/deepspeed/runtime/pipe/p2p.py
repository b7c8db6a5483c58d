"""``deepspeed.runtime.pipe.p2p``: DeepSpeed's point-to-point calls between pipeline stages over process groups it
keeps globally. zeroshard's stages exchange through the engine's own channels (``zeroshard.pipe.exchange``: the
shapes announced, failures passed on); an engine subclass that sends by itself (qlora-pipe's) is not served."""

from ..._not_built import not_built

_WHY = "stages exchange through the pipeline engine's instructions; subclass its _exec_* methods instead"
send = not_built("deepspeed.runtime.pipe.p2p.send", _WHY)
recv = not_built("deepspeed.runtime.pipe.p2p.recv", _WHY)

__all__ = ["recv", "send"]
