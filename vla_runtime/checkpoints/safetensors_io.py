"""Safetensors checkpoints in the Hugging Face layout: one ``model.safetensors`` or shards listed by
``model.safetensors.index.json`` (``{"metadata": {"total_size": N}, "weight_map": {name: shard}}``).

Shapes are read from the headers only (no tensor data), so a loader can build and check the model
before reading gigabytes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
FLOAT_DTYPES = ("F", "BF")  # prefixes of the header dtypes that are floating point (F64 .. F8_*, BF16)


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (the index's shards, or the single file). An index is
    checked against its shards' headers (``check_index``)."""
    path = Path(path)
    index = path / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index} is not a safetensors index (needs a `weight_map` object): {e}") from e
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index} `weight_map` must map tensor names to shard file names")
        files = [path / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"shard {file.name} listed in {index} does not exist")
        check_index(index, weight_map)
        return files
    single = path / WEIGHTS_NAME
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no weights file in {path}: expected {WEIGHTS_NAME} or {INDEX_NAME} with its shards")


def check_index(index: Path, weight_map: Mapping[str, str]) -> None:
    """Every ``weight_map`` entry names a tensor its shard holds, and every tensor of a listed shard is in the
    map under that shard (headers only); a ValueError naming the index and the tensor otherwise."""
    listed: dict[str, set[str]] = {}
    for name, shard in weight_map.items():
        listed.setdefault(shard, set()).add(name)
    stored: dict[str, set[str]] = {}
    for shard in sorted(listed):
        with open_safetensors(index.parent / shard) as f:
            stored[shard] = set(f.keys())
    for shard, names in sorted(listed.items()):
        if absent := sorted(names - stored[shard]):
            holders = [s for s, held in sorted(stored.items()) if absent[0] in held]
            where = f"it is stored in {holders[0]}" if holders else "no listed shard holds it"
            raise ValueError(
                f"{index} maps tensor `{absent[0]}` to {shard}, which does not hold it ({where}; {len(absent)} such entries); "
                "expected every weight_map entry to name a tensor of its shard"
            )
    for shard, names in sorted(listed.items()):
        if unlisted := sorted(stored[shard] - names):
            raise ValueError(
                f"{index} does not map tensor `{unlisted[0]}` of {shard} to it ({len(unlisted)} such tensors); "
                "expected every shard tensor in weight_map"
            )


def read_shapes(files: list[Path]) -> dict[str, tuple[tuple[int, ...], Path]]:
    """Tensor name -> (shape, file), from the headers. A name stored twice, or a tensor of a dtype that is not
    floating point (every weight of the models read this way is), raises ``ValueError``."""
    out: dict[str, tuple[tuple[int, ...], Path]] = {}
    for file in files:
        with open_safetensors(file) as f:
            for name in f.keys():
                if name in out:
                    raise ValueError(f"tensor `{name}` is stored in both {out[name][1].name} and {file.name}")
                tensor = f.get_slice(name)
                if not tensor.get_dtype().startswith(FLOAT_DTYPES):
                    raise ValueError(f"{file}: tensor `{name}` is stored as {tensor.get_dtype()}; expected a floating-point weight (F32, F16, BF16)")
                out[name] = (tuple(tensor.get_shape()), file)
    return out


def open_safetensors(file: Path):
    """``safe_open`` on CPU; a truncated or corrupt file is a ``ValueError`` naming it (safetensors checks the
    header and that the data section covers every tensor's offsets, so a file cut short fails here)."""
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except SafetensorError as e:
        size = file.stat().st_size
        raise ValueError(f"{file} is not a readable safetensors file ({size} bytes; truncated or corrupt): {e}") from e


def iter_tensors(names: Mapping[str, Path], *, device: torch.device | str, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for the given name -> file map, file by file, cast and placed on ``device``."""
    by_file: dict[Path, list[str]] = {}
    for name, file in names.items():
        by_file.setdefault(file, []).append(name)
    for file, group in by_file.items():
        with open_safetensors(file) as f:
            for name in group:
                yield name, f.get_tensor(name).to(device=device, dtype=dtype)


def save_safetensors(state: Mapping[str, torch.Tensor], path: str | Path, *, max_shard_bytes: int | None = None) -> list[Path]:
    """Write ``state`` into directory ``path`` as transformers does: ``model.safetensors``, or shards
    ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json`` past ``max_shard_bytes``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(path / WEIGHTS_NAME), metadata={"format": "pt"})
        return [path / WEIGHTS_NAME]
    files, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        files.append(path / name)
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return files
