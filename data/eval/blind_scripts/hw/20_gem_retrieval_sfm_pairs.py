"""Global descriptor (ResNet-101 + GeM) for the retrieval stage of hierarchical localization.

Positive pairs come from SfM reconstructions (co-visible images); negatives are all other images in the
global batch, gathered across GPUs with a differentiable all_gather.

    torchrun --nproc_per_node=8 20_gem_retrieval_sfm_pairs.py --root /data/sfm120k --out runs/gem_r101 [--resume runs/gem_r101/last.pth]
"""
import argparse
import json
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", default="runs/gem")
    p.add_argument("--backbone_ckpt", default="weights/resnet101-cd907fc2.pth")
    p.add_argument("--resume", default="")
    p.add_argument("--img_size", type=int, default=362)
    p.add_argument("--batch_size", type=int, default=32, help="pairs per GPU")
    p.add_argument("--lr", type=float, default=1e-6 * 64)
    p.add_argument("--temperature", type=float, default=0.05)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


class SfMPairs(Dataset):
    """pairs_<split>.json: [{"query": rel_path, "positive": rel_path, "cluster": id}, ...]"""

    def __init__(self, root, split, size, train):
        with open(os.path.join(root, f"pairs_{split}.json")) as f:
            self.items = json.load(f)
        self.root = root
        aug = [T.RandomResizedCrop(size, scale=(0.5, 1.0)), T.ColorJitter(0.3, 0.3, 0.3)] if train else \
            [T.Resize(size), T.CenterCrop(size)]
        self.tf = T.Compose(aug + [T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        q = self.tf(Image.open(os.path.join(self.root, "ims", it["query"])).convert("RGB"))
        p = self.tf(Image.open(os.path.join(self.root, "ims", it["positive"])).convert("RGB"))
        return q, p, it["cluster"], i


class GeM(nn.Module):
    def __init__(self, p=3.0, eps=1e-6):
        super().__init__()
        self.p = nn.Parameter(torch.ones(1) * p)
        self.eps = eps

    def forward(self, x):
        return F.avg_pool2d(x.clamp(min=self.eps).pow(self.p), x.shape[-2:]).pow(1.0 / self.p).flatten(1)


class RetrievalNet(nn.Module):
    def __init__(self, dim=2048):
        super().__init__()
        r = torchvision.models.resnet101(norm_layer=torchvision.ops.FrozenBatchNorm2d)
        self.features = nn.Sequential(*list(r.children())[:-2])
        self.pool = GeM()
        self.whiten = nn.Linear(2048, dim, bias=True)

    def forward(self, x):
        return F.normalize(self.whiten(F.normalize(self.pool(self.features(x)), dim=-1)), dim=-1)


def contrastive_global(q, p, clusters, temperature):
    """InfoNCE against every positive in the global batch; same-cluster entries are masked out."""
    all_p = torch.cat(dist_fn.all_gather(p), 0)
    all_c = [torch.empty_like(clusters) for _ in range(dist.get_world_size())]
    dist.all_gather(all_c, clusters)
    all_c = torch.cat(all_c, 0)
    offset = dist.get_rank() * q.size(0)
    logits = q @ all_p.T / temperature
    target = torch.arange(q.size(0), device=q.device) + offset
    same = clusters[:, None] == all_c[None, :]
    same[torch.arange(q.size(0)), target] = False
    logits = logits.masked_fill(same, -1e4)
    loss = F.cross_entropy(logits, target)
    acc = (logits.argmax(1) == target).float().mean()
    return loss, acc


@torch.no_grad()
def embed(net, loader, device):
    net.eval()
    qs, ps, idx = [], [], []
    for q, p, _, i in loader:
        qs.append(net(q.to(device)).cpu())
        ps.append(net(p.to(device)).cpu())
        idx.append(i)
    net.train()
    if not idx:
        return np.zeros((0, 1), np.float32), np.zeros((0, 1), np.float32), np.zeros(0, np.int64)
    return torch.cat(qs).numpy(), torch.cat(ps).numpy(), torch.cat(idx).numpy()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_ds = SfMPairs(args.root, "train", args.img_size, train=True)
    val_ds = SfMPairs(args.root, "val", args.img_size, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=32, num_workers=4)

    net = RetrievalNet()
    if args.backbone_ckpt and not args.resume:
        sd = torch.load(args.backbone_ckpt, map_location="cpu")
        names = ["conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4"]
        remapped = {}
        for k, v in sd.items():
            head = k.split(".")[0]
            if head in names and not k.endswith("num_batches_tracked"):
                remapped[str(names.index(head)) + k[len(head):]] = v
        net.features.load_state_dict(remapped)
    model = DDP(net.to(device), device_ids=[local_rank])
    opt = torch.optim.Adam([
        {"params": model.module.features.parameters(), "lr": args.lr},
        {"params": model.module.pool.parameters(), "lr": args.lr * 10, "weight_decay": 0.0},
        {"params": model.module.whiten.parameters(), "lr": args.lr},
    ], weight_decay=1e-6)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=float(np.exp(-0.01)))

    start_epoch, best = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best_r1"]
        if rank == 0:
            print(f"resumed from {args.resume} (epoch {ckpt['epoch']})")

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        m = torch.zeros(3, device=device)
        for q, p, c, _ in train_dl:
            q, p, c = q.to(device, non_blocking=True), p.to(device, non_blocking=True), c.to(device)
            emb = model(torch.cat([q, p]))
            eq, ep = emb.chunk(2)
            loss, acc = contrastive_global(eq, ep, c, args.temperature)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            m += torch.stack([loss.detach(), acc.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(m)

        qv, pv, iv = embed(model.module, val_dl, device)
        parts = [None] * world
        dist.all_gather_object(parts, (qv, pv, iv))
        if rank == 0:
            order = np.argsort(np.concatenate([x[2] for x in parts]))
            Q = np.concatenate([x[0] for x in parts if len(x[2])])[order]
            P = np.concatenate([x[1] for x in parts if len(x[2])])[order]
            ranks = np.argsort(-(Q @ P.T), axis=1)
            r1 = float(np.mean(ranks[:, 0] == np.arange(len(Q))))
            r10 = float(np.mean((ranks[:, :10] == np.arange(len(Q))[:, None]).any(1)))
            print(f"epoch {epoch}: loss {m[0] / m[2]:.4f} acc {m[1] / m[2]:.3f} | val R@1 {r1:.3f} R@10 {r10:.3f} "
                  f"| GeM p={model.module.pool.p.item():.2f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            state = {"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                     "scheduler": sched.state_dict(), "epoch": epoch, "best_r1": max(best, r1)}
            torch.save(state, os.path.join(args.out, "last.pth"))
            if r1 > best:
                best = r1
                torch.save(state, os.path.join(args.out, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
