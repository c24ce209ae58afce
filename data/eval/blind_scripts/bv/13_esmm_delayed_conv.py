"""ESMM (CTR + CTCVR over the entire impression space) for the feed ads ranker.

Conversions are attributed up to 72h after the click. Rows whose attribution
window is still open are exported with conv = -1; they still train the CTR
task. Training runs over the days in temporal order, like the online learner.

    torchrun --standalone --nproc_per_node=8 13_esmm_delayed_conv.py \
        --start 2024-05-01 --end 2024-05-14 --eval-day 2024-05-15
"""
import argparse
import datetime as dt
import os
import time

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

USER_FEATS = ["uid_h", "age_bucket", "gender", "city_h", "device_h"]
AD_FEATS = ["ad_h", "adgroup_h", "campaign_h", "advertiser_h", "cate_h", "brand_h"]
CTX_FEATS = ["slot", "hour", "net"]
FEATS = USER_FEATS + AD_FEATS + CTX_FEATS


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/mnt/shared/feed_ads/impressions")
    ap.add_argument("--start", default="2024-05-01")
    ap.add_argument("--end", default="2024-05-14")
    ap.add_argument("--eval-day", default="2024-05-15")
    ap.add_argument("--vocab", type=int, default=1 << 23)
    ap.add_argument("--dim", type=int, default=24)
    ap.add_argument("--tower", default="360,200,80")
    ap.add_argument("--batch-size", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--ctcvr-weight", type=float, default=1.0)
    ap.add_argument("--out", default="/mnt/shared/feed_ads/models/esmm")
    return ap.parse_args()


def days(a, b):
    d0, d1 = dt.date.fromisoformat(a), dt.date.fromisoformat(b)
    return [(d0 + dt.timedelta(k)).isoformat() for k in range((d1 - d0).days + 1)]


def load(root, day_list):
    x, click, conv = [], [], []
    for d in day_list:
        t = pq.read_table(os.path.join(root, f"dt={d}"), columns=FEATS + ["click", "conv"])
        x.append(np.stack([t[c].to_numpy() for c in FEATS], axis=1).astype(np.int64))
        click.append(t["click"].to_numpy().astype(np.float32))
        conv.append(t["conv"].to_numpy().astype(np.float32))
    return TensorDataset(torch.from_numpy(np.concatenate(x)),
                         torch.from_numpy(np.concatenate(click)),
                         torch.from_numpy(np.concatenate(conv)))


def tower(d_in, sizes):
    layers = []
    for h in sizes:
        layers += [nn.Linear(d_in, h), nn.ReLU()]
        d_in = h
    layers.append(nn.Linear(d_in, 1))
    return nn.Sequential(*layers)


class ESMM(nn.Module):
    def __init__(self, vocab, dim, sizes):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)            # shared by both tasks
        nn.init.normal_(self.emb.weight, std=0.01)
        d = len(FEATS) * dim
        self.ctr = tower(d, sizes)
        self.cvr = tower(d, sizes)

    def forward(self, x, with_cvr=True):
        h = self.emb(x).flatten(1)
        ctr_logit = self.ctr(h).squeeze(1)
        if not with_cvr:
            return ctr_logit, None
        return ctr_logit, self.cvr(h).squeeze(1)


@torch.no_grad()
def evaluate(model, loader, device, n):
    model.eval()
    cols = []
    for x, click, conv in loader:
        ctr_logit, cvr_logit = model(x.to(device))
        p_ctr = torch.sigmoid(ctr_logit)
        p_ctcvr = p_ctr * torch.sigmoid(cvr_logit)
        cols.append(torch.stack([p_ctr, p_ctcvr, click.to(device), conv.to(device)], 1))
    local = torch.cat(cols)
    world = dist.get_world_size()
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local)
    allp = torch.stack(parts, 1).reshape(-1, 4)[:n].cpu().numpy()
    model.train()
    res = {"ctr_auc": roc_auc_score(allp[:, 2], allp[:, 0])}
    known = allp[:, 3] >= 0
    if known.any() and 0 < allp[known, 3].sum() < known.sum():
        res["ctcvr_auc"] = roc_auc_score(allp[known, 3] * allp[known, 2], allp[known, 1])
    return res


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    train = load(args.root, days(args.start, args.end))
    valid = load(args.root, [args.eval_day])
    # temporal order: each rank walks the same time range, no shuffling
    train_loader = DataLoader(train, batch_size=args.batch_size,
                              sampler=DistributedSampler(train, shuffle=False),
                              num_workers=4, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid, batch_size=8192,
                              sampler=DistributedSampler(valid, shuffle=False),
                              num_workers=4, pin_memory=True)

    model = ESMM(args.vocab, args.dim, [int(s) for s in args.tower.split(",")]).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"train rows {len(train)}  steps/rank {len(train_loader)}", flush=True)

    t0 = time.time()
    for step, (x, click, conv) in enumerate(train_loader):
        x = x.to(device, non_blocking=True)
        click = click.to(device, non_blocking=True)
        conv = conv.to(device, non_blocking=True)
        known = conv >= 0

        ctr_logit, cvr_logit = model(x, with_cvr=bool(known.any()))
        loss = F.binary_cross_entropy_with_logits(ctr_logit, click)
        if cvr_logit is not None:
            p_ctcvr = torch.sigmoid(ctr_logit[known]) * torch.sigmoid(cvr_logit[known])
            y_ctcvr = click[known] * conv[known]
            loss = loss + args.ctcvr_weight * F.binary_cross_entropy(p_ctcvr.clamp(1e-7, 1 - 1e-7), y_ctcvr)

        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

        if rank == 0 and step % 500 == 0:
            print(f"step {step}/{len(train_loader)} loss {loss.item():.5f} "
                  f"known-conv {known.float().mean().item():.2f} {time.time() - t0:.0f}s", flush=True)

    metrics = evaluate(model, valid_loader, device, len(valid))
    if rank == 0:
        print("eval", {k: round(v, 5) for k, v in metrics.items()}, flush=True)
        torch.save({"model": model.module.state_dict(), "metrics": metrics,
                    "train_range": [args.start, args.end]}, os.path.join(args.out, f"esmm_{args.end}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
