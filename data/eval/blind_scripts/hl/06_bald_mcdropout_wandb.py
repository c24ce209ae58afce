"""BALD with MC dropout (Gal et al., 2017) on CIFAR-10, DDP + Weights & Biases.

    torchrun --standalone --nproc_per_node=4 06_bald_mcdropout_wandb.py \
        --project al-bald --mc_samples 20 --rounds 12
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets, transforms


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--project", default="al-bald")
    ap.add_argument("--run_name", default=None)
    ap.add_argument("--data", default="/data/cifar10")
    ap.add_argument("--ckpt_dir", default="./ckpt_bald")
    ap.add_argument("--init_size", type=int, default=2000)
    ap.add_argument("--budget", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--global_batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--mc_samples", type=int, default=20)
    ap.add_argument("--pool_batch", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=7)
    return ap.parse_args()


class VGGDrop(nn.Module):
    cfg = [64, 64, "M", 128, 128, "M", 256, 256, "M", 512, "M"]

    def __init__(self, n_classes=10, p=0.5):
        super().__init__()
        layers, c = [], 3
        for v in self.cfg:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(c, v, 3, padding=1), nn.BatchNorm2d(v), nn.ReLU(inplace=True)]
                c = v
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Flatten(), nn.Dropout(p), nn.Linear(512 * 2 * 2, 256),
                                        nn.ReLU(inplace=True), nn.Dropout(p), nn.Linear(256, n_classes))

    def forward(self, x):
        return self.classifier(self.features(x))


def enable_mc_dropout(net):
    net.eval()
    for m in net.modules():
        if isinstance(m, nn.Dropout):
            m.train()


@torch.no_grad()
def bald_scores(net, dataset, pool, T, batch, device, rank, world):
    sub = Subset(dataset, pool)
    sampler = DistributedSampler(sub, num_replicas=world, rank=rank, shuffle=False)
    loader = DataLoader(sub, batch_size=batch, sampler=sampler, num_workers=4, pin_memory=True)
    enable_mc_dropout(net)
    scores = []
    for x, _ in loader:
        x = x.to(device, non_blocking=True)
        feats = net.features(x)  # deterministic part computed once
        probs = torch.stack([F.softmax(net.classifier(feats), 1) for _ in range(T)])  # [T, B, C]
        mean = probs.mean(0)
        h_mean = -(mean * mean.clamp_min(1e-10).log()).sum(1)
        mean_h = -(probs * probs.clamp_min(1e-10).log()).sum(2).mean(0)
        scores.append(h_mean - mean_h)
    scores = torch.cat(scores)
    pos = torch.as_tensor(list(sampler), device=device)
    out_s = [torch.empty_like(scores) for _ in range(world)]
    out_p = [torch.empty_like(pos) for _ in range(world)]
    dist.all_gather(out_s, scores)
    dist.all_gather(out_p, pos)
    full = torch.full((len(pool),), -1.0, device=device)
    full[torch.cat(out_p)] = torch.cat(out_s)
    return full


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    run = wandb.init(project=args.project, name=args.run_name, config=vars(args))

    norm = transforms.Normalize((0.4914, 0.4822, 0.4465), (0.247, 0.243, 0.261))
    train_set = datasets.CIFAR10(args.data, train=True,
                                 transform=transforms.Compose([transforms.RandomCrop(32, 4),
                                                               transforms.RandomHorizontalFlip(),
                                                               transforms.ToTensor(), norm]))
    plain_set = datasets.CIFAR10(args.data, train=True, transform=transforms.Compose([transforms.ToTensor(), norm]))
    test_set = datasets.CIFAR10(args.data, train=False, transform=transforms.Compose([transforms.ToTensor(), norm]))

    rs = np.random.RandomState(args.seed)
    order = rs.permutation(len(train_set)).tolist()
    labelled, pool = order[:args.init_size], order[args.init_size:]
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    per_gpu = args.global_batch // world
    test_sampler = DistributedSampler(test_set, shuffle=False)
    test_loader = DataLoader(test_set, batch_size=500, sampler=test_sampler, num_workers=4)

    for rnd in range(args.rounds + 1):
        tic = time.time()
        net = nn.SyncBatchNorm.convert_sync_batchnorm(VGGDrop()).to(device)
        model = DDP(net, device_ids=[local_rank])
        sub = Subset(train_set, labelled)
        sampler = DistributedSampler(sub, shuffle=True, seed=args.seed + rnd)
        loader = DataLoader(sub, batch_size=per_gpu, sampler=sampler, num_workers=4, pin_memory=True)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(loader))

        step = 0
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            tot = torch.zeros(2, device=device)
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                tot += torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)), device=device)])
                step += 1
            dist.all_reduce(tot)
            wandb.log({f"round_{rnd}/train_loss": (tot[0] / tot[1]).item(), f"round_{rnd}/epoch": epoch})

        # test accuracy (deterministic, dropout off)
        net.eval()
        c = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in test_loader:
                x, y = x.to(device), y.to(device)
                c += torch.stack([(net(x).argmax(1) == y).sum().float(), torch.tensor(float(len(y)), device=device)])
        dist.all_reduce(c)
        acc = (c[0] / c[1]).item()
        wandb.log({"al/test_acc": acc, "al/n_labelled": len(labelled), "al/round": rnd,
                   "al/round_time_s": time.time() - tic})
        if rank == 0:
            print(f"[{rnd}] n={len(labelled)} acc={acc:.4f}", flush=True)
            torch.save({"net": net.state_dict(), "labelled": labelled, "round": rnd},
                       os.path.join(args.ckpt_dir, f"round{rnd:02d}.pt"))
        if rnd == args.rounds:
            break

        scores = bald_scores(net, plain_set, pool, args.mc_samples, args.pool_batch, device, rank, world)
        top = torch.topk(scores, args.budget).indices.tolist()
        top_set = set(top)
        labelled += [pool[j] for j in top]
        pool = [p for j, p in enumerate(pool) if j not in top_set]
        wandb.log({"al/mean_bald_selected": scores[top].mean().item(), "al/round": rnd})

    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
