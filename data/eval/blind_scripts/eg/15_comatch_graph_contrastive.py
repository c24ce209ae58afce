"""CoMatch (Li, Xiong & Hoi, ICCV 2021) on CIFAR-10: class probabilities and low-dimensional
embeddings are learned jointly; memory-smoothed pseudo-labels + graph contrastive loss.

The contrastive term is switched on after a few warm-up epochs, once the pseudo-labels
have become reasonable.

    torchrun --nproc_per_node=4 15_comatch_graph_contrastive.py --n-labeled 40 --contrast-start 5
"""
import argparse
import math
import os
import time
from copy import deepcopy

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from datasets.cifar_ssl import get_cifar10_ssl
from networks.wideresnet import WideResnetBackbone


def get_args():
    p = argparse.ArgumentParser("CoMatch")
    p.add_argument("--root", default="./data")
    p.add_argument("--exp-dir", default="./exp/comatch")
    p.add_argument("--n-labeled", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=16, help="labelled per GPU")
    p.add_argument("--mu", type=int, default=7)
    p.add_argument("--epochs", type=int, default=512)
    p.add_argument("--iters-per-epoch", type=int, default=1024)
    p.add_argument("--lr", type=float, default=0.03)
    p.add_argument("--wd", type=float, default=5e-4)
    p.add_argument("--thr", type=float, default=0.95)
    p.add_argument("--temperature", type=float, default=0.2)
    p.add_argument("--alpha", type=float, default=0.9, help="memory smoothing")
    p.add_argument("--contrast-th", type=float, default=0.8)
    p.add_argument("--lam-c", type=float, default=1.0)
    p.add_argument("--contrast-start", type=int, default=5, help="epoch at which the graph loss starts")
    p.add_argument("--queue-size", type=int, default=2560)
    p.add_argument("--low-dim", type=int, default=64)
    p.add_argument("--ema", type=float, default=0.999)
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args()


class CoMatchNet(nn.Module):
    def __init__(self, num_classes=10, low_dim=64):
        super().__init__()
        self.backbone = WideResnetBackbone(depth=28, widen=2)
        dim = self.backbone.out_dim
        self.classifier = nn.Linear(dim, num_classes)
        self.head = nn.Sequential(nn.Linear(dim, dim), nn.LeakyReLU(0.1, inplace=True), nn.Linear(dim, low_dim))

    def forward(self, x):
        f = self.backbone(x)
        return self.classifier(f), F.normalize(self.head(f), dim=1)


