#!/usr/bin/env python
# Hybrid active learning (margin pre-filter + k-center greedy) on the iNat birds subset.
#
#   torchrun --standalone --nproc_per_node=8 02_al_birds_margin_coreset.py \
#       --train-dir /data/inat_birds/train --val-dir /data/inat_birds/val --out /shared/al/birds_hybrid
import argparse
import json
import os
import time
from datetime import datetime

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-dir", required=True)
    ap.add_argument("--val-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--init-per-class", type=int, default=5)
    ap.add_argument("--budget", type=int, default=2000, help="images queried per round")
    ap.add_argument("--prefilter", type=int, default=10, help="margin candidates = prefilter * budget")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-per-gpu", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.01, help="lr per 256 images")
    ap.add_argument("--supcon-weight", type=float, default=0.0)
    ap.add_argument("--temperature", type=float, default=0.1)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1234)
    return ap.parse_args()


class ALNet(nn.Module):
    def __init__(self, num_classes, emb_dim=128):
        super().__init__()
        backbone = torchvision.models.resnet50(weights="IMAGENET1K_V2")
        feat_dim = backbone.fc.in_features
        backbone.fc = nn.Identity()
        self.backbone = backbone
        self.classifier = nn.Linear(feat_dim, num_classes)
        # low-dimensional head used by the diversity step of the acquisition
        self.proj = nn.Sequential(nn.Linear(feat_dim, 512), nn.ReLU(inplace=True),
                                  nn.Linear(512, emb_dim))

    def forward(self, x, return_embedding=False):
        feats = self.backbone(x)
        logits = self.classifier(feats)
        if return_embedding:
            return logits, F.normalize(self.proj(feats), dim=1)
        return logits


def supcon_loss(z, y, temperature):
    sim = z @ z.t() / temperature
    self_mask = torch.eye(len(y), device=z.device, dtype=torch.bool)
    sim = sim.masked_fill(self_mask, -1e9)
    pos = (y[:, None] == y[None, :]) & ~self_mask
    log_prob = sim - torch.logsumexp(sim, dim=1, keepdim=True)
    n_pos = pos.sum(1).clamp_min(1)
    return -((log_prob * pos).sum(1) / n_pos).mean()


class WithIndex(Dataset):
    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        x, y = self.ds[i]
        return x, y, i


def initial_pool(targets, per_class, seed):
    rng = np.random.RandomState(seed)
    targets = np.asarray(targets)
    picked = []
    for c in np.unique(targets):
        members = np.flatnonzero(targets == c)
        picked.append(rng.choice(members, size=min(per_class, len(members)), replace=False))
    return np.sort(np.concatenate(picked))


def k_center_greedy(emb, labelled_emb, k):
    """Pick k rows of emb that greedily maximise the distance to the chosen set."""
    if labelled_emb.numel():
        min_d = torch.cdist(emb, labelled_emb).min(dim=1).values
    else:
        min_d = torch.full((emb.shape[0],), float("inf"), device=emb.device)
    chosen = []
    for _ in range(k):
        j = int(torch.argmax(min_d))
        chosen.append(j)
        min_d = torch.minimum(min_d, torch.cdist(emb, emb[j:j + 1]).squeeze(1))
    return chosen


@torch.no_grad()
def embed_and_margin(net, ds, indices, device, workers):
    """Margin and embedding for `indices`; gathered across ranks, duplicates from padding removed."""
    sub = Subset(WithIndex(ds), indices.tolist())
    sampler = DistributedSampler(sub, shuffle=False)
    loader = DataLoader(sub, batch_size=256, sampler=sampler, num_workers=workers, pin_memory=True)
    net.eval()
    margins, embs, ids = [], [], []
    for x, _, i in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits, z = net(x.to(device, non_blocking=True), return_embedding=True)
        top2 = F.softmax(logits.float(), 1).topk(2, dim=1).values
        margins.append(top2[:, 0] - top2[:, 1])
        embs.append(z.float())
        ids.append(i.to(device))
    local = [torch.cat(margins), torch.cat(embs), torch.cat(ids)]
    out = []
    for t in local:
        bufs = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(bufs, t)
        out.append(torch.cat(bufs))
    margin, emb, ids = out
    ids_np = ids.cpu().numpy()
    _, first = np.unique(ids_np, return_index=True)
    first = torch.as_tensor(first, device=device)
    return margin[first], emb[first], ids[first]


