"""First-order DARTS with the architecture kept outside DDP.

The supernet weights are wrapped in DDP. The architecture logits live in a
small `Architect` module that is not wrapped: they are passed to the
network as inputs, and their gradients are averaged over ranks by hand.
The arch step runs under no_sync() so the (discarded) weight gradients of
that backward are not all-reduced.

    torchrun --nproc_per_node=4 12_darts_firstorder_ddp.py --data ./cifar --save runs/darts_fo
"""
import argparse
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

from darts_space import SearchNetwork, PRIMITIVES, derive_genotype

log = logging.getLogger(__name__)


class Architect(nn.Module):
    def __init__(self, n_edges, n_ops):
        super().__init__()
        self.alpha_normal = nn.Parameter(1e-3 * torch.randn(n_edges, n_ops))
        self.alpha_reduce = nn.Parameter(1e-3 * torch.randn(n_edges, n_ops))

    def weights(self):
        return F.softmax(self.alpha_normal, dim=-1), F.softmax(self.alpha_reduce, dim=-1)

    @torch.no_grad()
    def broadcast_(self, src=0):
        for p in self.parameters():
            dist.broadcast(p.data, src)

    def allreduce_grads_(self):
        world = dist.get_world_size()
        for p in self.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(world)


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="./cifar")
    ap.add_argument("--save", default="runs/darts_fo")
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=64, help="per GPU")
    ap.add_argument("--w-lr", type=float, default=0.025, help="for a global batch of 64")
    ap.add_argument("--w-lr-min", type=float, default=0.001)
    ap.add_argument("--w-wd", type=float, default=3e-4)
    ap.add_argument("--a-lr", type=float, default=3e-4)
    ap.add_argument("--a-wd", type=float, default=1e-3)
    ap.add_argument("--init-channels", type=int, default=16)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=2)
    return ap.parse_args()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    torch.manual_seed(args.seed + rank)   # per-rank dropout / augmentation streams
    np.random.seed(args.seed + rank)

    mean, std = [0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616]
    tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(mean, std)])
    data = torchvision.datasets.CIFAR10(args.data, train=True, transform=tf)
    # the split must be identical on every rank: use a dedicated RNG
    split_rng = np.random.RandomState(args.seed)
    idx = split_rng.permutation(len(data))
    half = len(data) // 2
    w_set, a_set = Subset(data, idx[:half].tolist()), Subset(data, idx[half:].tolist())
    w_sampler = DistributedSampler(w_set, shuffle=True, seed=args.seed)
    a_sampler = DistributedSampler(a_set, shuffle=True, seed=args.seed + 1)
    w_loader = DataLoader(w_set, args.batch_size, sampler=w_sampler, num_workers=4, pin_memory=True, drop_last=True)
    a_loader = DataLoader(a_set, args.batch_size, sampler=a_sampler, num_workers=4, pin_memory=True, drop_last=True)

    net = SearchNetwork(C=args.init_channels, num_classes=10, layers=args.layers).to(dev)
    model = DDP(net, device_ids=[local_rank])
    arch = Architect(net.num_edges, len(PRIMITIVES)).to(dev)
    arch.broadcast_()  # alphas were drawn from per-rank seeds

    w_lr = args.w_lr * args.batch_size * world / 64
    w_opt = torch.optim.SGD(model.parameters(), w_lr, momentum=0.9, weight_decay=args.w_wd)
    w_sched = torch.optim.lr_scheduler.CosineAnnealingLR(w_opt, args.epochs, eta_min=args.w_lr_min)
    a_opt = torch.optim.Adam(arch.parameters(), lr=args.a_lr, betas=(0.5, 0.999), weight_decay=args.a_wd)

    if rank == 0:
        os.makedirs(args.save, exist_ok=True)

    for epoch in range(args.epochs):
        w_sampler.set_epoch(epoch)
        a_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tot = torch.zeros(3, device=dev)
        for step, ((xw, yw), (xa, ya)) in enumerate(zip(w_loader, a_loader)):
            xw, yw = xw.to(dev, non_blocking=True), yw.to(dev, non_blocking=True)
            xa, ya = xa.to(dev, non_blocking=True), ya.to(dev, non_blocking=True)

            # 1) architecture step (first-order): only alpha grads are used
            a_opt.zero_grad(set_to_none=True)
            with model.no_sync():
                wn, wr = arch.weights()
                F.cross_entropy(model(xa, wn, wr), ya).backward()
            arch.allreduce_grads_()
            a_opt.step()

            # 2) weight step with the alphas frozen
            w_opt.zero_grad(set_to_none=True)   # drops the local grads of the arch backward
            wn, wr = (w.detach() for w in arch.weights())
            logits = model(xw, wn, wr)
            loss = F.cross_entropy(logits, yw)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            w_opt.step()

            tot += torch.stack([loss.detach() * yw.size(0), (logits.argmax(1) == yw).sum().float(),
                                torch.tensor(float(yw.size(0)), device=dev)])
            if step % 100 == 0:
                log.info("epoch %d step %d loss %.4f", epoch, step, loss.item())
        w_sched.step()
        dist.all_reduce(tot)

        genotype = derive_genotype(arch.alpha_normal.detach().cpu(), arch.alpha_reduce.detach().cpu())
        log.info("epoch %d loss %.4f acc %.2f%% time %.0fs", epoch, (tot[0] / tot[2]).item(),
                 (100 * tot[1] / tot[2]).item(), time.time() - t0)
        log.info("genotype %s", genotype)
        if rank == 0:
            torch.save({"epoch": epoch, "net": net.state_dict(), "arch": arch.state_dict(),
                        "w_opt": w_opt.state_dict(), "a_opt": a_opt.state_dict(),
                        "genotype": str(genotype)}, os.path.join(args.save, "search.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