@torch.no_grad()
def concat_all_gather(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.cat(out)


class Queue:
    """Memory bank of (embedding, class probability) of labelled and weakly-augmented samples."""

    def __init__(self, size, low_dim, num_classes, device):
        self.feats = torch.zeros(size, low_dim, device=device)
        self.probs = torch.zeros(size, num_classes, device=device)
        self.ptr, self.size, self.full = 0, size, False

    @torch.no_grad()
    def push(self, feats, probs):
        feats, probs = concat_all_gather(feats), concat_all_gather(probs)
        n = feats.size(0)
        idx = (self.ptr + torch.arange(n, device=feats.device)) % self.size
        self.feats[idx] = feats
        self.probs[idx] = probs
        self.full = self.full or self.ptr + n >= self.size
        self.ptr = (self.ptr + n) % self.size


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    c = n = 0
    for x, y in loader:
        logits, _ = net(x.to(device))
        c += (logits.argmax(1).cpu() == y).sum().item()
        n += y.numel()
    return 100.0 * c / n


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)

    if rank == 0:
        get_cifar10_ssl(args.root, args.n_labeled, seed=args.seed, download=True)
    dist.barrier()
    lab_set, unl_set, test_set = get_cifar10_ssl(args.root, args.n_labeled, seed=args.seed,
                                                 expand_to=args.batch_size * world * args.iters_per_epoch)
    lab_sampler = DistributedSampler(lab_set, drop_last=True)
    unl_sampler = DistributedSampler(unl_set, drop_last=True)
    lab_loader = DataLoader(lab_set, args.batch_size, sampler=lab_sampler, num_workers=4, drop_last=True,
                            pin_memory=True)
    unl_loader = DataLoader(unl_set, args.batch_size * args.mu, sampler=unl_sampler, num_workers=8,
                            drop_last=True, pin_memory=True)
    test_loader = DataLoader(test_set, 512, num_workers=4)

    net = CoMatchNet(10, args.low_dim).to(device)
    ema_net = deepcopy(net).eval()
    model = DDP(net, device_ids=[local_rank])
    params_wd = [p for n, p in model.named_parameters() if "bn" not in n and "bias" not in n]
    params_nowd = [p for n, p in model.named_parameters() if "bn" in n or "bias" in n]
    optimizer = torch.optim.SGD([{"params": params_wd, "weight_decay": args.wd},
                                 {"params": params_nowd, "weight_decay": 0}],
                                lr=args.lr, momentum=0.9, nesterov=True)
    total = args.epochs * args.iters_per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: math.cos(7 * math.pi * s / (16 * total)))
    queue = Queue(args.queue_size, args.low_dim, 10, device)

    if rank == 0:
        os.makedirs(args.exp_dir, exist_ok=True)
    lab_round, unl_round = 0, 0
    lab_iter, unl_iter = iter(lab_loader), iter(unl_loader)
    best = 0.0
    for epoch in range(args.epochs):
        model.train()
        use_graph = epoch >= args.contrast_start
        t0 = time.time()
        for it in range(args.iters_per_epoch):
            try:
                x, y = next(lab_iter)
            except StopIteration:
                lab_round += 1
                lab_sampler.set_epoch(lab_round)
                lab_iter = iter(lab_loader)
                x, y = next(lab_iter)
            try:
                (u_w, u_s0, u_s1), _ = next(unl_iter)
            except StopIteration:
                unl_round += 1
                unl_sampler.set_epoch(unl_round)
                unl_iter = iter(unl_loader)
                (u_w, u_s0, u_s1), _ = next(unl_iter)

            bx, bu = x.size(0), u_w.size(0)
            y = y.to(device, non_blocking=True)
            imgs = torch.cat([x, u_w, u_s0, u_s1]).to(device, non_blocking=True)
            logits, feats = model(imgs)
            logits_x = logits[:bx]
            logits_w, logits_s0, _ = logits[bx:].split(bu)
            feats_x = feats[:bx]
            feats_w, feats_s0, feats_s1 = feats[bx:].split(bu)

            loss_x = F.cross_entropy(logits_x, y)
            with torch.no_grad():
                probs = logits_w.softmax(1)
                if use_graph and queue.full:
                    # memory-smoothed pseudo-labels
                    A = torch.softmax(feats_w.detach() @ queue.feats.t() / args.temperature, dim=1)
                    probs = args.alpha * probs + (1 - args.alpha) * A @ queue.probs
                scores, lbs_u = probs.max(1)
                mask = scores.ge(args.thr).float()
                queue.push(torch.cat([feats_w.detach(), feats_x.detach()]),
                           torch.cat([probs, F.one_hot(y, 10).float()]))

            loss_u = -(torch.sum(F.log_softmax(logits_s0, 1) * probs, dim=1) * mask).mean()
            loss = loss_x + loss_u
            if use_graph:
                # pseudo-label graph from the weak views, embedding graph from the two strong views
                sim = torch.exp(feats_s0 @ feats_s1.t() / args.temperature)
                sim_probs = sim / sim.sum(1, keepdim=True)
                Q = probs @ probs.t()
                Q.fill_diagonal_(1)
                Q = Q * (Q >= args.contrast_th).float()
                Q = Q / Q.sum(1, keepdim=True)
                loss_c = -(torch.log(sim_probs + 1e-7) * Q).sum(1).mean()
                loss = loss + args.lam_c * loss_c

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            with torch.no_grad():
                for pe, pm in zip(ema_net.parameters(), model.module.parameters()):
                    pe.mul_(args.ema).add_(pm.detach(), alpha=1 - args.ema)
                for be, bm in zip(ema_net.buffers(), model.module.buffers()):
                    be.copy_(bm)

            if rank == 0 and it % 100 == 0:
                print(f"ep {epoch} it {it} lx {loss_x.item():.4f} lu {loss_u.item():.4f} "
                      f"mask {mask.mean().item():.3f} graph {use_graph}", flush=True)

        if rank == 0:
            acc = evaluate(ema_net, test_loader, device)
            best = max(best, acc)
            torch.save({"epoch": epoch + 1, "model": model.module.state_dict(), "ema": ema_net.state_dict(),
                        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "acc": acc},
                       os.path.join(args.exp_dir, "checkpoint.pth"))
            print(f"epoch {epoch}: ema acc {acc:.2f} best {best:.2f} ({time.time() - t0:.0f}s)", flush=True)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
