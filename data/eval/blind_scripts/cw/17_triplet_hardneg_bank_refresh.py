"""Product image retrieval with triplets whose negatives are mined from an embedding bank.

At the start of every epoch all training images are embedded (each rank embeds a shard and the
bank is assembled on every rank). For each anchor we take the top-k nearest images of other
products and pick one at random as its hard negative for the epoch.

torchrun --nproc_per_node=8 17_triplet_hardneg_bank_refresh.py --train data/train.csv \
    --query data/query.csv --gallery data/gallery.csv --root /data/products --out runs/triplet_hn
"""
import argparse
import csv
import os
import random
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--query", required=True)
    p.add_argument("--gallery", required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--out", default="runs/triplet_hn")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=48, help="triplets per GPU")
    p.add_argument("--lr", type=float, default=2e-4, help="for 384 triplets per step")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--margin", type=float, default=0.2)
    p.add_argument("--topk", type=int, default=50)
    p.add_argument("--cls-weight", type=float, default=0.5)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def read_rows(path):
    with open(path) as f:
        return [(r["path"], int(r["product_id"])) for r in csv.DictReader(f)]


class Plain(Dataset):
    def __init__(self, rows, root, tf):
        self.rows, self.root, self.tf = rows, root, tf

    def __len__(self):
        return len(self.rows)

    def load(self, i):
        return self.tf(Image.open(os.path.join(self.root, self.rows[i][0])).convert("RGB"))

    def __getitem__(self, i):
        return self.load(i), self.rows[i][1], i


class Triplets(Plain):
    def __init__(self, rows, root, tf, seed):
        super().__init__(rows, root, tf)
        pids = sorted({p for _, p in rows})
        self.label = {p: n for n, p in enumerate(pids)}
        self.by_pid = defaultdict(list)
        for i, (_, p) in enumerate(rows):
            self.by_pid[p].append(i)
        self.neg_of = None  # filled in by set_negatives() every epoch
        self.seed, self.epoch = seed, 0

    def set_negatives(self, neg_of, epoch):
        self.neg_of, self.epoch = neg_of, epoch

    def __getitem__(self, i):
        pid = self.rows[i][1]
        rng = random.Random(hash((self.seed, self.epoch, i)))
        same = self.by_pid[pid]
        pos = rng.choice([j for j in same if j != i] or same)
        if self.neg_of is None:
            neg = rng.randrange(len(self.rows))
            while self.rows[neg][1] == pid:
                neg = rng.randrange(len(self.rows))
        else:
            neg = int(self.neg_of[i])
        return self.load(i), self.load(pos), self.load(neg), self.label[pid]


class Net(nn.Module):
    def __init__(self, dim, n_cls):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V2")
        r.fc = nn.Identity()
        self.backbone = r
        self.embed = nn.Linear(2048, dim)
        self.cls = nn.Linear(dim, n_cls)  # auxiliary product classifier, used every step

    def forward(self, x):
        e = self.embed(self.backbone(x))
        return F.normalize(e, dim=1), self.cls(e)


@torch.no_grad()
def gather(t):
    bufs = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(bufs, t.contiguous())
    return torch.cat(bufs)


@torch.no_grad()
def embed_all(net, ds, device, workers):
    net.eval()
    loader = DataLoader(ds, batch_size=256, sampler=DistributedSampler(ds, shuffle=False),
                        num_workers=workers, pin_memory=True)
    f, ix = [], []
    for x, _, i in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            f.append(net(x.to(device, non_blocking=True))[0].float())
        ix.append(i.to(device))
    f, ix = gather(torch.cat(f)), gather(torch.cat(ix))
    bank = torch.empty(len(ds), f.shape[1], device=device)
    bank[ix] = f  # padded samples of the sampler write the same row twice
    net.train()
    return bank


@torch.no_grad()
def mine_negatives(bank, pids, topk, seed, epoch):
    """Same bank on every rank + a generator seeded by epoch -> same table on every rank."""
    g = torch.Generator(device=bank.device)
    g.manual_seed(seed * 1000 + epoch)
    table = torch.empty(len(bank), dtype=torch.long, device=bank.device)
    for chunk in torch.arange(len(bank), device=bank.device).split(4096):
        sim = bank[chunk] @ bank.T
        sim[pids[chunk][:, None] == pids[None, :]] = -2.0
        cand = sim.topk(topk, dim=1).indices
        pick = torch.randint(0, topk, (len(chunk),), generator=g, device=bank.device)
        table[chunk] = cand[torch.arange(len(chunk), device=bank.device), pick]
    return table.cpu()


@torch.no_grad()
def recall(net, qds, gds, device, workers, ks=(1, 5, 10, 20)):
    q, g = embed_all(net, qds, device, workers), embed_all(net, gds, device, workers)
    qp = torch.tensor([p for _, p in qds.rows], device=device)
    gp = torch.tensor([p for _, p in gds.rows], device=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = torch.arange(rank, len(q), world, device=device)
    top = (q[mine] @ g.T).topk(max(ks), dim=1).indices
    hit = gp[top] == qp[mine, None]
    c = torch.tensor([float(hit[:, :k].any(1).sum()) for k in ks] + [float(len(mine))], device=device)
    dist.all_reduce(c)
    return {f"R@{k}": (100 * c[j] / c[-1]).item() for j, k in enumerate(ks)}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    # per-rank augmentation randomness; the model itself is broadcast from rank 0 by DDP
    torch.manual_seed(args.seed + rank)

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    tr = T.Compose([T.RandomResizedCrop(224, scale=(0.3, 1.0)), T.RandomHorizontalFlip(), T.ToTensor(), norm])
    te = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm])
    train_rows = read_rows(args.train)
    train_ds = Triplets(train_rows, args.root, tr, args.seed)
    bank_ds = Plain(train_rows, args.root, te)
    qds, gds = Plain(read_rows(args.query), args.root, te), Plain(read_rows(args.gallery), args.root, te)
    pids = torch.tensor([p for _, p in train_rows], device=device)

    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    # workers are re-created every epoch so they see the freshly mined negatives
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=False)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(Net(args.dim, len(train_ds.label))).to(device)
    model = nn.parallel.DistributedDataParallel(net, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 384
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    start, best = 0, 0.0
    ckpt = os.path.join(args.out, "last.pt")
    if os.path.exists(ckpt):
        state = torch.load(ckpt, map_location="cpu")
        net.load_state_dict(state["net"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start, best = state["epoch"], state["best"]
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start, args.epochs):
        if epoch > 0:
            bank = embed_all(net, bank_ds, device, args.workers)
            train_ds.set_negatives(mine_negatives(bank, pids, args.topk, args.seed, epoch), epoch)
        sampler.set_epoch(epoch)
        model.train()
        t0, tot = time.time(), torch.zeros(2, device=device)
        for a, p, n, y in loader:
            x = torch.cat([a, p, n]).to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                emb, logits = model(x)
            emb, logits = emb.float(), logits.float()
            ea, ep, en = emb.chunk(3)
            trip = F.relu((ea * en).sum(1) - (ea * ep).sum(1) + args.margin).mean()
            loss = trip + args.cls_weight * F.cross_entropy(logits[:len(y)], y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(tot)
        res = recall(net, qds, gds, device, args.workers)
        if rank == 0:
            print(f"epoch {epoch} loss {(tot[0] / tot[1]).item():.4f} {time.time() - t0:.0f}s "
                  + " ".join(f"{k} {v:.2f}" for k, v in res.items()), flush=True)
            best = max(best, res["R@1"])
            torch.save({"net": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch + 1, "best": best}, ckpt)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
