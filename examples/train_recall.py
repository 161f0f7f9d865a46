"""Train a small Mamba-3 MIMO language model (flash-linear-attention's Mamba3ForCausalLM,
is_mimo=True) on multi-query associative recall, on this package's operator.

Each sequence lists key-value pairs, then asks for the values of some of its keys again: the
model must store the pairs in its state and read them back. A query is answered right when the
token after it is the key's value; chance is 1 / VALUES.

    python examples/train_recall.py --out recall.png

prints a progress bar, the tokens per second and the final query accuracy, and writes a PNG of
the loss curve. With --reference N the same model (same initial weights, same batches) is also
trained N steps on the float64 PyTorch reference of the operator, and both curves are drawn.
Needs a CUDA GPU (the layer refuses other devices) and flash-linear-attention 0.6.0
(`pip install -e .[clients]`); no mamba_ssm or TileLang.
"""
from __future__ import annotations

import argparse
import copy
import importlib
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F

import mamba3_mimo.compat

KEYS, VALUES = 64, 64  # key tokens 1..KEYS, value tokens KEYS+1..KEYS+VALUES; 0 is padding


def recall_batch(batch: int, pairs: int, queries: int, gen: torch.Generator, device: str):
    """(tokens [batch, 2 * pairs + 2 * queries], targets of the same shape, -100 except after a
    query): pairs distinct keys with random values, then `queries` of those keys, each followed
    by its value."""
    keys = torch.stack([torch.randperm(KEYS, generator=gen)[:pairs] for _ in range(batch)]) + 1
    values = torch.randint(KEYS + 1, KEYS + VALUES + 1, (batch, pairs), generator=gen)
    asked = torch.stack([torch.randperm(pairs, generator=gen)[:queries] for _ in range(batch)])
    context = torch.stack([keys, values], -1).flatten(1)
    query = torch.stack([keys.gather(1, asked), values.gather(1, asked)], -1).flatten(1)
    tokens = torch.cat([context, query], 1)
    targets = torch.full_like(tokens, -100)
    # the token after each query key is its value: predicted at the key's position
    q_at = 2 * pairs + 2 * torch.arange(queries)
    targets[:, q_at] = tokens[:, q_at + 1]
    return tokens.to(device), targets.to(device)


def build_model(layers: int, hidden: int, device: str):
    """Mamba3ForCausalLM with MIMO layers, imported after the switch to this package."""
    if not mamba3_mimo.compat.install():
        raise SystemExit("a real mamba_ssm is installed; run without it to train on mamba3_mimo")
    layer = sys.modules.get("fla.layers.mamba3")
    if layer is not None and getattr(layer, "mamba3_mimo_combined", None) is None:
        # flash-linear-attention resolves upstream's path when it is imported
        raise SystemExit("fla was imported before mamba3_mimo.compat.install(); install first")
    models = importlib.import_module("fla.models")
    config = models.Mamba3Config(vocab_size=KEYS + VALUES + 1, hidden_size=hidden,
                                 num_hidden_layers=layers, state_size=64, head_dim=32, expand=2,
                                 is_mimo=True, mimo_rank=4, chunk_size=16,
                                 fuse_cross_entropy=False)
    return models.Mamba3ForCausalLM(config).to(device)


def train(model, steps: int, batch: int, pairs: int, queries: int, lr: float, seed: int,
          device: str, label: str) -> dict:
    """Train `steps` steps; the loss per step, the tokens per second and the final accuracy."""
    from tqdm import tqdm
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    losses: List[float] = []
    tokens_seen, t0 = 0, None
    bar = tqdm(range(steps), desc=label, file=sys.stderr)
    for step in bar:
        if step == 1:  # the first step compiles the kernels: timed apart
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        tokens, targets = recall_batch(batch, pairs, queries, gen, device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=tokens).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step >= 1:
            tokens_seen += tokens.numel()
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0 if t0 else float("nan")
    return dict(losses=losses, tokens_per_s=tokens_seen / seconds,
                accuracy=accuracy(model, batch, pairs, queries, seed + 1, device))


@torch.no_grad()
def accuracy(model, batch: int, pairs: int, queries: int, seed: int, device: str) -> float:
    """The share of queries whose value the model predicts (argmax), on fresh batches."""
    gen = torch.Generator().manual_seed(seed)
    right = total = 0
    for _ in range(4):
        tokens, targets = recall_batch(batch, pairs, queries, gen, device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(input_ids=tokens).logits.argmax(-1)
        asked = targets != -100
        right += (pred[asked] == targets[asked]).sum().item()
        total += asked.sum().item()
    return right / total


def plot(curves: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, losses in curves.items():
        ax.plot(losses, label=label, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (queries)")
    ax.set_title("Mamba-3 MIMO on associative recall")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--pairs", type=int, default=8, help="key-value pairs per sequence")
    p.add_argument("--queries", type=int, default=4, help="keys asked again per sequence")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reference", type=int, default=0, metavar="N",
                   help="also train N steps on the float64 reference operator")
    p.add_argument("--out", type=Path, default=Path("recall_loss.png"))
    opts = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("train_recall needs a CUDA GPU (flash-linear-attention's layer refuses "
                         "other devices)")
    torch.manual_seed(opts.seed)
    model = build_model(opts.layers, opts.hidden, "cuda")
    start = copy.deepcopy(model.state_dict())
    run = dict(batch=opts.batch, pairs=opts.pairs, queries=opts.queries, lr=opts.lr,
               seed=opts.seed, device="cuda")
    result = train(model, opts.steps, label="mamba3_mimo", **run)
    curves = {"mamba3_mimo": result["losses"]}
    if opts.reference:
        from mamba3_mimo.reference import mamba3_mimo_reference
        layers = importlib.import_module("fla.layers.mamba3")
        ours = layers.mamba3_mimo_combined
        layers.mamba3_mimo_combined = lambda *a, **k: mamba3_mimo_reference(*a, **k)
        try:
            model.load_state_dict(start)
            ref = train(model, opts.reference, label="reference", **run)
        finally:
            layers.mamba3_mimo_combined = ours
        curves["float64 reference operator"] = ref["losses"]
        n = min(opts.reference, opts.steps)
        gap = max(abs(a - b) for a, b in zip(result["losses"][:n], ref["losses"][:n]))
        result["reference_max_loss_gap"] = gap
    plot(curves, opts.out)
    print(f"{result['tokens_per_s']:,.0f} tokens/s, query accuracy {result['accuracy']:.3f} "
          f"(chance {1 / VALUES:.3f}), loss {result['losses'][-1]:.3f}; loss curve in {opts.out}"
          + (f"; largest loss gap to the reference over {opts.reference} steps "
             f"{result['reference_max_loss_gap']:.3f}" if opts.reference else ""))
    return result


if __name__ == "__main__":
    main()
