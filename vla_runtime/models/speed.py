"""The load-time speed options every built-in family takes, applied in their one valid order.

    speed_up(model, model.language_model.model.layers, fuse=True, quantize=QuantMode.INT8)   # an OpenVLA

``fuse`` joins q/k/v and gate/up of the LLM's decoder layers (``models.fuse``), ``quantize`` makes those layers'
weights int8/int4 (``models.quantize``), ``prepack`` gives every float32 linear layer of the whole model that is
large enough a weight prepacked for oneDNN (``models.prepack``; quantized layers are left alone). Fusing must come
before quantizing (``fused_linear`` takes plain layers), prepacking last (it skips what quantizing replaced). Every
family's loader calls this after its adapter merge, so LoRA is merged into the plain weights first.
"""

from __future__ import annotations

import logging

import torch.nn as nn

from .fuse import fuse_projections
from .prepack import MIN_PACKED_WEIGHTS, prepack_linears
from .quantize import QuantMode, quantize_linears

log = logging.getLogger(__name__)

SPEED_OPTIONS = ("quantize", "fuse", "prepack")  # the keyword arguments every built-in family's loader takes


def speed_up(model: nn.Module, llm_layers: nn.ModuleList, *, quantize: QuantMode = QuantMode.NONE, fuse: bool = False,
             prepack: bool = False) -> None:  # fmt: skip
    """Apply the options to a loaded ``model`` in place; ``llm_layers``: its LLM's decoder layers (inside ``model``).

    A model on the meta device (structure only, ``vla-runtime info``) is fused and quantized but not prepacked:
    there is no weight to pack.
    """
    if fuse:
        fused = fuse_projections(llm_layers)
        log.info("fused q/k/v and gate/up in %d decoder layers of the LLM", fused)
    if quantize is not QuantMode.NONE:
        replaced = quantize_linears(llm_layers, quantize)
        log.info("quantized %d linear layers of the LLM to %s (weights only)", replaced, quantize.value)
    if prepack and next(model.parameters()).device.type != "meta":
        packed = prepack_linears(model)
        log.info("prepacked %d linear layers for oneDNN (layers under %d weights stay ATen's)", packed, MIN_PACKED_WEIGHTS)
