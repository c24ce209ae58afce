"""Landmark retrieval (GLDv2-clean) with a momentum key encoder and a labeled key queue
(supervised contrastive loss against the queue), GeM pooling + whitening head.

torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29500 \
    14_landmark_supcon_queue.py --train-csv /shared/gldv2/train_clean.csv --img-dir /shared/gldv2/train \
    --eval-query /shared/gldv2/val_query.csv --eval-index /shared/gldv2/val_index.csv --out /shared/runs/gld_supcon
"""
import argparse
import copy
import csv
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-csv", required=True)
    p.add_argument("--img-dir", required=True)
    p.add_argument("--eval-query", required=True)
    p.add_argument("--eval-index", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--backbone", default="resnet101.a1h_in1k")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--img-size", type=int, default=384)
    p.add_argument("--batch-size", type=int, default=32, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3, help="for a global batch of 512")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--queue", type=int, default=32768)
    p.add_argument("--m", type=float, default=0.999)
    p.add_argument("--tau", type=float, default=0.05)
    p.add_argument("--workers", type=int, default=10)
    return p.parse_args()


def read_csv(path):
    with open(path) as f:
        return [(r["id"], int(r["landmark_id"])) for r in csv.DictReader(f)]


class GLD(Dataset):
    def __init__(self, rows, img_dir, tf):
        self.rows, self.img_dir, self.tf = rows, img_dir, tf

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        img_id, lid = self.rows[i]
        path = os.path.join(self.img_dir, img_id[0], img_id[1], img_id[2], img_id + ".jpg")
        return self.tf(Image.open(path).convert("RGB")), lid, i


class GeM(nn.Module):
    def __init__(self, p=3.0):
        super().__init__()
        self.p = nn.Parameter(torch.tensor(p))

    def forward(self, x):
        return F.avg_pool2d(x.clamp(min=1e-6).pow(self.p), x.shape[-2:]).pow(1.0 / self.p).flatten(1)


class Retriever(nn.Module):
    def __init__(self, backbone, dim):
        super().__init__()
        self.body = timm.create_model(backbone, pretrained=True, num_classes=0, global_pool="")
        self.pool = GeM()
        self.whiten = nn.Linear(self.body.num_features, dim)

    def forward(self, x):
        return F.normalize(self.whiten(self.pool(self.body(x))), dim=-1)


class SupConQueue(nn.Module):
    def __init__(self, backbone, dim, K, m, tau):
        super().__init__()
        self.q_net = Retriever(backbone, dim)
        self.k_net = copy.deepcopy(self.q_net)
        for p in self.k_net.parameters():
            p.requires_grad = False
        self.K, self.m, self.tau = K, m, tau
        self.register_buffer("queue", F.normalize(torch.randn(K, dim), dim=1))
        self.register_buffer("queue_y", torch.full((K,), -1, dtype=torch.long))
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))

    @torch.no_grad()
    def _enqueue(self, k, y):
        k, y = concat_all_gather(k), concat_all_gather(y)
        slots = (self.ptr + torch.arange(k.shape[0], device=k.device)) % self.K
        self.queue[slots], self.queue_y[slots] = k, y
        self.ptr.copy_((self.ptr + k.shape[0]) % self.K)

    def forward(self, x_q, x_k, y):
        q = self.q_net(x_q)
        with torch.no_grad():
            for pq, pk in zip(self.q_net.parameters(), self.k_net.parameters()):
                pk.mul_(self.m).add_(pq.detach(), alpha=1 - self.m)
            k = self.k_net(x_k)
        keys = torch.cat([k, self.queue.clone().detach()])
        key_y = torch.cat([y, self.queue_y.clone()])
        logits = q @ keys.T / self.tau
        pos = (y[:, None] == key_y[None, :]).float()
        log_prob = logits - torch.logsumexp(logits, dim=1, keepdim=True)
        loss = -(log_prob * pos).sum(1) / pos.sum(1)
        self._enqueue(k, y)
        return loss.mean()


