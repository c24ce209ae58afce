"""
Pool-based active learning on SVHN (entropy / margin acquisition), DDP.
  torchrun --nproc_per_node=4 10_active_learning_entropy.py --init 1000 --budget 1000 --rounds 10
"""
import os
import json
import argparse
import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
import torchvision
import torchvision.transforms as T
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument('--data', default='./data')
parser.add_argument('--init', type=int, default=1000)
parser.add_argument('--budget', type=int, default=1000)
parser.add_argument('--rounds', type=int, default=10)
parser.add_argument('--epochs', type=int, default=100)
parser.add_argument('--bs', type=int, default=64)
parser.add_argument('--lr', type=float, default=0.05)
parser.add_argument('--strategy', default='entropy', choices=['entropy', 'margin', 'random'])
parser.add_argument('--seed', type=int, default=0)
parser.add_argument('--out', default='al_runs/svhn_entropy')
args = parser.parse_args()

MEAN, STD = (0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970)
train_tf = T.Compose([T.RandomCrop(32, padding=2), T.ToTensor(), T.Normalize(MEAN, STD)])
test_tf = T.Compose([T.ToTensor(), T.Normalize(MEAN, STD)])


def rank0():
    return dist.get_rank() == 0


def make_model():
    m = torchvision.models.resnet18(num_classes=10)
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m


def train_one_round(model, labeled_idx, train_set, device, round_id):
    sub = Subset(train_set, labeled_idx)
    sampler = DistributedSampler(sub, shuffle=True, seed=args.seed + round_id)
    loader = DataLoader(sub, batch_size=args.bs, sampler=sampler, num_workers=4, pin_memory=True)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs)
    for ep in range(args.epochs):
        sampler.set_epoch(ep)
        model.train()
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sched.step()
        if rank0() and (ep + 1) % 25 == 0:
            print(f'  round {round_id} ep {ep + 1} loss {loss.item():.3f}', flush=True)


@torch.no_grad()
def test(model, test_set, device):
    model.eval()
    sampler = DistributedSampler(test_set, shuffle=False, drop_last=False)
    loader = DataLoader(test_set, batch_size=500, sampler=sampler, num_workers=4)
    # DistributedSampler pads; count every index once
    seen = torch.zeros(len(test_set), device=device)
    correct = torch.zeros(len(test_set), device=device)
    idx_iter = iter(list(sampler))
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        pred = model(x).argmax(1)
        idx = torch.tensor([next(idx_iter) for _ in range(len(y))], device=device)
        seen[idx] = 1
        correct[idx] = (pred == y).float()
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    dist.all_reduce(correct, op=dist.ReduceOp.MAX)
    return (correct.sum() / seen.sum()).item()


@torch.no_grad()
def score_pool(model, pool_idx, pool_set, device):
    """score a strided shard of the unlabeled pool on every rank, then gather all scores."""
    model.eval()
    rank, world = dist.get_rank(), dist.get_world_size()
    my_idx = pool_idx[rank::world]
    loader = DataLoader(Subset(pool_set, my_idx), batch_size=1000, shuffle=False, num_workers=4)
    scores = []
    for x, _ in loader:
        p = F.softmax(model(x.to(device)), dim=1)
        if args.strategy == 'entropy':
            s = -(p * torch.log(p + 1e-12)).sum(1)
        else:
            top2 = p.topk(2, dim=1).values
            s = -(top2[:, 0] - top2[:, 1])
        scores.append(s)
    local = torch.cat(scores)
    local_idx = torch.tensor(my_idx, device=device)
    all_scores = [torch.zeros_like(local) for _ in range(world)]
    all_idx = [torch.zeros_like(local_idx) for _ in range(world)]
    dist.all_gather(all_scores, local)
    dist.all_gather(all_idx, local_idx)
    return torch.cat(all_scores), torch.cat(all_idx)


def main():
    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group('nccl')
    device = torch.device(f'cuda:{local_rank}')
    random.seed(args.seed)
    np.random.seed(args.seed)

    if rank0():
        torchvision.datasets.SVHN(args.data, split='train', download=True)
        torchvision.datasets.SVHN(args.data, split='test', download=True)
        os.makedirs(args.out, exist_ok=True)
    dist.barrier()
    train_set = torchvision.datasets.SVHN(args.data, split='train', transform=train_tf)
    pool_set = torchvision.datasets.SVHN(args.data, split='train', transform=test_tf)
    test_set = torchvision.datasets.SVHN(args.data, split='test', transform=test_tf)

    all_idx = np.random.permutation(len(train_set)).tolist()
    labeled = all_idx[:args.init]
    unlabeled = all_idx[args.init:]
    history = []

    for rnd in range(args.rounds + 1):
        torch.manual_seed(args.seed + rnd)
        model = DDP(make_model().to(device), device_ids=[local_rank])
        train_one_round(model, labeled, train_set, device, rnd)
        acc = test(model.module, test_set, device)
        history.append({'round': rnd, 'n_labeled': len(labeled), 'acc': acc})
        if rank0():
            print(f'round {rnd}: {len(labeled)} labels -> test acc {acc:.4f}', flush=True)
            torch.save(model.module.state_dict(), os.path.join(args.out, f'round{rnd}.pt'))
            with open(os.path.join(args.out, 'history.json'), 'w') as f:
                json.dump(history, f, indent=1)
        if rnd == args.rounds:
            break

        if args.strategy == 'random':
            chosen = unlabeled[:args.budget]
        else:
            scores, idx = score_pool(model.module, unlabeled, pool_set, device)
            top = scores.topk(args.budget).indices
            chosen = idx[top].tolist()
        chosen_set = set(chosen)
        labeled = labeled + chosen
        unlabeled = [i for i in unlabeled if i not in chosen_set]
        del model
        torch.cuda.empty_cache()

    dist.destroy_process_group()


if __name__ == '__main__':
    main()
