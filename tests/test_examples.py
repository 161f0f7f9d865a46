"""examples/train_recall.py: its task (every query's target is the value its key was paired
with, chance 1 / VALUES), its refusal without a GPU, and on a GPU a short training run that
learns the task far above chance with a loss curve close to the reference operator's."""
import importlib.util
from pathlib import Path

import pytest
import torch

from conftest import requires_gpu

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_recall.py"


def _example():
    spec = importlib.util.spec_from_file_location("train_recall", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_recall_task():
    ex = _example()
    tokens, targets = ex.recall_batch(5, pairs=6, queries=3, gen=torch.Generator().manual_seed(0),
                                      device="cpu")
    assert tokens.shape == targets.shape == (5, 18)
    for seq, tgt in zip(tokens.tolist(), targets.tolist()):
        pairs = dict(zip(seq[0:12:2], seq[1:12:2]))
        assert len(pairs) == 6 and all(1 <= k <= ex.KEYS < v for k, v in pairs.items())
        asked = [i for i, t in enumerate(tgt) if t != -100]
        assert asked == [12, 14, 16]
        assert all(tgt[i] == pairs[seq[i]] == seq[i + 1] for i in asked)


def test_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("checks the refusal without a GPU")
    with pytest.raises(SystemExit, match="CUDA GPU"):
        _example().main(["--steps", "1"])


@requires_gpu
def test_learns_recall_on_the_gpu(tmp_path):
    """The example's defaults (1,500 steps) on our operator learn the task: query accuracy
    above 0.1 where chance is 1/64 (0.188 measured on the H200, 2026-12-03); over the first 30
    steps the loss stays within 0.05 of the float64 reference operator's."""
    if importlib.util.find_spec("fla") is None:  # not imported: the example installs first
        pytest.skip("flash-linear-attention is not installed")
    result = _example().main(["--reference", "30",
                              "--out", str(tmp_path / "loss.png")])
    print(f"recall: accuracy {result['accuracy']:.3f}, {result['tokens_per_s']:.0f} tokens/s, "
          f"gap {result['reference_max_loss_gap']:.4f}")
    assert result["accuracy"] > 0.1
    assert result["reference_max_loss_gap"] <= 0.05
    assert (tmp_path / "loss.png").stat().st_size > 0
