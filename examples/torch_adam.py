"""Adam on scikit-learn's digits, any ``torch.optim`` optimizer over asynccoll's allreduce.

    pip install 'asynccoll[torch]'
    asynccoll run -n 4 examples/torch_adam.py --policy majority
    torchrun --nproc_per_node 4 examples/torch_adam.py --policy majority

``DistributedOptimizer(torch.optim.Adam(...), comm, policy)`` in a synchronous loop
(``opt.zero_grad(); loss.backward(); opt.step()``), without DDP: the wrapper broadcasts rank 0's
parameters and optimizer state at construction, reduces the gradients by ``--policy`` (a
policy's text: ``sync``, ``solo``, ``majority``, ``two_choice``, ``quorum:3``, ``backup:1``,
...) or ``--algorithm`` (``rna``, ``odsgd``) before Adam's step, and ``finish()`` averages the
replicas at the end. Same network, data and injected stragglers as
``examples/torch_ddp.py``.
"""

from __future__ import annotations

import argparse

import torch
from torch_ddp import add_arguments, convnet, digits, report, train

import asynccoll
from asynccoll.collectives.policy import POLICY_SYNTAX
from asynccoll.torch import DistributedOptimizer
from asynccoll.torch.optimizer import ALGORITHMS


def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    with asynccoll.init() as comm:
        data = digits(args.seed)
        net = convnet(args.seed + comm.rank)  # the wrapper broadcasts rank 0's parameters
        policy = args.policy if args.policy is not None or args.algorithm else "majority"
        opt = DistributedOptimizer(torch.optim.Adam(net.parameters(), lr=args.lr), comm,
                                   policy, algorithm=args.algorithm)
        infos = []

        def step(loss: torch.Tensor) -> None:
            opt.zero_grad()
            loss.backward()
            infos.append(opt.step())

        out = train(comm.rank, comm.size, net, step, args, data,
                    f"adam-{args.algorithm or opt.policy}")
        opt.finish()  # collective: drain, apply, average the replicas
        with torch.no_grad():
            out["accuracy"] = float((net(data[2]).argmax(1) == data[3]).float().mean())
        out["mean_contributors"] = sum(len(i.contributors) for i in infos) / len(infos)
        report(comm.rank, args, out)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", default=None,
                   help=f"the straggler policy (default majority): {POLICY_SYNTAX}")
    p.add_argument("--algorithm", default=None, choices=ALGORITHMS,
                   help="rna or odsgd, over its default policy unless --policy is given")
    p.add_argument("--lr", type=float, default=0.003)
    add_arguments(p)
    main(p.parse_args())