@torch.no_grad()
def concat_all_gather(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.cat(out)


class TwoViews:
    def __init__(self, tf):
        self.tf = tf

    def __call__(self, img):
        return torch.stack([self.tf(img), self.tf(img)])


@torch.no_grad()
def evaluate(net, query_ds, index_ds, device, workers, ks=(1, 5, 10, 100)):
    net.eval()
    # index: every rank embeds a shard, then the full index is assembled on every rank
    loader = DataLoader(index_ds, batch_size=64, sampler=DistributedSampler(index_ds, shuffle=False),
                        num_workers=workers, pin_memory=True)
    feats, idx = [], []
    for x, _, i in loader:
        feats.append(net(x.to(device, non_blocking=True)))
        idx.append(i.to(device))
    feats, idx = concat_all_gather(torch.cat(feats)), concat_all_gather(torch.cat(idx))
    index = torch.zeros(len(index_ds), feats.shape[1], device=device)
    index[idx] = feats
    index_y = torch.tensor([r[1] for r in index_ds.rows], device=device)

    qloader = DataLoader(query_ds, batch_size=64, sampler=DistributedSampler(query_ds, shuffle=False),
                         num_workers=workers, pin_memory=True)
    hits = {k: 0 for k in ks}
    ap_sum, n_q = 0.0, 0
    for x, y, _ in qloader:
        q = net(x.to(device, non_blocking=True))
        y = y.to(device)
        top = (q @ index.T).topk(max(ks), dim=1).indices
        match = (index_y[top] == y[:, None]).float()
        for k in ks:
            hits[k] += match[:, :k].any(1).sum().item()
        prec = match.cumsum(1) / torch.arange(1, match.shape[1] + 1, device=device)
        ap_sum += ((prec * match).sum(1) / match.sum(1).clamp(min=1)).sum().item()
        n_q += len(y)
    net.train()
    res = {f"R@{k}": 100.0 * hits[k] / n_q for k in ks}
    res["mAP@100"] = 100.0 * ap_sum / n_q
    return res


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    aug = T.Compose([T.RandomResizedCrop(args.img_size, scale=(0.25, 1.0)), T.RandomHorizontalFlip(),
                     T.ColorJitter(0.2, 0.2, 0.2), T.ToTensor(), norm])
    plain = T.Compose([T.Resize(args.img_size), T.CenterCrop(args.img_size), T.ToTensor(), norm])
    train_ds = GLD(read_csv(args.train_csv), args.img_dir, TwoViews(aug))
    query_ds = GLD(read_csv(args.eval_query), args.img_dir, plain)
    index_ds = GLD(read_csv(args.eval_index), args.img_dir, plain)

    sampler = DistributedSampler(train_ds, shuffle=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = SupConQueue(args.backbone, args.dim, args.queue, args.m, args.tau)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 512
    opt = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=lr, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=args.epochs * len(loader),
                                                pct_start=0.05)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        t0, tot = time.time(), torch.zeros(2, device=device)
        for step, (views, y, _) in enumerate(loader):
            views, y = views.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = ddp(views[:, 0], views[:, 1], y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            tot += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            if rank == 0 and step % 200 == 0:
                print(f"ep {epoch} step {step}/{len(loader)} loss {loss.item():.4f}", flush=True)
        dist.all_reduce(tot)

        res = evaluate(model.q_net, query_ds, index_ds, device, args.workers)
        if rank == 0:
            print(f"epoch {epoch} loss {(tot[0] / tot[1]).item():.4f} {time.time() - t0:.0f}s "
                  + " ".join(f"{k} {v:.2f}" for k, v in res.items()), flush=True)
            torch.save({"model": model.q_net.state_dict(), "epoch": epoch, "metrics": res},
                       os.path.join(args.out, "last.pth"))
            if res["mAP@100"] > best:
                best = res["mAP@100"]
                torch.save({"model": model.q_net.state_dict(), "epoch": epoch, "metrics": res},
                           os.path.join(args.out, "best.pth"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
