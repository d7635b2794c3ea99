"""The change-weighted loss (``--change-weight``): tokens that differ from the previous step's weigh more."""

import pytest
import torch

from vla_finetune.config import FinetuneConfig
from vla_finetune.model import change_weights


def test_tokens_that_change_from_the_previous_step_get_the_weight():
    # 1 episode, 3 steps, 2 action dims: dim 0 changes at step 1, dim 1 at step 2
    labels = torch.tensor([[5, 7, 6, 7, 6, 9]])
    w = change_weights(labels, steps=3, weight=4.0)
    assert w.tolist() == [[1.0, 1.0, 4.0, 1.0, 1.0, 4.0]]


def test_episodes_of_a_batch_are_weighted_separately_and_weight_one_is_plain():
    labels = torch.tensor([[1, 1, 1, 1], [1, 2, 3, 4]])  # steps of one token
    assert change_weights(labels, steps=4, weight=3.0).tolist() == [[1, 1, 1, 1], [1, 3, 3, 3]]
    assert torch.equal(change_weights(labels, steps=4, weight=1.0), torch.ones(2, 4))


def test_a_weight_below_one_is_refused(tmp_path):
    with pytest.raises(ValueError, match="change_weight"):
        FinetuneConfig(checkpoint=tmp_path, dataset=tmp_path, out=tmp_path, change_weight=0.5)
