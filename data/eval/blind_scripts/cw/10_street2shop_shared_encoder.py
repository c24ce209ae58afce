"""Consumer-to-shop (street2shop) retrieval with a shared ResNet-50 encoder.

Each training pair is a street photo and a shop photo of the same product. The loss is an
InfoNCE from street queries to shop keys: the in-batch shop images of all ranks plus a
FIFO queue of shop embeddings from earlier steps.

torchrun --nproc_per_node=8 10_street2shop_shared_encoder.py --pairs data/s2s/train_pairs.jsonl \
    --val-queries data/s2s/val_queries.jsonl --val-gallery data/s2s/val_gallery.jsonl --out out/s2s_r50
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import transforms as T


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--pairs", required=True)
    p.add_argument("--val-queries", required=True)
    p.add_argument("--val-gallery", required=True)
    p.add_argument("--image-root", default="/data/street2shop/images")
    p.add_argument("--out", default="out/s2s")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=64, help="pairs per GPU")
    p.add_argument("--lr", type=float, default=0.01, help="for 512 pairs per step")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--queue-size", type=int, default=32768)
    p.add_argument("--tau", type=float, default=0.05)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip()]


class PairSet(Dataset):
    def __init__(self, rows, root, tf):
        self.rows, self.root, self.tf = rows, root, tf

    def __len__(self):
        return len(self.rows)

    def load(self, rel):
        return self.tf(Image.open(os.path.join(self.root, rel)).convert("RGB"))

    def __getitem__(self, i):
        r = self.rows[i]
        return self.load(r["street"]), self.load(r["shop"]), r["product_id"]


class SingleSet(Dataset):
    def __init__(self, rows, root, tf):
        self.rows, self.root, self.tf = rows, root, tf

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        return self.tf(Image.open(os.path.join(self.root, r["image"])).convert("RGB")), r["product_id"], i


class Encoder(nn.Module):
    def __init__(self, dim):
        super().__init__()
        net = torchvision.models.resnet50(weights="IMAGENET1K_V2")
        net.fc = nn.Sequential(nn.Linear(2048, 2048), nn.BatchNorm1d(2048), nn.ReLU(inplace=True),
                               nn.Linear(2048, dim))
        self.net = net

    def forward(self, x):
        return F.normalize(self.net(x), dim=1)


@torch.no_grad()
def all_gather(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.cat(out)


class ShopQueue:
    def __init__(self, size, dim, device):
        self.emb = torch.zeros(size, dim, device=device)
        self.pid = torch.full((size,), -1, dtype=torch.long, device=device)
        self.size, self.ptr = size, 0

    @torch.no_grad()
    def push(self, emb, pid):
        n = emb.shape[0]
        slots = (self.ptr + torch.arange(n, device=emb.device)) % self.size
        self.emb[slots], self.pid[slots] = emb, pid
        self.ptr = (self.ptr + n) % self.size


def s2s_loss(q, q_pid, k, k_pid, queue, tau):
    """q: local street embeddings; k: shop embeddings of all ranks (the local part keeps its grad)."""
    rank, n = dist.get_rank(), q.shape[0]
    logits_b = q @ k.T / tau
    logits_q = q @ queue.emb.T / tau
    # shop images of the same product elsewhere in the batch or queue are not negatives
    same_b = q_pid[:, None] == k_pid[None, :]
    same_b[torch.arange(n), rank * n + torch.arange(n)] = False
    same_q = (q_pid[:, None] == queue.pid[None, :]) | (queue.pid[None, :] < 0)
    logits = torch.cat([logits_b.masked_fill(same_b, -1e4), logits_q.masked_fill(same_q, -1e4)], dim=1)
    target = rank * n + torch.arange(n, device=q.device)
    return F.cross_entropy(logits, target)


@torch.no_grad()
def embed(model, ds, device, workers):
    loader = DataLoader(ds, batch_size=256, sampler=DistributedSampler(ds, shuffle=False), num_workers=workers)
    e, idx = [], []
    for x, _, i in loader:
        e.append(model(x.to(device, non_blocking=True)))
        idx.append(i.to(device))
    e, idx = all_gather(torch.cat(e)), all_gather(torch.cat(idx))
    out = torch.zeros(len(ds), e.shape[1], device=device)
    out[idx] = e
    return out


@torch.no_grad()
def recall_at_k(model, qds, gds, device, workers, ks=(1, 5, 20, 50)):
    model.eval()
    qe, ge = embed(model, qds, device, workers), embed(model, gds, device, workers)
    qp = torch.tensor([r["product_id"] for r in qds.rows], device=device)
    gp = torch.tensor([r["product_id"] for r in gds.rows], device=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = torch.arange(rank, len(qe), world, device=device)
    top = (qe[mine] @ ge.T).topk(max(ks), dim=1).indices
    m = gp[top] == qp[mine, None]
    c = torch.tensor([m[:, :k].any(1).sum() for k in ks] + [len(mine)], device=device, dtype=torch.float64)
    dist.all_reduce(c)
    model.train()
    return {f"R@{k}": (100 * c[j] / c[-1]).item() for j, k in enumerate(ks)}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    tr = T.Compose([T.RandomResizedCrop(224, scale=(0.4, 1.0)), T.RandomHorizontalFlip(),
                    T.ColorJitter(0.3, 0.3, 0.3), T.ToTensor(), norm])
    te = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm])
    train_ds = PairSet(read_jsonl(args.pairs), args.image_root, tr)
    qds = SingleSet(read_jsonl(args.val_queries), args.image_root, te)
    gds = SingleSet(read_jsonl(args.val_gallery), args.image_root, te)
    sampler = DistributedSampler(train_ds, shuffle=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    encoder = Encoder(args.dim).to(device)
    model = DDP(encoder, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 512
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4, nesterov=True)
    steps = args.epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps, pct_start=0.03,
                                                    anneal_strategy="cos")
    queue = ShopQueue(args.queue_size, args.dim, device)

    writer = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (street, shop, pid) in enumerate(loader):
            street = street.to(device, non_blocking=True)
            shop = shop.to(device, non_blocking=True)
            pid = pid.to(device, non_blocking=True)
            q = model(street)
            k_local = model(shop)
            k_all = all_gather(k_local.detach())
            pid_all = all_gather(pid)
            n = k_local.shape[0]
            k = torch.cat([k_all[:rank * n], k_local, k_all[(rank + 1) * n:]])
            loss = s2s_loss(q, pid, k, pid_all, queue, args.tau)

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            queue.push(k_all, pid_all)

            if writer is not None and it % 50 == 0:
                writer.add_scalar("loss", loss.item(), epoch * len(loader) + it)
                writer.add_scalar("lr", scheduler.get_last_lr()[0], epoch * len(loader) + it)

        rec = recall_at_k(model.module, qds, gds, device, args.workers)
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.0f}s) " + " ".join(f"{k} {v:.2f}" for k, v in rec.items()),
                  flush=True)
            for k, v in rec.items():
                writer.add_scalar(f"val/{k}", v, epoch)
            if rec["R@1"] > best:
                best = rec["R@1"]
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "recall": rec},
                           os.path.join(args.out, "best.pth"))
    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
