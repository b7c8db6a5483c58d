"""What passes between neighbouring pipeline stages: activations forward, their gradients back, and the word that a
stage failed.

Two channels per pair of neighbours, one per direction (a tag each), every message on them starting with one int64:

- activations (stage s to s + 1): the announcement's length and the announcement (``zeroshard.pipe.messages``:
  shapes, dtypes, requires-grad flags), or 0 when it is the one sent last on this channel, then the tensors. The
  receiver allocates what the announcement says, after checking it, so tensors of mixed dtypes and tuples arrive
  whole and a mismatch is a named error, never a wait for bytes that will not come;
- gradients (stage s + 1 to s): 0, then the gradient of each activation announced as requiring one, in order.

A negative first word instead says "stop": ``-1 - rank`` of the rank that failed, or ``-1 - world - rank`` when that
rank's data ended before its batch exchanged anything (the end of an epoch). A stage that fails sends it on both
its outgoing channels, the only ones its neighbours may be waiting on; a stage that receives it passes it on the
same way and stops too, so a failure anywhere reaches every stage of the pipeline and none waits forever. A receive
waits no longer than the group's collectives do, and names the neighbour that stayed silent.
Sends do not wait (the schedule relies on it, ``zeroshard.pipe.schedule``); :meth:`StageExchange.finish` waits for
them at the end of the batch. A rank running several chunks of the model (DualPipeV's two, interleaved 1F1B's) has an
exchange per chunk (``Links``: its neighbours and tags), so it may reach a neighbour on several channels per
direction.

With tensor parallelism inside the stages, the T tensor-parallel ranks of a stage hold the same activations (a stage
ends after a row-parallel layer's sum) and the same input gradients (a column-parallel layer sums them). Each then
sends only its 1/T slice of every tensor to its peer of the next (previous) stage, which gathers the slices over its
own tensor group (DeepSpeed's ``pipeline.pipe_partitioned`` / ``grad_partitioned``): the link between stages carries
1/T of the bytes, the tensor group's link the rest, and what arrives is bit for bit what was held.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional, Union

import torch

from .. import comm
from .messages import Announcement, announce, encode, parse
from .schedule import PipeSchedule

ACTIVATIONS, GRADIENTS = 21, 22  # point-to-point tags of the two channels


class PipelineError(RuntimeError):
    """A pipeline stage stopped because another one failed (or the stages disagree about what they exchange)."""


class StageAborted(PipelineError):
    """Rank ``origin`` failed: a neighbour passed the word on (``source``: its rank) or the ranks of this stage agreed
    on it (``source`` None). ``data_ended``: its data iterator ended before its batch exchanged anything."""

    def __init__(self, message: str, origin: int, source: Optional[int] = None, data_ended: bool = False):
        super().__init__(message)
        self.origin, self.source, self.data_ended = origin, source, data_ended

    def __reduce__(self):
        # an exception pickles as its class and args (the message alone here); a harness that returns a rank's
        # exception through a pipe (multiprocessing.Pool, as DeepSpeed's tests run ranks) unpickles it, and an
        # unpickling error there ends the pool's result thread: the caller would wait for ever
        return type(self), (self.args[0], self.origin, self.source, self.data_ended)


Output = Union[torch.Tensor, tuple]


@dataclass(frozen=True)
class Links:
    """Where one chunk of the model a rank runs exchanges: the pipeline stages (positions in the pipe group) running
    the previous and the next chunk (None at the model's ends, or where that chunk runs on this rank: no exchange),
    and the tags of each boundary: a boundary's channels are told apart by the phase of the chunk the activations
    flow into (``PipeSchedule.phase_of``), which both of its ends know, so chunks of one rank pair never share one."""

    previous: Optional[int]
    next: Optional[int]
    incoming: int = 0
    outgoing: int = 0


class StageExchange:
    """This rank's ends of the channels to the previous and next stages of its pipe group (for one chunk)."""

    def __init__(
        self,
        pipe: comm.Group,
        stage: int,
        stages: int,
        device: torch.device,
        limit_bytes: int,
        slices: Optional[dict[int, comm.Group]] = None,
        links: Optional[Links] = None,
    ):
        """``slices``: per channel tag (activations, gradients), the tensor group whose ranks each send a slice of
        the tensors on it (the module's docstring); a channel not named sends them whole. ``links``: where this
        chunk of the model exchanges (a rank running several chunks has an exchange for each); default: stage
        ``stage`` of a line of ``stages``."""
        self.pipe, self.stage, self.device = pipe, stage, device
        self.slices = {tag: group for tag, group in (slices or {}).items() if group.size > 1}
        links = links or Links(stage - 1 if stage > 0 else None, stage + 1 if stage < stages - 1 else None)
        self.previous = pipe.ranks[links.previous] if links.previous is not None else None
        self.next = pipe.ranks[links.next] if links.next is not None else None
        self.links = links
        self._in_flight: list[tuple[comm.Pending, list[torch.Tensor]]] = []  # sends and the tensors they read
        self.waited = 0.0  # seconds spent in receives so far (the pipeline's bubble, and the transfers)
        self._sent_header: Optional[list] = None  # the announcement sent last to the next stage (its fields)
        self._received: Optional[Announcement] = None  # and the one received last from the previous stage
        self.exchanged = False  # whether this batch has sent or received anything but a stop word
        self.world_size = comm.get_world_size()
        self.limit_bytes = limit_bytes  # the most one announced tensor may take on this stage

    def send_activations(self, output: Output) -> Announcement:
        """Send ``output`` (a tensor or a tuple of them) to the next stage; returns its announcement (the gradients
        coming back are those of its tensors announced as requiring one)."""
        announcement = announce(output)
        header = encode(announcement)
        tensors = [output] if isinstance(output, torch.Tensor) else list(output)
        if header.tolist() == self._sent_header:  # the receiver reuses the last announcement
            self._post(self.next, ACTIVATIONS, [torch.zeros(1, dtype=torch.int64, device=self.device), *tensors], 1)
        else:
            self._sent_header = header.tolist()
            header = header.to(self.device)
            self._post(self.next, ACTIVATIONS, [header.new_tensor([header.numel()]), header, *tensors], 2)
        return announcement

    def receive_activations(self) -> tuple[Announcement, Output]:
        """The previous stage's output: leaves requiring grad where it announced so."""
        sender = f"stage {self._stage_of(self.previous)} (rank {self.previous})"
        length = self._first_word(self.previous, ACTIVATIONS, "activations")
        if length == 0 and self._received is not None:
            announcement = self._received
        elif 3 <= length <= 4096:
            header = torch.empty(length, dtype=torch.int64, device=self.device)
            announcement = self._received = parse(self._receive(header, self.previous, ACTIVATIONS), sender)
            sizes = [math.prod(meta.shape) * meta.dtype.itemsize for meta in announcement.tensors]
            if sum(sizes) > self.limit_bytes:  # checked before anything is allocated for it
                largest = announcement.tensors[sizes.index(max(sizes))]
                raise PipelineError(
                    f"rank {comm.get_rank()}: {sender} announced activations of {sum(sizes)} bytes (the largest "
                    f"{tuple(largest.shape)} {largest.dtype}), more than pipeline.max_activation_bytes allows "
                    f"({self.limit_bytes}); raise that key if the model really sends so much between stages"
                )
        else:
            raise PipelineError(f"rank {comm.get_rank()}: {sender} announced a header of {length} fields")
        tensors = []
        for meta in announcement.tensors:
            tensor = self._receive_payload(meta, self.previous, ACTIVATIONS)
            tensors.append(tensor.requires_grad_(meta.requires_grad))
        return announcement, tensors[0] if announcement.single else tuple(tensors)

    def send_gradients(self, grads: list[torch.Tensor]) -> None:
        self._post(self.previous, GRADIENTS, [torch.zeros(1, dtype=torch.int64, device=self.device), *grads], words=1)

    def receive_gradients(self, announcement: Announcement) -> list[torch.Tensor]:
        """The gradients of the tensors ``announcement`` (what this stage sent) marked as requiring one."""
        self._first_word(self.next, GRADIENTS, "gradients")
        return [
            self._receive_payload(meta, self.next, GRADIENTS) for meta in announcement.tensors if meta.requires_grad
        ]

    def begin(self) -> None:
        """A batch starts: nothing of it exchanged yet."""
        self.exchanged = False

    def finish(self) -> None:
        """Wait until every send of the batch has been received."""
        for pending, _ in self._in_flight:
            pending.wait()
        self._in_flight.clear()

    def _post(self, peer: Optional[int], tag: int, tensors: list[torch.Tensor], words: int) -> None:
        """Send ``tensors`` to ``peer``: the first ``words`` (the status word, the announcement) whole, the payload
        whole or this rank's slice of each (``slices``)."""
        self.exchanged = True
        group = self.slices.get(tag)
        for index, tensor in enumerate(tensors):
            tensor = _wire(tensor.detach().contiguous())
            if group is not None and index >= words:
                tensor = _slice(tensor, group)
            try:
                pending = comm.send(tensor, peer, self.pipe, tag=self.wire_tag(tag, True), async_op=True)
            except comm.CollectiveError as err:  # the neighbour closed the channel: it stopped waiting for us
                stage = self._stage_of(peer)
                raise StageAborted(
                    f"rank {comm.get_rank()} (pipeline stage {self.stage}): rank {peer} (pipeline stage {stage}) "
                    "stopped waiting for this stage and closed the channel (its own error says why)",
                    peer,
                    source=peer,
                ) from err
            self._in_flight.append((pending, [tensor]))

    def wire_tag(self, tag: int, sending: bool) -> int:
        """The point-to-point tag of ``tag``'s channel (activations or gradients) as this end sends or receives on
        it: activations go out to the next chunk and gradients come back from it on the outgoing boundary's tags,
        the other two on the incoming boundary's (``Links``)."""
        outgoing = (tag == ACTIVATIONS) == sending
        return tag + 2 * (self.links.outgoing if outgoing else self.links.incoming)

    def _stage_of(self, peer: int) -> int:
        return self.pipe.ranks.index(peer)

    def _first_word(self, peer: int, tag: int, what: str) -> int:
        word = int(self._receive(torch.zeros(1, dtype=torch.int64, device=self.device), peer, tag, word=True).item())
        if word < 0:
            origin, data_ended = -1 - word, False
            if origin >= self.world_size:
                origin, data_ended = origin - self.world_size, True
            if origin >= self.world_size:
                raise PipelineError(
                    f"rank {comm.get_rank()} (pipeline stage {self.stage}): rank {peer} sent the stop word {word}, "
                    f"which names no rank of this {self.world_size}-rank world"
                )
            raise StageAborted(
                f"rank {comm.get_rank()} (pipeline stage {self.stage}): stopped waiting for {what} from rank {peer}: "
                f"rank {origin} " + ("ran out of data" if data_ended else "failed") + " (its own error says why)",
                origin,
                source=peer,
                data_ended=data_ended,
            )
        return word

    def _receive_payload(self, meta, peer: int, tag: int) -> torch.Tensor:
        """One announced tensor from ``peer``: whole, or this rank's slice gathered over the tensor group."""
        tensor = torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
        group = self.slices.get(tag)
        if group is None:
            return self._receive(tensor, peer, tag)
        wire = _wire(tensor)
        per = -(-wire.numel() // group.size)
        gathered = torch.empty(per * group.size, dtype=wire.dtype, device=self.device)
        self._receive(gathered[group.rank * per : (group.rank + 1) * per], peer, tag)
        comm.all_gather(gathered, gathered[group.rank * per : (group.rank + 1) * per], group)
        wire.view(-1).copy_(gathered[: wire.numel()])
        return tensor

    def _receive(self, tensor: torch.Tensor, peer: int, tag: int, word: bool = False) -> torch.Tensor:
        started = time.perf_counter()
        try:
            comm.recv(_wire(tensor), peer, self.pipe, tag=self.wire_tag(tag, False))
        except comm.CollectiveError as err:
            stage = self._stage_of(peer)
            raise PipelineError(
                f"rank {comm.get_rank()} (pipeline stage {self.stage}): nothing came from rank {peer} (pipeline stage "
                f"{stage}) within the process group's timeout ({comm.group_timeout(self.pipe)}): it is stuck or gone "
                "(in user code: a data loader, a filesystem?)"
            ) from err
        self.waited += time.perf_counter() - started
        if not word:
            self.exchanged = True
        return tensor


def links_of(schedule: PipeSchedule, phase: int) -> Links:
    """Where this rank's chunk of ``phase`` exchanges, as ``schedule`` places the chunks (``Links``)."""
    virtual, last = schedule.virtual_stage(phase), schedule.virtual_stages() - 1

    def away(neighbour: int) -> Optional[int]:  # the stage running it, unless it is off the model or on this rank
        return None if not 0 <= neighbour <= last or schedule.runs(neighbour) else schedule.owner(neighbour)

    outgoing = schedule.phase_of(virtual + 1) if virtual < last else 0
    return Links(away(virtual - 1), away(virtual + 1), schedule.phase_of(virtual), outgoing)


def stop_neighbours(
    exchanges: list[StageExchange],
    origin: int,
    owed: list[tuple[bool, bool]],
    source: Optional[int] = None,
    data_ended: bool = False,
) -> list:
    """Tell the neighbours that rank ``origin`` failed (``data_ended``: its data ended before its batch exchanged
    anything), on the channels of ``exchanges`` (this rank's, one per chunk of the model it runs) they may wait on:
    per exchange, ``owed`` says whether the batch still owes its next stage activations and its previous one
    gradients; never ``source`` (the neighbour the word came from: it has stopped). A neighbour reached by several
    channels (DualPipeV's two chunks) gets the word on each and takes it on the one it reads.

    The words are posted, not waited for (a neighbour that stopped on its own never takes its word, and waiting
    for one that will not come would hold up the words to the others, or time out and close the channel); returned
    with the batch's earlier sends still on their way (a neighbour takes those first), for the caller to keep alive:
    a send whose handle is dropped is never delivered. No neighbour joins the agreement on the failure that follows
    before it has taken its word or stopped."""
    world = exchanges[0].world_size
    word = torch.tensor([-1 - origin - (world if data_ended else 0)], dtype=torch.int64, device=exchanges[0].device)
    posted = []
    for exchange, (owes_next, owes_previous) in zip(exchanges, owed):
        for peer, tag, owes in ((exchange.next, ACTIVATIONS, owes_next), (exchange.previous, GRADIENTS, owes_previous)):
            if owes and peer is not None and peer != source:
                try:
                    posted.append(comm.send(word, peer, exchange.pipe, tag=exchange.wire_tag(tag, True), async_op=True))
                except comm.CollectiveError:
                    pass  # the neighbour closed the channel: it has stopped
        posted += exchange._in_flight  # the batch's sends not yet taken: never waited for, the receiver may stop
        exchange._in_flight = []
    return posted


def _slice(tensor: torch.Tensor, group: comm.Group) -> torch.Tensor:
    """This rank's slice of ``tensor`` (flattened, zero-padded to a multiple of the group's size)."""
    flat = tensor.reshape(-1)
    per = -(-flat.numel() // group.size)
    start, stop = group.rank * per, min((group.rank + 1) * per, flat.numel())
    if stop - start == per:
        return flat[start:stop]
    piece = flat.new_zeros(per)
    piece[: max(stop - start, 0)] = flat[start:stop]
    return piece


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as sent: booleans travel as bytes (NCCL has no bool), a view sharing its storage."""
    return tensor.view(torch.uint8) if tensor.dtype == torch.bool else tensor
