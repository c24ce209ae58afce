"""SimpleShot (Wang et al. 2019): train a plain classifier on the base classes,
then classify few-shot episodes of novel classes by nearest centroid on
centred + L2-normalised features (CL2N).

    torchrun --nproc_per_node=4 20_simpleshot_eval.py --data /data/mini --arch resnet18
    torchrun --nproc_per_node=4 20_simpleshot_eval.py --data /data/mini --evaluate --ckpt out/simpleshot/model_best.pth
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="ImageFolder layout: base/ val/ novel/")
    p.add_argument("--out", default="out/simpleshot")
    p.add_argument("--arch", default="resnet18")
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--lr", type=float, default=0.1, help="for a global batch of 256")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--episodes", type=int, default=10000)
    p.add_argument("--shots", type=int, nargs="+", default=[1, 5])
    p.add_argument("--query", type=int, default=15)
    p.add_argument("--evaluate", action="store_true")
    p.add_argument("--ckpt", default="")
    return p.parse_args()


def build_model(arch, n_classes):
    net = getattr(torchvision.models, arch)(num_classes=n_classes)
    net.maxpool = nn.Identity()  # 84x84 inputs
    return net


@torch.no_grad()
def extract(model, loader, device):
    """Penultimate features of every image in loader (fc replaced by identity)."""
    fc = model.fc
    model.fc = nn.Identity()
    model.eval()
    feats, labels = [], []
    for x, y in loader:
        feats.append(model(x.to(device, non_blocking=True)))
        labels.append(y.to(device))
    model.fc = fc
    model.train()
    return torch.cat(feats), torch.cat(labels)


@torch.no_grad()
def base_mean(model, base_eval_loader, device):
    feats, _ = extract(model, base_eval_loader, device)
    s = torch.cat([feats.sum(0), torch.tensor([float(feats.size(0))], device=device)])
    dist.all_reduce(s)
    return s[:-1] / s[-1]


@torch.no_grad()
def fewshot_episodes(feats, labels, mean, shot, query, n_episodes, rng):
    feats = F.normalize(feats - mean, dim=1)
    classes = labels.unique().cpu().numpy()
    by_class = {c: torch.nonzero(labels == c).squeeze(1) for c in classes}
    accs = []
    for _ in range(n_episodes):
        cls = rng.choice(classes, 5, replace=False)
        protos, q_feats, q_lab = [], [], []
        for j, c in enumerate(cls):
            idx = by_class[c][torch.from_numpy(rng.permutation(len(by_class[c]))[:shot + query]).to(feats.device)]
            protos.append(feats[idx[:shot]].mean(0))
            q_feats.append(feats[idx[shot:]])
            q_lab += [j] * query
        pred = torch.cdist(torch.cat(q_feats), torch.stack(protos)).argmin(1).cpu()
        accs.append((pred == torch.tensor(q_lab)).float().mean().item())
    return accs


def evaluate_fewshot(model, base_eval_loader, novel_loader, args, rank, world, device):
    mean = base_mean(model, base_eval_loader, device)
    # every rank needs all novel features to draw its episodes; the novel split is small
    feats, labels = extract(model, novel_loader, device)
    results = {}
    for shot in args.shots:
        rng = np.random.RandomState(1000 * shot + rank)
        accs = fewshot_episodes(feats, labels, mean, shot, args.query, args.episodes // world, rng)
        stats = torch.tensor([sum(accs), sum(a * a for a in accs), len(accs)], dtype=torch.float64)
        dist.all_reduce(stats)
        m = stats[0] / stats[2]
        sd = (stats[1] / stats[2] - m * m).clamp(min=0).sqrt()
        results[shot] = (m.item(), (1.96 * sd / stats[2].sqrt()).item())
    return results


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([transforms.RandomResizedCrop(84), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), norm])
    eval_tf = transforms.Compose([transforms.Resize(96), transforms.CenterCrop(84), transforms.ToTensor(),
                                  norm])
    base = datasets.ImageFolder(os.path.join(args.data, "base"), train_tf)
    base_eval = datasets.ImageFolder(os.path.join(args.data, "base"), eval_tf)
    val = datasets.ImageFolder(os.path.join(args.data, "val"), eval_tf)
    novel = datasets.ImageFolder(os.path.join(args.data, "novel"), eval_tf)

    train_sampler = DistributedSampler(base, shuffle=True, drop_last=True)
    train_loader = DataLoader(base, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    base_eval_loader = DataLoader(base_eval, batch_size=256, num_workers=args.workers, pin_memory=True,
                                  sampler=DistributedSampler(base_eval, shuffle=False, drop_last=True))
    val_loader = DataLoader(val, batch_size=256, num_workers=args.workers, pin_memory=True)
    novel_loader = DataLoader(novel, batch_size=256, num_workers=args.workers, pin_memory=True)

    model = build_model(args.arch, len(base.classes)).to(device)
    if args.evaluate:
        model.load_state_dict(torch.load(args.ckpt, map_location=device)["state_dict"])
        res = evaluate_fewshot(model, base_eval_loader, novel_loader, args, rank, world, device)
        if rank == 0:
            for shot, (m, ci) in res.items():
                print(f"novel 5-way {shot}-shot: {100 * m:.2f} +- {100 * ci:.2f}")
        dist.destroy_process_group()
        return

    ddp = DDP(model, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 256
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [int(0.5 * args.epochs), int(0.75 * args.epochs)])
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for x, y in train_loader:
            loss = F.cross_entropy(ddp(x.to(device, non_blocking=True)), y.to(device, non_blocking=True))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(loss_sum)

        # model selection on the validation classes with 1-shot episodes
        val_args = argparse.Namespace(**{**vars(args), "shots": [1], "episodes": 2000})
        res = evaluate_fewshot(model, base_eval_loader, val_loader, val_args, rank, world, device)
        if rank == 0:
            acc, ci = res[1]
            print(f"epoch {epoch}: loss {(loss_sum[0] / loss_sum[1]).item():.3f}, val 1-shot {100 * acc:.2f} +- {100 * ci:.2f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            state = {"epoch": epoch, "state_dict": model.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save(state, os.path.join(args.out, "checkpoint.pth"))
            if acc > best:
                best = acc
                torch.save(state, os.path.join(args.out, "model_best.pth"))
        dist.barrier()

    model.load_state_dict(torch.load(os.path.join(args.out, "model_best.pth"), map_location=device)["state_dict"])
    res = evaluate_fewshot(model, base_eval_loader, novel_loader, args, rank, world, device)
    if rank == 0:
        for shot, (m, ci) in res.items():
            print(f"novel 5-way {shot}-shot: {100 * m:.2f} +- {100 * ci:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
