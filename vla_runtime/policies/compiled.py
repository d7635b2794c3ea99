"""The modules a step runs, eager or ``torch.compile``-d (``SessionConfig.compile``), and the warm-up that pays
the compilation when a session is created instead of in its first control tick.

What is compiled (the same callables an eager step runs):

- ``PrismaticVLM.embed_image``: vision towers + projector. Static shapes: one graph.
- ``LlamaModel.layers_forward`` with the session's cache: embeddings, norms, projections, the cache's
  ``attend`` (store the new K/V, RoPE, SDPA) and the MLPs of every layer, no graph break for the ``full``
  and ``chunked`` caches. A prefill and a one-token decode are distinct graphs; the cache's token counts are
  Python ints, symbolic in the graphs (``dynamic=True``), so decode steps at growing lengths share one graph.
  What the cache decides on the host runs eagerly around the compiled pass (``CompiledDecoder``): before it,
  ``plan_forward`` (slots, positions, the rotated view's rebuild after a layout change); after it,
  ``end_forward`` (commit, compression with its data-dependent chunk admission). The graph reads the plan
  and stores no Python state, so a layout change never forces a new graph.
- ``generation.greedy_tokens`` with a cache whose plans and commits trace (``traces_token_loop``: the full cache
  with dynamic shapes; the chunked cache under the decode's mark once it has compressed): a greedy decode's n - 1
  one-token forwards, LM-head rows and argmaxes as one graph (``CompiledTokenLoop``), one compiled call for an
  action's tokens instead of one per token.

The compiled callables live on the policy (``PrismaticPolicy.step_modules``), one set per ``CompileMode`` and
cache mode, so every session of a policy with that cache shares them (and their compiled code).
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass
from typing import Callable

import torch

from ..config import CompileMode
from ..kv.slot_cache import SlotCache
from ..models.generation import TokenHead, greedy_tokens
from ..models.llama import LlamaModel
from ..models.prismatic.modeling_prismatic import PrismaticVLM

RECOMPILE_LIMIT = 16  # graphs of one callable (prefill, decode, history frames, ...) before dynamo runs it eagerly
MAX_LOOP_LAYERS = 64  # decoder-layer passes one compiled token loop may unroll (``CompiledTokenLoop``)


@dataclass(frozen=True)
class StepModules:
    """The callables a step runs. ``embed_image``: pixels [B, 3 * towers, H, W] -> image tokens [B, N, dim].
    ``decoder``: ``LlamaModel.forward``'s signature (input_ids [B, T] or inputs_embeds [B, T, dim], ``cache``,
    ``pin``) -> final-normed hidden states [B, T, dim]; the module itself when eager (its hooks run).
    ``token_loop``: a greedy decode in one compiled call where it applies (``CompiledTokenLoop``), ``None`` when
    eager."""

    mode: CompileMode
    embed_image: Callable[[torch.Tensor], torch.Tensor]
    decoder: Callable[..., torch.Tensor]
    token_loop: CompiledTokenLoop | None = None


class CompiledDecoder:
    """``LlamaModel.forward`` with the layer pass compiled: the cache plans the forward (``plan_forward``), the
    compiled ``layers_forward`` runs, the cache commits (``end_forward``); planning and committing run eagerly."""

    def __init__(self, model: LlamaModel, **options) -> None:
        layers = compile_apart(model.layers_forward, **options)
        self.layers = graph_output(layers) if options.get("mode") == "reduce-overhead" else layers

    def __call__(
        self, input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None, *,
        cache: SlotCache, pin: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        """input_ids [B, T] or inputs_embeds [B, T, dim] -> final-normed hidden states [B, T, dim]."""
        cache.plan_forward((input_ids if inputs_embeds is None else inputs_embeds).shape[1])
        hidden = self.layers(input_ids, inputs_embeds, cache=cache)
        cache.end_forward(pin=pin)
        return hidden


class CompiledTokenLoop:
    """``generation.greedy_tokens`` ``torch.compile``-d whole (``fullgraph=True``): n greedy tokens, the n - 1
    one-token forwards planned and committed inside the graph, for caches whose plans trace
    (``traces_token_loop``); ``applies`` says when. Each compiled call costs dynamo's and AOTAutograd's wrappers
    before any kernel runs, about as much as a small decoder's whole decode forward on a CPU: one call per action
    instead of one per token. The loop is unrolled, so its graph holds (n - 1) x layers decoder-layer passes; past
    ``MAX_LOOP_LAYERS`` tokens are decoded one call each (compile time grows with the graph, and a decoder that deep
    is bound by reading its weights, not by the calls: 7B-sized layers compiled run at 1.01-1.04x eager on a CPU).
    Not under CUDA graphs (``reduce-overhead``): its caches have static shapes."""

    def __init__(self, model: LlamaModel, **options) -> None:
        self.model = model
        self._loop = compile_apart(greedy_tokens, fullgraph=True, **options)

    def applies(self, head: TokenHead, cache: SlotCache, n: int) -> bool:
        """n tokens of a plain greedy head over a cache that traces a loop of forwards, within ``MAX_LOOP_LAYERS``."""
        fits = (n - 1) * len(self.model.layers) <= MAX_LOOP_LAYERS
        return fits and head.plain_greedy and getattr(cache, "traces_token_loop", False)

    def __call__(self, logits: torch.Tensor, head: TokenHead, cache: SlotCache, n: int) -> torch.Tensor:
        """logits [B, V'] after the prompt (already in ``cache``) -> ids [B, n]: ``decode``'s tokens."""
        with cache.tokens_ahead(n - 1):
            return self._loop(self.model, cache, head.weight, head.offset, logits, n)


def step_modules(vlm: PrismaticVLM, mode: CompileMode, device: torch.device) -> StepModules:
    """The step's modules of ``vlm`` for ``mode``. ``REDUCE_OVERHEAD`` off CUDA is a ``ValueError`` (CUDA graphs
    need a CUDA device). Compiling is lazy: the first calls (the session's warm-up) compile."""
    if mode is CompileMode.OFF:
        return StepModules(mode, vlm.embed_image, vlm.language_model.model)
    options = compile_options(mode, device)
    vision = compile_apart(vlm.embed_image, **{**options, "dynamic": False})  # one image size: static shapes
    if mode is CompileMode.REDUCE_OVERHEAD:
        vision = graph_output(vision)
        return StepModules(mode, vision, CompiledDecoder(vlm.language_model.model, **options))
    model = vlm.language_model.model
    return StepModules(mode, vision, CompiledDecoder(model, **options), CompiledTokenLoop(model, **options))


class CompiledDiT:
    """A diffusion transformer's two noise predictions (``DiT.__call__`` and ``forward_with_cfg``, CogACT's
    ``action_model.net``) ``torch.compile``-d with static shapes: a session samples one chunk of one size. The
    DDIM loop around them stays eager (its noise comes from the session's CPU generator)."""

    def __init__(self, net: torch.nn.Module, **options) -> None:
        self._forward = static_call(net.forward, **options)
        self.forward_with_cfg = static_call(net.forward_with_cfg, **options)

    def __call__(self, x: torch.Tensor, t: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """x: [B, T, A] noisy actions, t: [B] timesteps, z: [B, 1, token_size] condition -> eps [B, T, A]."""
        return self._forward(x, t, z)


def static_call(fn: Callable[..., torch.Tensor], **options) -> Callable[..., torch.Tensor]:
    """``fn`` compiled with static shapes (``options`` from ``compile_options``; its output copied out of the graph
    pool under ``reduce-overhead``), called on fresh contiguous copies of its tensor arguments: a slice's strides
    (a size-1 batch dim's included, which ``contiguous`` keeps) follow the tensor it was cut from, e.g. the
    prompt's length, and a static graph guards on them, so a new instruction would recompile in a control step."""
    compiled = compile_apart(fn, **{**options, "dynamic": False})
    if options.get("mode") == "reduce-overhead":
        compiled = graph_output(compiled)

    def call(*args, **kwargs) -> torch.Tensor:
        return compiled(*map(_fresh, args), **{k: _fresh(v) for k, v in kwargs.items()})

    return call


def compile_apart(fn: Callable, **options) -> Callable:
    """``torch.compile(fn, **options)`` over a copy of ``fn``'s code object (a function, or a method bound to the
    same object); another callable (a module) is compiled as it is. Dynamo keeps graphs, guards and the recompile
    count on the code object, so every policy's compiled callables keep their own: two models of different layouts
    (one with fused projections) otherwise share ``layers_forward``'s graphs, and a call with the guards skipped
    (``SessionConfig.compile_guards`` False) may pick the other model's graph. torch 2.11 did: ``KeyError:
    'qkv_proj'`` on an H200, 2026-11-30, the pinned torch tells them apart. A torch without
    ``isolate_recompiles`` would also count one recompile limit for every model."""
    func = getattr(fn, "__func__", fn)
    if not isinstance(func, types.FunctionType):
        return torch.compile(fn, **options)
    copy = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__, func.__closure__)
    copy.__kwdefaults__, copy.__qualname__, copy.__module__ = func.__kwdefaults__, func.__qualname__, func.__module__
    copy.__doc__ = func.__doc__
    bound = types.MethodType(copy, fn.__self__) if inspect.ismethod(fn) else copy
    return torch.compile(bound, **options)


def _fresh(arg):
    """A tensor copied with contiguous strides; anything else as it is."""
    return arg.clone(memory_format=torch.contiguous_format) if isinstance(arg, torch.Tensor) else arg


def graph_output(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``fn`` returning a copy of its output. A CUDA graph's output lives in the graph's memory pool, which a
    later replay (of any graph in the pool) overwrites; what a step keeps across calls (image tokens, hidden
    states) must be copied out. Seen on an H100: "accessing tensor output of CUDAGraphs that has been overwritten
    by a subsequent run" in a history-mode step. The copy is a few MB at most (image tokens of a 7B model)."""
    return lambda *args, **kwargs: fn(*args, **kwargs).clone()


def compile_options(mode: CompileMode, device: torch.device) -> dict:
    """``torch.compile`` keyword arguments of a compiled ``mode`` on ``device`` (``ValueError``: ``REDUCE_OVERHEAD``
    off CUDA)."""
    if mode is CompileMode.OFF:
        raise ValueError("`compile` is 'off': nothing to compile")
    if mode is CompileMode.REDUCE_OVERHEAD and device.type != "cuda":
        raise ValueError(
            f"`compile` is {mode.value!r}: CUDA graphs need a CUDA device, and the policy is on {device}; "
            f"use {CompileMode.DEFAULT.value!r} (torch.compile without CUDA graphs) there"
        )
    # dynamic: the cache's token counts are symbolic from the first trace (no recompile per length). The recompiles
    # of these callables are counted apart from other torch.compile calls of the same functions (the limit is per
    # code object otherwise: sessions of another cache would use it up).
    options = {"dynamic": True, "isolate_recompiles": True, "recompile_limit": RECOMPILE_LIMIT}
    if mode is CompileMode.REDUCE_OVERHEAD:
        options["mode"] = "reduce-overhead"
    elif device.type == "cpu":
        # inductor's C++ wrapper calls the graph's kernels: its Python wrapper's ~650 tensor views and size/stride
        # checks per tiny-OpenVLA step were ~1 ms of a 5-ms compiled step (README, "Speed")
        options["options"] = {"cpp_wrapper": True}
    accepted = inspect.signature(torch.compile).parameters  # a torch older than the pinned one lacks the two
    return {k: v for k, v in options.items() if k in accepted}  # recompile options (torch 2.11: shared counter)
