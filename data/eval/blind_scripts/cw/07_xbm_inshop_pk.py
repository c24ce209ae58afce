"""In-Shop Clothes retrieval with cross-batch memory and a distributed P x K sampler.

torchrun --nproc_per_node=4 07_xbm_inshop_pk.py --root /data/inshop --out runs/inshop_xbm
"""
import argparse
import math
import os
import random
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler
from torchvision import transforms as T


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", default="runs/inshop_xbm")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--classes-per-batch", type=int, default=16, help="per GPU")
    ap.add_argument("--samples-per-class", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--mem-size", type=int, default=8192)
    ap.add_argument("--mem-start-epoch", type=int, default=3)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--resume", default="")
    return ap.parse_args()


def read_inshop(root):
    splits = defaultdict(list)
    with open(os.path.join(root, "Eval", "list_eval_partition.txt")) as f:
        lines = f.read().splitlines()[2:]
    for line in lines:
        path, item_id, status = line.split()
        splits[status].append((path, item_id))
    return splits


class ItemImages(Dataset):
    def __init__(self, root, rows, transform, id_map=None):
        self.root, self.transform = root, transform
        ids = sorted({i for _, i in rows}) if id_map is None else None
        self.id_map = id_map or {i: n for n, i in enumerate(ids)}
        self.paths = [p for p, _ in rows]
        self.labels = [self.id_map[i] for _, i in rows]

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.root, self.paths[i])).convert("RGB")
        return self.transform(img), self.labels[i]


class DistributedPKSampler(Sampler):
    """All ranks shuffle the class list with the same seed and take every world-th group of P classes,
    so the classes of one global step are disjoint across ranks and every rank runs the same number of steps."""

    def __init__(self, labels, p, k, rank, world, seed=0):
        self.by_class = defaultdict(list)
        for i, y in enumerate(labels):
            self.by_class[y].append(i)
        self.classes = sorted(c for c, v in self.by_class.items() if len(v) >= 2)
        self.p, self.k, self.rank, self.world, self.seed, self.epoch = p, k, rank, world, seed, 0
        self.batches_per_rank = len(self.classes) // (p * world)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        g = random.Random(self.seed + self.epoch)
        classes = self.classes[:]
        g.shuffle(classes)
        n_global = self.batches_per_rank * self.world
        for b in range(self.rank, n_global, self.world):
            for c in classes[b * self.p:(b + 1) * self.p]:
                pool = self.by_class[c]
                picks = g.sample(pool, self.k) if len(pool) >= self.k else [g.choice(pool) for _ in range(self.k)]
                yield from picks

    def __len__(self):
        return self.batches_per_rank * self.p * self.k


class Net(nn.Module):
    def __init__(self, dim):
        super().__init__()
        bb = torchvision.models.resnet50(weights="IMAGENET1K_V1")
        bb.fc = nn.Identity()
        self.bb = bb
        self.emb = nn.Linear(2048, dim)

    def train(self, mode=True):
        super().train(mode)
        for m in self.bb.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.eval()
                m.weight.requires_grad_(False)
                m.bias.requires_grad_(False)
        return self

    def forward(self, x):
        return F.normalize(self.emb(self.bb(x)), dim=1)


