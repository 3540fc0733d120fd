"""Compare policies on the quickstart transformer without running backward.

`remat.compare` gives every remat region the policies in turn and reports the bytes
autograd keeps for backward and the FLOPs backward would recompute; `--measure` adds the
median step time (and the CUDA peak), `--plot` draws the memory-versus-recompute frontier.

    python examples/compare_policies.py --plot docs/frontier.png
    python examples/compare_policies.py --device cuda --d-model 1024 --layers 12 --seq 512 --measure
"""

from __future__ import annotations

import argparse

import torch

import remat
from remat import policies as P

from quickstart import VOCAB, batches, init_params, make_loss, transformer_block


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--measure", action="store_true", help="also time forward+backward (runs backward)")
    parser.add_argument("--plot", metavar="PNG", help="draw the frontier (needs matplotlib)")
    args = parser.parse_args()

    gen = torch.Generator().manual_seed(0)
    params = init_params(len(VOCAB), args.d_model, args.layers, gen, args.device)
    tokens = batches(args.seq, args.batch, gen, args.device)()
    block = remat.remat(transformer_block, static_argnums=2)
    loss = make_loss([lambda x, p: block(x, p, args.heads)] * args.layers)
    policies = [
        P.nothing_saveable,
        P.dots_with_no_batch_dims_saveable,
        P.dots_saveable,
        P.dots_saveable | P.save_ops("aten::_softmax"),
        P.everything_saveable,
        P.memory_budget(0.25),
        P.memory_budget(0.5),
        P.memory_budget(0.75),
    ]
    rows = remat.compare(loss, params, tokens, policies=policies, measure=args.measure)
    print(remat.format_comparison(rows))
    if args.plot:
        try:
            remat.plot_frontier(rows, args.plot, title=f"{args.layers}-layer transformer, d_model {args.d_model}")
            print(f"wrote {args.plot}")
        except ImportError as error:
            print(f"no plot: {error}")


if __name__ == "__main__":
    main()
