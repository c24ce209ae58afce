"""Field-weighted FM (FwFM) + DNN for the search-ads CTR model.

Reads hashed day partitions written by the feature pipeline as .npy shards:
    {root}/{yyyymmdd}/feat.npy  int32 [N, n_fields]
    {root}/{yyyymmdd}/label.npy uint8 [N]

    torchrun --standalone --nproc_per_node=8 16_fwfm_checkpointing.py --days 20240401-20240410
"""
import argparse
import datetime
import logging
import os
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("fwfm")


def options():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/mnt/shared/search_ads/hashed")
    ap.add_argument("--days", default="20240401-20240410")
    ap.add_argument("--valid-day", default="20240411")
    ap.add_argument("--n-fields", type=int, default=30)
    ap.add_argument("--buckets", type=int, default=10_000_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--save-every", type=int, default=5000)
    ap.add_argument("--ckpt-dir", default="/mnt/shared/search_ads/ckpt/fwfm")
    return ap.parse_args()


def day_list(spec):
    a, b = spec.split("-")
    d0 = datetime.datetime.strptime(a, "%Y%m%d")
    d1 = datetime.datetime.strptime(b, "%Y%m%d")
    return [(d0 + datetime.timedelta(days=i)).strftime("%Y%m%d") for i in range((d1 - d0).days + 1)]


class DayShard(Dataset):
    def __init__(self, folder):
        self.x = np.load(os.path.join(folder, "feat.npy"), mmap_mode="r")
        self.y = np.load(os.path.join(folder, "label.npy"), mmap_mode="r")

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i].astype(np.int64), np.float32(self.y[i])


class FwFM(nn.Module):
    def __init__(self, n_fields, buckets, dim):
        super().__init__()
        self.emb = nn.Embedding(buckets, dim)
        self.lin = nn.Embedding(buckets, 1)
        self.bias = nn.Parameter(torch.zeros(1))
        self.field_r = nn.Parameter(torch.ones(n_fields, n_fields) * 0.1)
        nn.init.normal_(self.emb.weight, std=0.01)
        nn.init.zeros_(self.lin.weight)
        iu = torch.triu_indices(n_fields, n_fields, offset=1)
        self.register_buffer("iu", iu, persistent=False)
        self.dnn = nn.Sequential(nn.Linear(n_fields * dim, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                                 nn.Linear(256, 1))

    def forward(self, x):
        e = self.emb(x)                                                  # B, F, D
        dots = (e[:, self.iu[0]] * e[:, self.iu[1]]).sum(-1)             # B, P
        fwfm = (dots * self.field_r[self.iu[0], self.iu[1]]).sum(1)
        return self.bias + self.lin(x).sum((1, 2)) + fwfm + self.dnn(e.flatten(1)).squeeze(1)


def save_checkpoint(path, model, opt, epoch, step):
    tmp = path + ".tmp"
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                "epoch": epoch, "step": step}, tmp)
    shutil.move(tmp, path)


@torch.no_grad()
def evaluate(model, loader, device, n):
    model.eval()
    ps, ys = [], []
    for x, y in loader:
        ps.append(torch.sigmoid(model(x.to(device, non_blocking=True))))
        ys.append(y.to(device, non_blocking=True))
    p, y = torch.cat(ps), torch.cat(ys)
    w = dist.get_world_size()
    gp, gy = [torch.empty_like(p) for _ in range(w)], [torch.empty_like(y) for _ in range(w)]
    dist.all_gather(gp, p)
    dist.all_gather(gy, y)
    model.train()
    p = torch.stack(gp, 1).flatten()[:n].cpu().numpy()
    y = torch.stack(gy, 1).flatten()[:n].cpu().numpy()
    return roc_auc_score(y, p)


def main():
    args = options()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    train = ConcatDataset([DayShard(os.path.join(args.root, d)) for d in day_list(args.days)])
    valid = DayShard(os.path.join(args.root, args.valid_day))
    sampler = DistributedSampler(train, shuffle=True)
    train_loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    valid_loader = DataLoader(valid, batch_size=16384, sampler=DistributedSampler(valid, shuffle=False),
                              num_workers=4, pin_memory=True)

    model = FwFM(args.n_fields, args.buckets, args.dim).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    os.makedirs(args.ckpt_dir, exist_ok=True)
    last = os.path.join(args.ckpt_dir, "last.pt")
    start_epoch, step = 0, 0
    if os.path.exists(last):
        ck = torch.load(last, map_location="cpu")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start_epoch, step = ck["epoch"] + 1, ck["step"]
        log.info("resuming from epoch %d (step %d)", start_epoch, step)

    model = DDP(model, device_ids=[local_rank])
    log.info("train %d rows over %d GPUs, %d steps/epoch", len(train), world, len(train_loader))

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step % 200 == 0:
                log.info("epoch %d step %d loss %.5f (%.0f ex/s)", epoch, step, loss.item(),
                         200 * args.batch_size * world / (time.time() - t0))
                t0 = time.time()
            if step % args.save_every == 0:
                save_checkpoint(os.path.join(args.ckpt_dir, f"step_{step}.pt"), model, opt, epoch, step)

        auc = evaluate(model, valid_loader, device, len(valid))
        log.info("epoch %d valid auc %.5f", epoch, auc)
        save_checkpoint(last, model, opt, epoch, step)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
