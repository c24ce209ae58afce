"""Active learning on top of frozen self-supervised features.

A DINO ResNet-50 is frozen; its pooled features for every image are extracted once
and cached. Each AL round trains a small MLP head on the labelled features and
queries the lowest-margin pool images. Cheap rounds -> many of them.

    torchrun --standalone --nproc_per_node=4 14_frozen_features_margin.py \
        --backbone /models/dino_resnet50_pretrain.pth --cache_dir /scratch/feat_cache
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchvision import datasets, transforms
from torchvision.models import resnet50


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/datasets/cifar100")
    ap.add_argument("--backbone", required=True)
    ap.add_argument("--cache_dir", default="./feat_cache")
    ap.add_argument("--out", default="./runs/frozen_margin")
    ap.add_argument("--init_per_class", type=int, default=2)
    ap.add_argument("--budget", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--batch_per_gpu", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW lr for 4 GPUs x 64")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def load_backbone(path):
    net = resnet50()
    net.fc = nn.Identity()
    sd = torch.load(path, map_location="cpu")
    missing, unexpected = net.load_state_dict(sd, strict=False)
    assert all(k.startswith("fc.") for k in missing), missing
    return net.eval()


@torch.no_grad()
def extract(backbone, dataset, device, bs=256):
    loader = DataLoader(dataset, batch_size=bs, shuffle=False, num_workers=8, pin_memory=True)
    feats, labels = [], []
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            f = backbone(x.to(device, non_blocking=True))
        feats.append(f.float().cpu())
        labels.append(y)
    return torch.cat(feats), torch.cat(labels)


def cached_features(backbone, dataset, name, args, device):
    path = os.path.join(args.cache_dir, f"{name}_dino_r50.pt")
    if os.path.exists(path):
        blob = torch.load(path, map_location="cpu")
        return blob["feats"], blob["labels"]
    feats, labels = extract(backbone, dataset, device)
    os.makedirs(args.cache_dir, exist_ok=True)
    torch.save({"feats": feats, "labels": labels}, path)
    return feats, labels


class Head(nn.Module):
    def __init__(self, d_in=2048, n_classes=100):
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(d_in), nn.Linear(d_in, 1024), nn.GELU(), nn.Dropout(0.2),
                                 nn.Linear(1024, n_classes))

    def forward(self, x):
        return self.net(x)


def train_head(model, feats, labels, labelled, args, device):
    ds = TensorDataset(feats[labelled], labels[labelled])
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed)
    loader = DataLoader(ds, batch_size=args.batch_per_gpu, sampler=sampler)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sched.step()


@torch.no_grad()
def sharded_probs(head, feats, device, rank, world):
    """Softmax outputs for all rows of `feats`, computed in shards and gathered."""
    n = feats.size(0)
    per = (n + world - 1) // world
    idx = torch.arange(rank * per, min((rank + 1) * per, n))
    head.eval()
    out = F.softmax(head(feats[idx].to(device)), dim=1)
    padded = torch.zeros(per, out.size(1), device=device)
    padded[: out.size(0)] = out
    bufs = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(bufs, padded)
    return torch.cat(bufs)[:n]


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tf = transforms.Compose([transforms.Resize(224, interpolation=transforms.InterpolationMode.BICUBIC),
                             transforms.ToTensor(),
                             transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    train_set = datasets.CIFAR100(args.data, train=True, transform=tf)
    test_set = datasets.CIFAR100(args.data, train=False, transform=tf)

    backbone = load_backbone(args.backbone).to(device)
    tr_x, tr_y = cached_features(backbone, train_set, "train", args, device)
    te_x, te_y = cached_features(backbone, test_set, "test", args, device)
    del backbone
    torch.cuda.empty_cache()

    # class-balanced initial set (labels are only used to simulate the oracle's cold start)
    g = torch.Generator().manual_seed(args.seed)
    labelled = []
    for c in range(100):
        idx_c = (tr_y == c).nonzero().squeeze(1)
        labelled += idx_c[torch.randperm(len(idx_c), generator=g)[: args.init_per_class]].tolist()
    is_lab = torch.zeros(len(tr_y), dtype=torch.bool)
    is_lab[labelled] = True

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    curve = []
    for rnd in range(args.rounds + 1):
        t0 = time.time()
        torch.manual_seed(args.seed + rnd)
        model = DDP(Head().to(device), device_ids=[local_rank])
        train_head(model, tr_x, tr_y, labelled, args, device)

        test_p = sharded_probs(model.module, te_x, device, rank, world)
        acc = (test_p.argmax(1).cpu() == te_y).float().mean().item()
        if rank == 0:
            curve.append({"round": rnd, "n_labelled": len(labelled), "acc": acc, "sec": round(time.time() - t0, 1)})
            print(curve[-1], flush=True)
            with open(os.path.join(args.out, "curve.json"), "w") as f:
                json.dump(curve, f, indent=2)
            torch.save({"head": model.module.state_dict(), "labelled": labelled},
                       os.path.join(args.out, "head_last.pt"))
        if rnd == args.rounds:
            break

        p = sharded_probs(model.module, tr_x, device, rank, world).cpu()
        top2 = p.topk(2, dim=1).values
        margin = top2[:, 0] - top2[:, 1]
        margin[is_lab] = float("inf")
        new = torch.topk(-margin, args.budget).indices
        is_lab[new] = True
        labelled += new.tolist()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
