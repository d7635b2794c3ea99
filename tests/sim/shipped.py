"""Checks every shipped policy under assets/ must pass: the upstream files, < 50 MB, a card naming its tasks."""

from pathlib import Path

UPSTREAM = ("config.json", "model.safetensors", "dataset_statistics.json", "tokenizer.json", "preprocessor_config.json")
LIMIT = 50 * 2**20


def assert_shipped_checkpoint(directory: Path, tasks: tuple[str, ...], extra: tuple[str, ...] = ()) -> None:
    """``directory`` holds the upstream layout plus ``extra`` and a README.md that names every task in ``tasks``."""
    names = {p.name for p in directory.iterdir()}
    for required in (*UPSTREAM, *extra, "README.md"):
        assert required in names, f"{required} missing from {directory}"
    size = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
    assert size < LIMIT, f"{directory} is {size / 2**20:.1f} MiB; shipped policies stay under {LIMIT // 2**20} MiB"
    card = (directory / "README.md").read_text()
    for task in tasks:
        assert task in card, f"the model card of {directory} does not report {task}"
