"""Ulysses sequence parallelism for Hugging Face attention: the ranks of a sequence-parallel group each hold 1/P of
every sample's tokens, and only attention needs the whole sequence.

Everything but attention acts on each token alone, so it runs on the local tokens as it is. Around the core
attention, an all-to-all re-cuts q, k and v from [batch, heads, tokens/P, dim] (all heads, this rank's tokens) to
[batch, heads/P, tokens, dim] (the whole sequence, this rank's heads); attention runs per head, so each rank
computes its heads exactly; a second all-to-all brings the output back to this rank's tokens with all heads. The
backward of each exchange is the exchange the other way. Per attention layer and micro-step a rank sends
(P-1)/P of 2 x (q + k + v + output) bytes (forward and backward).

Heads must divide over the ranks: ``heads % P == 0``, and ``kv_heads % P == 0`` or ``P % kv_heads == 0``; in the
second case each key-value head is repeated ``P / kv_heads`` times before the exchange (every rank needs the one
its query heads read). Anything else is refused naming the counts.

Transformers calls attention through its ``ALL_ATTENTION_FUNCTIONS`` table by the name in the model's config, and
takes special paths for those names elsewhere (mask construction, for instance). So, as DeepSpeed does, the entry
of the chosen core implementation (``sdpa``) is replaced by a :class:`UlyssesAttention` that calls the original:
every other code path keeps seeing ``sdpa``. Registering again replaces the earlier wrapper, never wraps it. The
mask the model built covers the local tokens only, so it is dropped: attention is causal over the gathered
sequence (one sequence per sample; packed samples, whose ``position_ids`` restart inside a row, are refused).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .. import comm
from ..comm.autograd import all_to_all_in_group

CORE_IMPLEMENTATIONS_ON_GPU = ("flash_attention_2", "flash_attention_3")
_HEADS, _TOKENS = 1, 2  # dims of transformers' q / k / v: [batch, heads, tokens, head_dim]


@dataclass(frozen=True)
class SequenceParallelGroups:
    """The mesh Ulysses sequence parallelism was registered on, answering DeepSpeed's ``mpu`` getters
    (``parallel_state_sp``): ``register_with_transformers`` builds the mesh once and returns this, and
    ``initialize(mpu=...)`` runs the engine on that mesh (its collectives then count in the same ledger as
    attention's; where the config adds a dimension the registration could not know, hybrid sharding or experts,
    the engine's mesh adopts the sequence group)."""

    mesh: comm.Mesh

    @property
    def sequence(self) -> comm.Group:
        """The ranks that split each sample's tokens."""
        return self.mesh.sequence

    @property
    def sequence_data(self) -> comm.Group:
        """DeepSpeed's "sequence data parallel" group: the ranks whose gradients sum into one update (data x
        sequence; the mesh's ``gradient``)."""
        return self.mesh.gradient

    def get_sequence_parallel_group(self) -> Any:
        return comm.process_group(self.sequence)

    def get_sequence_parallel_world_size(self) -> int:
        return self.sequence.size

    def get_sequence_parallel_rank(self) -> int:
        return self.sequence.rank

    def get_sequence_data_parallel_group(self) -> Any:
        return comm.process_group(self.sequence_data)

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.sequence_data.size

    def get_sequence_data_parallel_rank(self) -> int:
        return self.sequence_data.rank

    # one parallel axis besides data: DeepSpeed aliases model parallelism to it
    get_model_parallel_group = get_sequence_parallel_group
    get_model_parallel_world_size = get_sequence_parallel_world_size
    get_model_parallel_rank = get_sequence_parallel_rank


def sequence_parallel_groups(sequence_parallel_size: int, tensor_parallel_size: int = 1) -> SequenceParallelGroups:
    """Build the mesh of ``sequence_parallel_size``-way sequence parallelism beside ``tensor_parallel_size``-way
    tensor parallelism over the whole world (a collective call); its collectives count in a context of their own,
    which an engine built on it shares."""
    for name, size in (
        ("sequence_parallel_size", sequence_parallel_size),
        ("tensor_parallel_size", tensor_parallel_size),
    ):
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError(f"{name} must be an int, got {size!r}")
    if not comm.is_initialized():
        raise RuntimeError(
            "sequence parallelism needs the process group: launch with zeroshard / torchrun and call "
            "zeroshard.comm.init_distributed() (or torch.distributed.init_process_group) first"
        )
    dims = comm.ParallelDims.for_world(comm.get_world_size(), tp=tensor_parallel_size, sp=sequence_parallel_size)
    return SequenceParallelGroups(comm.build_mesh(dims, registered=True))


@dataclass(frozen=True)
class HeadLayout:
    """How one model's heads go over ``ranks``: pure, so the rule is testable without processes."""

    heads: int
    kv_heads: int
    ranks: int

    def __post_init__(self):
        if self.heads % self.ranks:
            raise ValueError(
                f"{self.heads} attention heads do not divide over sequence_parallel_size {self.ranks}: "
                "Ulysses gives each rank heads / sequence_parallel_size whole heads"
            )
        if self.kv_heads % self.ranks and self.ranks % self.kv_heads:
            raise ValueError(
                f"{self.kv_heads} key-value heads and sequence_parallel_size {self.ranks}: one must divide the other "
                "(key-value heads are split over the ranks, or repeated sequence_parallel_size / kv_heads times)"
            )

    @classmethod
    def under_tensor_parallelism(cls, heads: int, kv_heads: int, ranks: int, tensor_parallel_size: int) -> HeadLayout:
        """The layout of the heads one tensor-parallel rank holds (its columns of q, k and v: heads / tp)."""
        if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int):
            raise TypeError(f"tensor_parallel_size must be an int, got {tensor_parallel_size!r}")
        for what, count in (("attention", heads), ("key-value", kv_heads)):
            if tensor_parallel_size < 1 or count % tensor_parallel_size:
                raise ValueError(
                    f"{count} {what} heads do not divide over tensor_parallel_size {tensor_parallel_size}: tensor "
                    "parallelism gives each rank whole heads"
                )
        return cls(heads // tensor_parallel_size, kv_heads // tensor_parallel_size, ranks)

    @property
    def kv_repeats(self) -> int:
        """Copies of each key-value head sent (1 unless there are fewer key-value heads than ranks)."""
        return max(1, self.ranks // self.kv_heads)

    @property
    def local_heads(self) -> int:
        return self.heads // self.ranks

    @property
    def local_kv_heads(self) -> int:
        return self.kv_heads * self.kv_repeats // self.ranks


class _GroupedHeads:
    """The attention module as the core attention sees it after the exchange: its own attributes, except the
    number of query heads per key-value head, which changes when key-value heads were repeated."""

    def __init__(self, module: torch.nn.Module, num_key_value_groups: int):
        self._module = module
        self.num_key_value_groups = num_key_value_groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


class UlyssesAttention:
    """A transformers attention function (``fn(module, q, k, v, mask, **kwargs) -> (out, weights)``) computing
    ``core`` over the whole sequence held in pieces by the ranks of ``group`` (see the module docstring)."""

    def __init__(
        self,
        core: Callable,
        core_name: str,
        heads: HeadLayout,
        group: comm.Group,
        seq_length: Optional[int] = None,
        disable_in_eval: bool = False,
    ):
        self.core, self.core_name, self.heads, self.group = core, core_name, heads, group
        self.seq_length, self.disable_in_eval = seq_length, disable_in_eval

    def __call__(self, module, query, key, value, attention_mask, *args, **kwargs):
        if self.disable_in_eval and not module.training:
            return self.core(module, query, key, value, attention_mask, *args, **kwargs)
        self._check(module, query, key, kwargs.get("position_ids"))
        if self.heads.kv_repeats > 1:
            key = key.repeat_interleave(self.heads.kv_repeats, dim=_HEADS)
            value = value.repeat_interleave(self.heads.kv_repeats, dim=_HEADS)
        query, key, value = (all_to_all_in_group(t, self.group, _HEADS, _TOKENS) for t in (query, key, value))
        if self.core_name != "sdpa" and "position_ids" in kwargs:  # flash attention reads positions of every token
            kwargs["position_ids"] = _gathered(kwargs["position_ids"], self.group)
        groups = self.heads.local_heads // self.heads.local_kv_heads
        seen = module if getattr(module, "num_key_value_groups", groups) == groups else _GroupedHeads(module, groups)
        out, weights = self.core(seen, query, key, value, None, *args, **kwargs)
        # out: [batch, tokens, heads / P, head_dim] -> this rank's tokens with every head
        return all_to_all_in_group(out, self.group, 1, 2), weights

    def _check(self, module, query: torch.Tensor, key: torch.Tensor, position_ids: Optional[torch.Tensor]) -> None:
        if query.shape[_HEADS] != self.heads.heads or key.shape[_HEADS] != self.heads.kv_heads:
            raise ValueError(
                f"Ulysses attention was registered for {self.heads.heads} query / {self.heads.kv_heads} key-value "
                f"heads and got {query.shape[_HEADS]} / {key.shape[_HEADS]}"
            )
        local = query.shape[_TOKENS]
        if self.seq_length is not None and local * self.group.size != self.seq_length:
            raise ValueError(
                f"Ulysses attention: {local} tokens per rank x {self.group.size} ranks != seq_length "
                f"{self.seq_length} (register with seq_length_is_variable=True for varying lengths)"
            )
        if getattr(module, "layer_idx", 0) != 0:
            return  # positions are the same for every layer: checked at the first
        if position_ids is None:
            raise ValueError(
                "Ulysses attention needs position_ids in every forward (each rank's tokens at their place in the "
                "whole sequence); UlyssesSPDataLoaderAdapter puts them in the batch"
            )
        expected = self.group.rank * local + torch.arange(local, device=position_ids.device)
        same = (position_ids.reshape(-1, local) == expected.expand(position_ids.numel() // local, local)).all()
        if torch.compiler.is_compiling():  # in the graph, not a break: a data-dependent branch would end it here
            torch._assert_async(same, "Ulysses attention: position_ids are not this rank's tokens' places in the "
                                "sequence (packed samples are not supported; give one sequence per row)")  # fmt: skip
            return
        if not bool(same):
            raise ValueError(
                f"Ulysses attention: rank {self.group.rank} of the sequence-parallel group got position_ids that are "
                f"not {self.group.rank * local}..{(self.group.rank + 1) * local - 1} (its tokens' places in the "
                "sequence): packed samples (positions restarting inside a row) are not supported with "
                f"{self.core_name}; give one sequence per row"
            )


def _gathered(local: torch.Tensor, group: comm.Group) -> torch.Tensor:
    out = local.new_empty((group.size, *local.shape))
    comm.all_gather(out, local.contiguous(), group)
    return torch.cat(out.unbind(0), dim=-1)


def register_with_transformers(
    model_name_or_path: Any,
    core_attn_implementation: str,
    sequence_parallel_size: int,
    micro_batch_size: int,
    seq_length: Optional[int] = None,
    seq_length_is_variable: bool = True,
    disable_in_eval: bool = False,
    tensor_parallel_size: int = 1,
) -> Optional[SequenceParallelGroups]:
    """Build the sequence-parallel groups and route the model's attention (``core_attn_implementation``, e.g.
    ``"sdpa"``) through Ulysses; returns the groups, to pass as ``initialize(mpu=...)`` (``None`` when
    ``sequence_parallel_size`` is 1). ``model_name_or_path``: the model, or a name / path its config loads from.
    ``tensor_parallel_size``: the engine's ``tensor_parallel.autotp_size`` when both run together: each rank then
    holds heads / tp heads, which Ulysses splits further, and the groups are laid out as the engine's mesh."""
    if isinstance(sequence_parallel_size, bool) or not isinstance(sequence_parallel_size, int):
        raise TypeError(f"sequence_parallel_size must be an int, got {sequence_parallel_size!r}")
    if sequence_parallel_size == 1:
        return None
    for name, value in (("micro_batch_size", micro_batch_size), ("seq_length", seq_length)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"register_with_transformers: {name} must be a positive int, got {value!r}")
    if not seq_length_is_variable and seq_length is None:
        raise ValueError("register_with_transformers: seq_length_is_variable=False needs seq_length=")
    if seq_length is not None and seq_length % sequence_parallel_size:
        raise ValueError(
            f"seq_length {seq_length} does not divide over sequence_parallel_size {sequence_parallel_size}"
        )
    core = _core_attention(core_attn_implementation)
    config = _text_config(model_name_or_path, core_attn_implementation)
    heads = HeadLayout.under_tensor_parallelism(
        config.num_attention_heads,
        getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        sequence_parallel_size,
        tensor_parallel_size,
    )
    groups = sequence_parallel_groups(sequence_parallel_size, tensor_parallel_size)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = UlyssesAttention(
        core,
        core_attn_implementation,
        heads,
        groups.sequence,
        seq_length=None if seq_length_is_variable else seq_length,
        disable_in_eval=disable_in_eval,
    )
    return groups


def _text_config(model_name_or_path: Any, core: str) -> Any:
    """The config whose head counts Ulysses splits; a loaded model's attention implementation must be ``core``."""
    if hasattr(model_name_or_path, "config"):
        config = model_name_or_path.config
        active = getattr(config, "_attn_implementation", None)
        if active is not None and active != core:
            raise ValueError(
                f"core_attn_implementation {core!r} but the model runs {active!r}: load the model with "
                f"attn_implementation={core!r} so Ulysses wraps the attention it calls"
            )
    elif isinstance(model_name_or_path, (str, bytes)) or hasattr(model_name_or_path, "__fspath__"):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_name_or_path)
    else:
        raise TypeError(
            "register_with_transformers: model_name_or_path must be a model with a .config, or a Hugging Face name "
            f"or path, got {type(model_name_or_path).__name__}"
        )
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _core_attention(name: str) -> Callable:
    """The original attention function registered under ``name`` (under an earlier wrapper: the one it wraps)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if not isinstance(name, str):
        raise TypeError(f"core_attn_implementation must be a string such as 'sdpa', got {name!r}")
    if name in ("eager", "paged|eager"):
        raise ValueError(
            f"core_attn_implementation {name!r} is not supported under Ulysses: it materializes the "
            "[tokens, tokens] mask of the whole sequence; use 'sdpa'"
        )
    if name in CORE_IMPLEMENTATIONS_ON_GPU and not torch.cuda.is_available():
        raise ValueError(f"core_attn_implementation {name!r} needs a CUDA device; on CPU use 'sdpa'")
    if name not in ("sdpa", *CORE_IMPLEMENTATIONS_ON_GPU):
        raise ValueError(
            f"core_attn_implementation {name!r} is not supported under Ulysses; use 'sdpa' (or "
            f"{' / '.join(CORE_IMPLEMENTATIONS_ON_GPU)} on CUDA)"
        )
    current = ALL_ATTENTION_FUNCTIONS[name]
    return current.core if isinstance(current, UlyssesAttention) else current


class UlyssesSPAttentionHF(UlyssesAttention):
    """DeepSpeed's name for the Ulysses attention of Hugging Face models: clients (Accelerate, the HF Trainer, ALST
    recipes) call its ``register_with_transformers``."""

    @classmethod
    def register_with_transformers(
        cls,
        model_name_or_path: Any,
        core_attn_implementation: str,
        sequence_parallel_size: int,
        micro_batch_size: int,
        seq_length: Optional[int] = None,
        seq_length_is_variable: bool = True,
        disable_in_eval: bool = False,
        max_length: Optional[int] = None,
        tensor_parallel_size: int = 1,
    ) -> Optional[SequenceParallelGroups]:
        """:func:`register_with_transformers` (``max_length`` is DeepSpeed's deprecated ``seq_length``)."""
        if max_length is not None:
            warnings.warn("register_with_transformers(max_length=) is deprecated: use seq_length=", stacklevel=2)
            seq_length = seq_length if seq_length is not None else max_length
        return register_with_transformers(
            model_name_or_path,
            core_attn_implementation,
            sequence_parallel_size,
            micro_batch_size,
            seq_length=seq_length,
            seq_length_is_variable=seq_length_is_variable,
            disable_in_eval=disable_in_eval,
            tensor_parallel_size=tensor_parallel_size,
        )


def attention_all_to_all_bytes(
    batch: int, local_tokens: int, head_dim: int, heads: HeadLayout, element_size: int
) -> int:
    """Message bytes one rank hands to all-to-all per attention layer and micro-step, forward and backward: q, k, v
    (key-value heads repeated) in, the output back; the ledger counts (P-1)/P of it on the wire. Pure."""
    per_head = batch * local_tokens * head_dim * element_size
    kv = heads.kv_heads * heads.kv_repeats
    return 2 * per_head * (2 * heads.heads + 2 * kv)


__all__ = [
    "HeadLayout",
    "SequenceParallelGroups",
    "UlyssesAttention",
    "UlyssesSPAttentionHF",
    "attention_all_to_all_bytes",
    "register_with_transformers",
    "sequence_parallel_groups",
]
