"""Prepacked linear layers for eager inference on the CPU: each float32 weight reordered once, at load, into
oneDNN's blocked layout, so that a forward's matmuls skip the packing ATen's GEMM does on every call.

    prepack_linears(model)    # after any adapter merge, fusing and quantization; float32 weights on the CPU

``PrepackedLinear`` is an ``nn.Linear`` (the same parameters, state-dict names and ``weight``), so anything that
reads the weight still works. It multiplies by the packed copy only where that is the same computation:

- eager, with autograd not recording (``torch.inference_mode`` / ``no_grad``, as every policy step runs), on
  float32 inputs and weights on the CPU;
- ``F.linear`` everywhere else: training (no backward through the packed op is needed or used), other devices
  and dtypes, and under ``torch.compile`` (inductor picks its own kernels for a graph).

A weight changed in place after packing (``load_state_dict``, ``copy_``) is repacked at the next forward (its
version counter moved); a deep copy repacks its own weight. The packed copy is a second copy of the weights: it doubles the linear layers' memory.

Why: a decode token multiplies one row, or a batch of a few robots' rows, by every weight, and a frame's prefill
a few dozen rows. For such calls ATen's GEMM is far from the machine's limits; oneDNN's kernels on the prepacked
weight are not. On the 2-core build machine (``python benchmarks/bench_prepack.py --threads T``: a pass over
every weight of the serve bench's decoder, 96 MiB), prepacked is 1.26x / 1.45x as fast for one row on T = 1 / 2
threads, 1.58x / 1.89x for eight rows, 1.64x / 1.86x for a 21-token prefill; over a LLaMA-2-7B layer (772 MiB)
1.15x for one row on 2 threads and 2.6-3.1x for eight, but **0.82x for one row on one thread**. Layers with
fewer than ``MIN_PACKED_WEIGHTS`` weights stay ATen's: the packed op's fixed cost per call made the small
models (128 hidden and less) 0.6-0.75x as fast. Measure before you turn it on. The packed kernel's
row ``i`` does not depend on the other rows (a row computes the same bits alone or in a batch), ATen's does not
promise that. Every output is the same dot product as ``F.linear``'s up to the last bits of a float.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

PACK_ROWS_HINT = 8  # rows oneDNN picks the packed layout for: as fast as 1 or 64 for every batch measured (1-168)
# The packed op costs ~13 us per call before any arithmetic (ATen's F.linear ~2 us): on one thread of the build
# machine it lost to ATen on every weight of 256 x 256 and smaller and won from 512 x 512 (and 1024 x 256) at 8 rows.
MIN_PACKED_WEIGHTS = 1 << 18  # weights (out x in) below which a layer is left to ATen


def prepack_available() -> bool:
    """Whether this torch build has oneDNN (``torch.backends.mkldnn``), which prepacking needs."""
    return torch.backends.mkldnn.is_available()


class PrepackedLinear(nn.Linear):
    """``nn.Linear`` that runs eager CPU inference on a oneDNN-prepacked copy of its float32 weight (module doc).

    Build it with ``from_linear``; ``weight`` [out, in] and ``bias`` [out] are the original layer's parameters.
    """

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "PrepackedLinear":
        """A ``PrepackedLinear`` sharing ``linear``'s parameters (no copy of them; the packed copy is made now).
        ``ValueError`` for inference-tensor weights (a model built under ``torch.inference_mode``): they keep no
        version counter, so a later in-place change could not be told from the packed copy."""
        if linear.weight.is_inference():
            raise ValueError("cannot prepack a layer whose weight is an inference tensor (made under "
                             "torch.inference_mode): build or load the model outside inference mode")  # fmt: skip
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        new.weight, new.bias = linear.weight, linear.bias
        new._repack()
        return new

    def _repack(self) -> None:
        with torch.no_grad():
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), PACK_ROWS_HINT)
        self._packed_version = self._version_of(self.weight)

    def __getstate__(self) -> dict:
        # the packed copy is an opaque oneDNN tensor (no storage to copy or pickle): rebuilt from the weight
        state = self.__dict__.copy()
        state.pop("_packed", None)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._repack()

    @staticmethod
    def _version_of(weight: torch.Tensor) -> int | None:
        # an inference tensor (``from_linear`` refuses one; a weight swapped in later) keeps no version counter
        return None if weight.is_inference() else weight._version

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out]."""
        w = self.weight
        if (
            torch.compiler.is_compiling()
            or (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))
            or x.dtype != torch.float32
            or w.dtype != torch.float32
            or w.device.type != "cpu"
            or x.device.type != "cpu"
        ):
            return F.linear(x, w, self.bias)
        if self._version_of(w) != self._packed_version:
            self._repack()
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")


def prepack_linears(module: nn.Module, *, min_weights: int = MIN_PACKED_WEIGHTS) -> int:
    """Replace every plain ``nn.Linear`` inside ``module`` (not already prepacked, not quantized) with at least
    ``min_weights`` weights by a ``PrepackedLinear``, in place. Returns how many were replaced (0 for a model whose
    layers are all smaller: there the packed op's fixed cost per call exceeds what it saves).

    Raises ``RuntimeError`` when torch has no oneDNN, ``ValueError`` when a layer's weight is not float32 on
    the CPU (prepacking is for CPU inference in float32)."""
    if not prepack_available():
        raise RuntimeError("prepacked linear layers need a torch build with oneDNN (torch.backends.mkldnn)")
    if type(module) is nn.Linear:
        raise TypeError("prepack_linears replaces the layers inside a module: pass the module that holds the layer")
    targets = [(name, child) for name, child in module.named_modules() if type(child) is nn.Linear]
    for name, linear in targets:
        if linear.weight.device.type != "cpu" or linear.weight.dtype != torch.float32:
            raise ValueError(
                f"prepacking is for float32 weights on the CPU; {name} has {linear.weight.dtype} "
                f"weights on {linear.weight.device} (load the policy with dtype float32 on cpu)"
            )
    replaced = 0
    for name, linear in targets:
        if linear.weight.numel() < min_weights:
            continue
        module.set_submodule(name, PrepackedLinear.from_linear(linear))
        replaced += 1
    return replaced
