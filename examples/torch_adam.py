"""Adam on scikit-learn's digits, any ``torch.optim`` optimizer over asynccoll's allreduce.

    pip install 'asynccoll[torch]'
    asynccoll run -n 4 examples/torch_adam.py --mode majority
    torchrun --nproc_per_node 4 examples/torch_adam.py --mode majority

``DistributedOptimizer(torch.optim.Adam(...), comm, mode=...)`` in a synchronous loop
(``opt.zero_grad(); loss.backward(); opt.step()``), without DDP: the wrapper broadcasts rank 0's
parameters and optimizer state at construction, reduces the gradients by ``--mode`` (``sync``,
``solo``, ``majority``, ``two_choice``, ``quorum``, ``backup``, ``odsgd``) before Adam's step,
and ``finish()`` averages the replicas at the end. Same network, data and injected stragglers as
``examples/torch_ddp.py``.
"""

from __future__ import annotations

import argparse

import torch
from torch_ddp import add_arguments, convnet, digits, report, train

import asynccoll
from asynccoll.torch import DistributedOptimizer


def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    with asynccoll.init() as comm:
        data = digits(args.seed)
        net = convnet(args.seed + comm.rank)  # the wrapper broadcasts rank 0's parameters
        opt = DistributedOptimizer(torch.optim.Adam(net.parameters(), lr=args.lr), comm,
                                   mode=args.mode, quorum=args.quorum)
        infos = []

        def step(loss: torch.Tensor) -> None:
            opt.zero_grad()
            loss.backward()
            infos.append(opt.step())

        out = train(comm.rank, comm.size, net, step, args, data, f"adam-{args.mode}")
        opt.finish()  # collective: drain, apply, average the replicas
        with torch.no_grad():
            out["accuracy"] = float((net(data[2]).argmax(1) == data[3]).float().mean())
        out["mean_contributors"] = sum(len(i.contributors) for i in infos) / len(infos)
        report(comm.rank, args, out)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", default="majority", choices=("sync", "solo", "majority",
                                                          "two_choice", "quorum", "backup",
                                                          "odsgd"))
    p.add_argument("--quorum", type=int, default=None, help="k for --mode quorum")
    p.add_argument("--lr", type=float, default=0.003)
    add_arguments(p)
    main(p.parse_args())
