"""ANIL (Raghu et al., ICLR 2020) on FC100 with learn2learn task transforms.

Only the linear head is adapted in the inner loop; the feature extractor is
learned in the outer loop. Meta-batch split over GPUs, meta-gradients
all-reduced by hand (no DDP).

    torchrun --nproc_per_node=4 19_anil_fc100.py --ways 5 --shots 5 --seed -1
"""
import argparse
import os
import random
import time

import learn2learn as l2l
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from learn2learn.data.transforms import ConsecutiveLabels, KShots, LoadData, NWays, RemapLabels


def build_tasks(root, split, ways, shots, num_tasks=-1):
    dataset = l2l.vision.datasets.FC100(root=root, mode=split, download=False,
                                        transform=lambda x: torch.as_tensor(x).permute(2, 0, 1).float() / 255.0)
    meta = l2l.data.MetaDataset(dataset)
    transforms = [NWays(meta, ways), KShots(meta, 2 * shots), LoadData(meta),
                  RemapLabels(meta), ConsecutiveLabels(meta)]
    return l2l.data.TaskDataset(meta, task_transforms=transforms, num_tasks=num_tasks)


class Features(nn.Module):
    def __init__(self, hidden=64):
        super().__init__()
        self.net = nn.Sequential(
            *[m for i in range(4) for m in (nn.Conv2d(3 if i == 0 else hidden, hidden, 3, padding=1),
                                            nn.BatchNorm2d(hidden), nn.ReLU(), nn.MaxPool2d(2))])

    def forward(self, x):
        return self.net(x).flatten(1)  # 64 * 2 * 2 for 32x32 inputs


def split_task(data, labels, shots, ways, device):
    data, labels = data.to(device), labels.to(device)
    order = torch.argsort(labels, stable=True)
    data, labels = data[order].view(ways, 2 * shots, *data.shape[1:]), labels[order].view(ways, 2 * shots)
    x_s, x_q = data[:, :shots].flatten(0, 1), data[:, shots:].flatten(0, 1)
    y_s, y_q = labels[:, :shots].flatten(), labels[:, shots:].flatten()
    return x_s, y_s, x_q, y_q


def anil_task(features, head, batch, args, steps, train=True):
    x_s, y_s, x_q, y_q = split_task(*batch, args.shots, args.ways, args.device)
    f_all = features(torch.cat([x_s, x_q]))
    f_s, f_q = f_all[:x_s.size(0)], f_all[x_s.size(0):]
    w, b = head.weight, head.bias
    for _ in range(steps):
        loss = F.cross_entropy(F.linear(f_s, w, b), y_s)
        gw, gb = torch.autograd.grad(loss, (w, b), create_graph=train)
        w, b = w - args.fast_lr * gw, b - args.fast_lr * gb
    logits = F.linear(f_q, w, b)
    return F.cross_entropy(logits, y_q), (logits.argmax(1) == y_q).float().mean()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="~/data/fc100")
    ap.add_argument("--ways", type=int, default=5)
    ap.add_argument("--shots", type=int, default=5)
    ap.add_argument("--meta-batch", type=int, default=32)
    ap.add_argument("--fast-lr", type=float, default=0.1)
    ap.add_argument("--meta-lr", type=float, default=3e-3)
    ap.add_argument("--adapt-steps", type=int, default=5)
    ap.add_argument("--iterations", type=int, default=30000)
    ap.add_argument("--eval-every", type=int, default=1000)
    ap.add_argument("--eval-tasks", type=int, default=1000)
    ap.add_argument("--out", default="runs/anil_fc100")
    ap.add_argument("--seed", type=int, default=-1, help="-1: draw one on rank 0 and share it")
    args = ap.parse_args()
    args.root = os.path.expanduser(args.root)

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])

    # same seed everywhere -> identical initial weights on all ranks
    seed = torch.tensor([args.seed if args.seed >= 0 else random.randrange(2 ** 31)], device="cuda")
    dist.broadcast(seed, src=0)
    args.seed = int(seed.item())
    torch.cuda.set_device(local_rank)
    args.device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    features = Features().to(args.device)
    head = nn.Linear(64 * 2 * 2, args.ways).to(args.device)
    params = list(features.parameters()) + list(head.parameters())
    opt = torch.optim.Adam(params, lr=args.meta_lr)
    assert args.meta_batch % world == 0
    per_rank = args.meta_batch // world

    # the tasks themselves should differ between ranks
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    train_tasks = build_tasks(args.root, "train", args.ways, args.shots)
    valid_tasks = build_tasks(args.root, "validation", args.ways, args.shots, num_tasks=args.eval_tasks)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"seed {args.seed}, {per_rank} tasks/GPU", flush=True)
    best, tic = 0.0, time.time()
    for it in range(1, args.iterations + 1):
        opt.zero_grad()
        acc_sum = torch.zeros((), device=args.device)
        for _ in range(per_rank):
            loss, acc = anil_task(features, head, train_tasks.sample(), args, args.adapt_steps)
            (loss / per_rank).backward()
            acc_sum += acc.detach() / per_rank
        flat = torch.cat([p.grad.flatten() for p in params])
        dist.all_reduce(flat)
        flat /= world
        torch.nn.utils.vector_to_parameters(flat, [p.grad for p in params])
        opt.step()

        if it % args.eval_every == 0:
            dist.all_reduce(acc_sum)
            accs = []
            for _ in range(args.eval_tasks // world):
                _, a = anil_task(features, head, valid_tasks.sample(), args, args.adapt_steps, train=False)
                accs.append(a.detach())
            accs = torch.stack(accs)
            tot = torch.stack([accs.sum(), accs.pow(2).sum(), torch.tensor(float(len(accs)), device=args.device)])
            dist.all_reduce(tot)
            m = tot[0] / tot[2]
            ci = 1.96 * torch.sqrt((tot[1] / tot[2] - m * m).clamp(min=0) / tot[2])
            if rank == 0:
                print(f"it {it}: train acc {acc_sum.item() / world:.4f}  val {100 * m.item():.2f} "
                      f"+- {100 * ci.item():.2f}  ({time.time() - tic:.0f}s)", flush=True)
                tic = time.time()
                state = {"features": features.state_dict(), "head": head.state_dict(),
                         "opt": opt.state_dict(), "it": it, "seed": args.seed}
                torch.save(state, os.path.join(args.out, "last.pt"))
                if m.item() > best:
                    best = m.item()
                    torch.save(state, os.path.join(args.out, "best.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