@torch.no_grad()
def evaluate(net, val_ds, device, rank, world):
    part = np.array_split(np.arange(len(val_ds)), world)[rank]
    loader = DataLoader(Subset(val_ds, part.tolist()), batch_size=256, num_workers=8)
    net.eval()
    correct = torch.zeros(2, device=device, dtype=torch.float64)
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = net(x.to(device, non_blocking=True)).argmax(1)
        correct[0] += (pred.cpu() == y).sum().item()
        correct[1] += len(y)
    dist.all_reduce(correct)
    return (correct[0] / correct[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    is_main = rank == 0

    normalize = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), normalize])
    eval_tf = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), normalize])
    train_ds = torchvision.datasets.ImageFolder(args.train_dir, transform=train_tf)
    pool_ds = torchvision.datasets.ImageFolder(args.train_dir, transform=eval_tf)
    val_ds = torchvision.datasets.ImageFolder(args.val_dir, transform=eval_tf)
    num_classes = len(train_ds.classes)

    labelled = initial_pool(train_ds.targets, args.init_per_class, args.seed)
    all_idx = np.arange(len(train_ds))
    if is_main:
        os.makedirs(args.out, exist_ok=True)
        print(f"[{datetime.now():%H:%M:%S}] {num_classes} classes, pool {len(train_ds)}, "
              f"initial labelled {len(labelled)}, world {world}", flush=True)

    lr = args.lr * args.batch_per_gpu * world / 256
    for rnd in range(args.rounds):
        tic = time.time()
        torch.manual_seed(args.seed + rnd)
        model = ALNet(num_classes).to(device)
        model = DDP(model, device_ids=[local_rank])
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
        sub = Subset(train_ds, labelled.tolist())
        sampler = DistributedSampler(sub, shuffle=True, seed=args.seed, drop_last=True)
        loader = DataLoader(sub, batch_size=args.batch_per_gpu, sampler=sampler,
                            num_workers=args.workers, pin_memory=True, drop_last=True)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))

        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    if args.supcon_weight > 0:
                        logits, z = model(x, return_embedding=True)
                        loss = F.cross_entropy(logits, y) + \
                            args.supcon_weight * supcon_loss(z.float(), y, args.temperature)
                    else:
                        logits = model(x)
                        loss = F.cross_entropy(logits, y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()

        acc = evaluate(model.module, val_ds, device, rank, world)

        # acquisition: lowest-margin candidates, then k-center on the embeddings
        unlabelled = np.setdiff1d(all_idx, labelled)
        margin, emb, ids = embed_and_margin(model.module, pool_ds, unlabelled, device, args.workers)
        n_cand = min(args.prefilter * args.budget, len(ids))
        cand = torch.topk(-margin, n_cand).indices
        _, lab_emb, _ = embed_and_margin(model.module, pool_ds, labelled, device, args.workers)
        picked = [None]
        if is_main:
            sel = k_center_greedy(emb[cand], lab_emb, min(args.budget, n_cand))
            picked[0] = ids[cand[sel]].cpu().tolist()
        dist.broadcast_object_list(picked, src=0)
        labelled = np.union1d(labelled, np.asarray(picked[0], dtype=np.int64))

        if is_main:
            torch.save({"round": rnd, "model": model.module.state_dict(),
                        "labelled": torch.from_numpy(labelled)},
                       os.path.join(args.out, f"round_{rnd:02d}.pt"))
            with open(os.path.join(args.out, "log.jsonl"), "a") as f:
                f.write(json.dumps({"round": rnd, "n_labelled": int(len(sub)), "val_acc": acc,
                                    "minutes": (time.time() - tic) / 60}) + "\n")
            print(f"round {rnd}: labelled {len(sub)} -> {len(labelled)}, val acc {acc:.4f}", flush=True)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
