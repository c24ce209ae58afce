"""Active learning for dermoscopy classification (HAM10000, 7 classes).

Each round fine-tunes an ImageNet EfficientNet-B0 on the labelled images with early
stopping on balanced accuracy of a fixed validation split; the best checkpoint of
the round is reloaded and used to rank the unlabelled pool by entropy.

    torchrun --nproc_per_node=4 09_skin_lesion_al.py --data /data/ham10000/images_by_class \
        --out /scratch/al_ham --rounds 8
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets, transforms
from torchvision.models import EfficientNet_B0_Weights, efficientnet_b0

NUM_CLASSES = 7


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--val_frac", type=float, default=0.15)
    ap.add_argument("--init_size", type=int, default=300)
    ap.add_argument("--budget", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--max_epochs", type=int, default=40)
    ap.add_argument("--patience", type=int, default=6)
    ap.add_argument("--batch_per_gpu", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-4, help="AdamW lr for 4 GPUs x 16")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def build_model():
    net = efficientnet_b0(weights=EfficientNet_B0_Weights.IMAGENET1K_V1)
    net.classifier[1] = nn.Linear(net.classifier[1].in_features, NUM_CLASSES)
    return nn.SyncBatchNorm.convert_sync_batchnorm(net)


@torch.no_grad()
def confusion(net, loader, device):
    net.eval()
    cm = torch.zeros(NUM_CLASSES, NUM_CLASSES, device=device, dtype=torch.long)
    for x, y in loader:
        pred = net(x.to(device, non_blocking=True)).argmax(1)
        y = y.to(device, non_blocking=True)
        cm += torch.bincount(y * NUM_CLASSES + pred, minlength=NUM_CLASSES ** 2).view(NUM_CLASSES, NUM_CLASSES)
    dist.all_reduce(cm)
    return cm


def balanced_acc(cm):
    per_class = cm.diag().float() / cm.sum(1).clamp_min(1).float()
    return per_class.mean().item()


@torch.no_grad()
def entropy_on_pool(net, dataset, pool, device, rank, world):
    sub = Subset(dataset, pool)
    sampler = DistributedSampler(sub, num_replicas=world, rank=rank, shuffle=False)
    loader = DataLoader(sub, batch_size=128, sampler=sampler, num_workers=8, pin_memory=True)
    net.eval()
    ent = []
    for x, _ in loader:
        p = F.softmax(net(x.to(device, non_blocking=True)), 1)
        ent.append(-(p * p.clamp_min(1e-12).log()).sum(1))
    ent = torch.cat(ent)
    pos = torch.tensor(list(sampler), device=device)
    ents = [torch.empty_like(ent) for _ in range(world)]
    poss = [torch.empty_like(pos) for _ in range(world)]
    dist.all_gather(ents, ent)
    dist.all_gather(poss, pos)
    scores = torch.full((len(pool),), -1.0, device=device)
    scores[torch.cat(poss)] = torch.cat(ents)
    return scores


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        efficientnet_b0(weights=EfficientNet_B0_Weights.IMAGENET1K_V1)  # fetch weights once
    dist.barrier()

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([transforms.RandomResizedCrop(224, scale=(0.7, 1.0)),
                                   transforms.RandomHorizontalFlip(), transforms.RandomVerticalFlip(),
                                   transforms.ColorJitter(0.1, 0.1, 0.1), transforms.ToTensor(), norm])
    eval_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), norm])
    train_view = datasets.ImageFolder(args.data, transform=train_tf)
    eval_view = datasets.ImageFolder(args.data, transform=eval_tf)

    rng = np.random.RandomState(args.seed)
    perm = rng.permutation(len(train_view))
    n_val = int(args.val_frac * len(perm))
    val_idx = perm[:n_val].tolist()
    labelled = perm[n_val:n_val + args.init_size].tolist()
    pool = perm[n_val + args.init_size:].tolist()

    val_sub = Subset(eval_view, val_idx)
    val_loader = DataLoader(val_sub, batch_size=128, sampler=DistributedSampler(val_sub, shuffle=False),
                            num_workers=8, pin_memory=True)
    curve = []
    best_path = os.path.join(args.out, "best_current_round.pt")

    for rnd in range(args.rounds + 1):
        t0 = time.time()
        net = build_model().to(device)
        model = DDP(net, device_ids=[local_rank])
        sub = Subset(train_view, labelled)
        sampler = DistributedSampler(sub, shuffle=True, seed=args.seed + rnd)
        loader = DataLoader(sub, batch_size=args.batch_per_gpu, sampler=sampler, num_workers=8,
                            pin_memory=True, drop_last=True)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.max_epochs)

        best, bad_epochs = -1.0, 0
        for epoch in range(args.max_epochs):
            sampler.set_epoch(epoch)
            model.train()
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            sched.step()
            bacc = balanced_acc(confusion(net, val_loader, device))  # identical on every rank
            if bacc > best:
                best, bad_epochs = bacc, 0
                if rank == 0:
                    torch.save({"model": net.state_dict(), "epoch": epoch, "bacc": bacc}, best_path)
            else:
                bad_epochs += 1
                if bad_epochs >= args.patience:
                    break
        dist.barrier()

        ckpt = torch.load(best_path)
        net.load_state_dict(ckpt["model"])
        if rank == 0:
            curve.append({"round": rnd, "labelled": len(labelled), "val_bacc": ckpt["bacc"],
                          "best_epoch": ckpt["epoch"], "minutes": (time.time() - t0) / 60})
            print(json.dumps(curve[-1]), flush=True)
            with open(os.path.join(args.out, "curve.json"), "w") as f:
                json.dump(curve, f, indent=1)
            torch.save({"model": net.state_dict(), "labelled": labelled}, os.path.join(args.out, f"round{rnd}.pt"))
        if rnd == args.rounds:
            break

        scores = entropy_on_pool(net, eval_view, pool, device, rank, world)
        top = torch.topk(scores, min(args.budget, len(pool))).indices.tolist()
        chosen = set(top)
        labelled = labelled + [pool[j] for j in top]
        pool = [p for j, p in enumerate(pool) if j not in chosen]
        dist.barrier()  # rank 0 overwrites best_path next round

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
