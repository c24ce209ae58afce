"""Multi-Similarity loss with a cross-batch memory (XBM) on In-Shop Clothes Retrieval.

The memory holds detached embeddings of the last `--xbm-size` samples of the
*global* batch (gathered from all GPUs), so it is identical on every rank.

    torchrun --nproc_per_node=4 07_xbm_inshop_multisimilarity.py --data /data/inshop
"""
import argparse
import contextlib
import json
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/inshop")
    p.add_argument("--embedding", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=80, help="per GPU")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--iters", type=int, default=20000)
    p.add_argument("--xbm-size", type=int, default=8192)
    p.add_argument("--xbm-start", type=int, default=1000)
    p.add_argument("--xbm-weight", type=float, default=1.0)
    p.add_argument("--accum", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--eval-every", type=int, default=2000)
    p.add_argument("--out", default="output/xbm_inshop")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class InShop(Dataset):
    def __init__(self, root, items, tf):
        self.root, self.items, self.tf = root, items, tf

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, label = self.items[i]
        return self.tf(Image.open(os.path.join(self.root, path)).convert("RGB")), label


def read_inshop(root):
    splits = {"train": [], "query": [], "gallery": []}
    with open(os.path.join(root, "list_eval_partition.txt")) as f:
        for line in f.read().splitlines()[2:]:
            path, item_id, status = line.split()
            splits[status].append((path, item_id))
    out = {}
    for name, rows in splits.items():
        ids = sorted({i for _, i in rows})
        mapping = {i: k for k, i in enumerate(ids)}
        out[name] = [(p, mapping[i]) for p, i in rows]
    # query and gallery must share one id space
    shared = sorted({i for _, i in splits["query"]} | {i for _, i in splits["gallery"]})
    m = {i: k for k, i in enumerate(shared)}
    out["query"] = [(p, m[i]) for p, i in splits["query"]]
    out["gallery"] = [(p, m[i]) for p, i in splits["gallery"]]
    return out


class Net(nn.Module):
    def __init__(self, dim):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V2")
        self.body = nn.Sequential(*list(r.children())[:-2])
        self.embed = nn.Linear(2048, dim)
        self.dim = dim

    def forward(self, x):
        f = self.body(x)
        f = F.adaptive_avg_pool2d(f, 1) + F.adaptive_max_pool2d(f, 1)
        return F.normalize(self.embed(f.flatten(1)), dim=1)

    def freeze_bn(self):
        for m in self.body.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.eval()
                m.weight.requires_grad_(False)
                m.bias.requires_grad_(False)


class XBM:
    def __init__(self, size, dim, device):
        self.feats = torch.zeros(size, dim, device=device)
        self.targets = torch.full((size,), -1, dtype=torch.long, device=device)
        self.ptr, self.size, self.full = 0, size, False

    @torch.no_grad()
    def enqueue(self, feats, targets):
        n = feats.size(0)
        idx = (torch.arange(n, device=feats.device) + self.ptr) % self.size
        self.feats[idx] = feats
        self.targets[idx] = targets
        self.full = self.full or self.ptr + n >= self.size
        self.ptr = (self.ptr + n) % self.size

    def get(self):
        if self.full:
            return self.feats, self.targets
        return self.feats[:self.ptr], self.targets[:self.ptr]


@torch.no_grad()
def concat_all_gather(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.cat(out)


def multi_similarity(q, q_y, k, k_y, alpha=2.0, beta=50.0, base=0.5, margin=0.1):
    sim = q @ k.t()
    loss = []
    for i in range(q.size(0)):
        pos = sim[i][(k_y == q_y[i]) & (sim[i] < 1 - 1e-5)]
        neg = sim[i][k_y != q_y[i]]
        if pos.numel() == 0 or neg.numel() == 0:
            continue
        neg = neg[neg + margin > pos.min()]
        pos = pos[pos - margin < neg.max()] if neg.numel() else pos
        if pos.numel() == 0 or neg.numel() == 0:
            continue
        loss.append(torch.log1p(torch.exp(-alpha * (pos - base)).sum()) / alpha
                    + torch.log1p(torch.exp(beta * (neg - base)).sum()) / beta)
    if not loss:
        return q.sum() * 0.0
    return torch.stack(loss).mean()


@torch.no_grad()
def evaluate(net, q_loader, g_loader, device):
    net.eval()
    def embed(loader):
        fs, ys = [], []
        for x, y in loader:
            fs.append(net(x.to(device)))
            ys.append(y.to(device))
        return torch.cat(fs), torch.cat(ys)
    qf, qy = embed(q_loader)
    gf, gy = embed(g_loader)
    top = (qf @ gf.t()).topk(50, dim=1).indices
    hits = gy[top] == qy[:, None]
    net.train()
    net.freeze_bn()
    return {k: hits[:, :k].any(1).float().mean().item() for k in (1, 10, 20, 30, 40, 50)}


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    # different augmentation streams per rank; weights are synchronised by DDP at construction
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    splits = read_inshop(args.data)
    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_set = InShop(os.path.join(args.data, "img"), splits["train"], T.Compose([
        T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), norm]))
    test_tf = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm])
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True)

    net = Net(args.embedding).to(device)
    net.freeze_bn()
    model = DDP(net, device_ids=[local_rank])
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=args.lr, weight_decay=5e-4)
    xbm = XBM(args.xbm_size, args.embedding, device)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        q_loader = DataLoader(InShop(os.path.join(args.data, "img"), splits["query"], test_tf), batch_size=256, num_workers=8)
        g_loader = DataLoader(InShop(os.path.join(args.data, "img"), splits["gallery"], test_tf), batch_size=256, num_workers=8)

    it, epoch, micro = 0, 0, 0
    t0 = time.time()
    while it < args.iters:
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            sync = (micro + 1) % args.accum == 0
            ctx = model.no_sync() if not sync else contextlib.nullcontext()
            with ctx:
                f = model(x)
                loss = multi_similarity(f, y, f, y)
                if it >= args.xbm_start:
                    xbm.enqueue(concat_all_gather(f.detach()), concat_all_gather(y))
                    bank_f, bank_y = xbm.get()
                    loss = loss + args.xbm_weight * multi_similarity(f, y, bank_f, bank_y)
                (loss / args.accum).backward()
            micro += 1
            if not sync:
                continue
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            it += 1
            if rank == 0 and it % 100 == 0:
                print(f"it {it} loss {loss.item():.4f} xbm {xbm.ptr}/{xbm.size} "
                      f"{time.time() - t0:.0f}s", flush=True)
            if it % args.eval_every == 0:
                if rank == 0:
                    res = evaluate(model.module, q_loader, g_loader, device)
                    print(f"it {it} " + json.dumps(res), flush=True)
                    torch.save({"model": model.module.state_dict(), "it": it},
                               os.path.join(args.out, f"ckpt_{it}.pth"))
                dist.barrier()
            if it >= args.iters:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