@torch.no_grad()
def gather_padded(t):
    """all_gather for tensors whose first dim differs between ranks."""
    world = dist.get_world_size()
    n = torch.tensor([t.shape[0]], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    sizes = [int(s) for s in sizes]
    padded = t.new_zeros((max(sizes),) + t.shape[1:])
    padded[:t.shape[0]] = t
    out = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(out, padded)
    return torch.cat([o[:s] for o, s in zip(out, sizes)])


@torch.no_grad()
def embed_all(model, ds, device, workers):
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = list(range(rank, len(ds), world))
    loader = DataLoader(torch.utils.data.Subset(ds, shard), batch_size=200, num_workers=workers)
    f = torch.cat([model(x.to(device)) for x, _ in loader]) if shard else torch.zeros(0, model.emb.out_features, device=device)
    idx = torch.tensor(shard, device=device, dtype=torch.long)
    f, idx = gather_padded(f), gather_padded(idx)
    out = torch.empty(len(ds), f.shape[1], device=device)
    out[idx] = f
    return out


@torch.no_grad()
def recall(model, query_ds, gallery_ds, device, workers, ks=(1, 10, 20, 30)):
    model.eval()
    q, g = embed_all(model, query_ds, device, workers), embed_all(model, gallery_ds, device, workers)
    ql = torch.tensor(query_ds.labels, device=device)
    gl = torch.tensor(gallery_ds.labels, device=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = torch.arange(rank, len(q), world, device=device)
    hits = torch.zeros(len(ks) + 1, device=device, dtype=torch.float64)
    for ch in mine.split(2048):
        nn_idx = (q[ch] @ g.T).topk(max(ks), dim=1).indices
        m = gl[nn_idx] == ql[ch, None]
        for j, k in enumerate(ks):
            hits[j] += m[:, :k].any(1).sum()
        hits[-1] += len(ch)
    dist.all_reduce(hits)
    model.train()
    return {k: (100 * hits[j] / hits[-1]).item() for j, k in enumerate(ks)}


def xbm_contrastive(x, y, mx, my, margin=0.5):
    s = x @ mx.T
    pos = (y[:, None] == my[None]).float()
    neg = 1.0 - pos
    return (((1 - s) * pos).sum(1) + (F.relu(s - margin) * neg).sum(1)).mean()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    splits = read_inshop(args.root)
    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    tr_tf = T.Compose([T.RandomResizedCrop(224, scale=(0.2, 1.0)), T.RandomHorizontalFlip(), T.ToTensor(), norm])
    te_tf = T.Compose([T.Resize((256, 256)), T.CenterCrop(224), T.ToTensor(), norm])
    train_ds = ItemImages(args.root, splits["train"], tr_tf)
    test_ids = sorted({i for _, i in splits["query"] + splits["gallery"]})
    test_map = {i: n for n, i in enumerate(test_ids)}
    query_ds = ItemImages(args.root, splits["query"], te_tf, test_map)
    gallery_ds = ItemImages(args.root, splits["gallery"], te_tf, test_map)

    sampler = DistributedPKSampler(train_ds.labels, args.classes_per_batch, args.samples_per_class, rank, world)
    bs = args.classes_per_batch * args.samples_per_class
    loader = DataLoader(train_ds, batch_size=bs, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = Net(args.dim).to(device).train()
    # the backbone BN layers are frozen, so there is nothing to broadcast
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank], broadcast_buffers=False)
    lr = args.lr * math.sqrt(world)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=1e-5)

    start_epoch, best = 0, 0.0
    ckpt_path = os.path.join(args.out, "last.pth")
    resume = args.resume or (ckpt_path if os.path.exists(ckpt_path) else "")
    if resume:
        ck = torch.load(resume, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start_epoch, best = ck["epoch"], ck["best"]

    mem_x = torch.zeros(args.mem_size, args.dim, device=device)
    mem_y = torch.full((args.mem_size,), -1, device=device, dtype=torch.long)
    ptr, filled = 0, 0
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tot = torch.zeros(2, device=device)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            e = model(x)
            loss = xbm_contrastive(e, y, e, y)
            ge, gy = gather_padded(e.detach()), gather_padded(y)
            n = ge.shape[0]
            slots = (ptr + torch.arange(n, device=device)) % args.mem_size
            mem_x[slots], mem_y[slots] = ge, gy
            ptr, filled = (ptr + n) % args.mem_size, min(args.mem_size, filled + n)
            if epoch >= args.mem_start_epoch:
                loss = loss + xbm_contrastive(e, y, mem_x[:filled], mem_y[:filled])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])

        dist.all_reduce(tot)
        r = recall(model.module, query_ds, gallery_ds, device, args.workers)
        if rank == 0:
            print(f"epoch {epoch} loss {(tot[0] / tot[1]).item():.4f} " + " ".join(f"R@{k} {v:.2f}" for k, v in r.items()),
                  flush=True)
            best = max(best, r[1])
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch + 1,
                        "best": best}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
