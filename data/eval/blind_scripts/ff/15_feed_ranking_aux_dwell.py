"""Feed ranking: click prediction with an auxiliary dwell-time head.

Id tables are placed table-wise across ranks (one owner per table); the local
batch ids are all-gathered, each owner pools for the whole global batch and an
all-to-all (autograd aware, torch.distributed.nn) sends every rank the pooled
vectors of its samples. Towers and heads are replicated under DDP.

The dwell-time head is switched on after --aux_start steps, once the click
head has settled.

torchrun --nproc_per_node=8 15_feed_ranking_aux_dwell.py --data /mnt/feed/2024_05
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dnn
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

TABLES = [
    ("viewer_id", 150_000_000), ("author_id", 20_000_000), ("post_id", 60_000_000),
    ("topic_id", 50_000), ("lang", 200), ("surface", 16), ("viewer_country", 250), ("media_type", 8),
]


class FeedLogs(Dataset):
    def __init__(self, root, split):
        self.ids = np.load(os.path.join(root, f"{split}_ids.npy"), mmap_mode="r")
        self.dense = np.load(os.path.join(root, f"{split}_dense.npy"), mmap_mode="r")
        self.click = np.load(os.path.join(root, f"{split}_click.npy"), mmap_mode="r")
        self.dwell = np.load(os.path.join(root, f"{split}_dwell.npy"), mmap_mode="r")

    def __len__(self):
        return len(self.click)

    def __getitem__(self, i):
        return (np.asarray(self.ids[i], dtype=np.int64), np.asarray(self.dense[i], dtype=np.float32),
                np.float32(self.click[i]), np.float32(np.log1p(self.dwell[i])))


class TableWise(nn.Module):
    def __init__(self, dim, rank, world, device):
        super().__init__()
        self.dim, self.rank, self.world = dim, rank, world
        sizes = [n for _, n in TABLES]
        # greedy by rows so the 150M viewer table does not share a GPU with the post table
        load, self.owner = [0] * world, [0] * len(TABLES)
        for t in sorted(range(len(TABLES)), key=lambda t: -sizes[t]):
            r = min(range(world), key=lambda k: (load[k], k))
            self.owner[t], load[r] = r, load[r] + sizes[t]
        self.groups = [[t for t in range(len(TABLES)) if self.owner[t] == r] for r in range(world)]
        self.local = nn.ModuleList(
            [nn.Embedding(sizes[t], dim, sparse=True, device=device) for t in self.groups[rank]]
        )
        for e in self.local:
            nn.init.normal_(e.weight, std=0.02)
        perm = [t for g in self.groups for t in g]
        self.register_buffer("unperm", torch.tensor(np.argsort(perm), device=device), persistent=False)

    def forward(self, ids):
        b = ids.size(0)
        every = ids.new_empty(self.world * b, ids.size(1))
        dist.all_gather_into_tensor(every, ids.contiguous())
        mine = self.groups[self.rank]
        if mine:
            pooled = torch.stack([e(every[:, t]) for e, t in zip(self.local, mine)], dim=1)
        else:
            pooled = torch.zeros(self.world * b, 0, self.dim, device=ids.device, requires_grad=self.training)
        out_sizes = [b * len(g) * self.dim for g in self.groups]
        out = torch.empty(sum(out_sizes), device=ids.device)
        out = dnn.all_to_all_single(out, pooled.reshape(-1), output_split_sizes=out_sizes,
                                    input_split_sizes=[b * len(mine) * self.dim] * self.world)
        parts = [o.view(b, len(g), self.dim) for o, g in zip(out.split(out_sizes), self.groups)]
        return torch.cat(parts, dim=1)[:, self.unperm]


class Ranker(nn.Module):
    def __init__(self, dim, num_dense):
        super().__init__()
        self.dense_in = nn.Sequential(nn.Linear(num_dense, 128), nn.ReLU(), nn.Linear(128, dim))
        self.trunk = nn.Sequential(
            nn.Linear(dim * (len(TABLES) + 1), 1024), nn.ReLU(),
            nn.Linear(1024, 512), nn.ReLU(),
        )
        self.click_head = nn.Linear(512, 1)
        self.dwell_head = nn.Sequential(nn.Linear(512, 128), nn.ReLU(), nn.Linear(128, 1))

    def forward(self, emb, dense, with_dwell=False):
        h = self.trunk(torch.cat([emb.flatten(1), self.dense_in(dense)], dim=1))
        click = self.click_head(h).squeeze(1)
        dwell = self.dwell_head(h).squeeze(1) if with_dwell else None
        return click, dwell


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--num_dense", type=int, default=24)
    ap.add_argument("--batch_size", type=int, default=2048)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--emb_lr", type=float, default=0.01)
    ap.add_argument("--aux_start", type=int, default=3000)
    ap.add_argument("--aux_weight", type=float, default=0.2)
    ap.add_argument("--out", default="/mnt/feed/ckpt/ranker_dwell")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    emb = TableWise(args.dim, rank, world, device)
    model = DDP(Ranker(args.dim, args.num_dense).to(device), device_ids=[local_rank])
    emb_opt = torch.optim.SparseAdam(list(emb.parameters()), lr=args.emb_lr)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    train_ds, val_ds = FeedLogs(args.data, "train"), FeedLogs(args.data, "val")
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                        num_workers=6, pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, drop_last=True, num_workers=6,
                            sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True))

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        emb.train()
        model.train()
        t0 = time.time()
        for ids, dense, click, dwell in loader:
            ids, dense = ids.to(device, non_blocking=True), dense.to(device, non_blocking=True)
            click, dwell = click.to(device, non_blocking=True), dwell.to(device, non_blocking=True)
            use_dwell = step >= args.aux_start
            click_logit, dwell_pred = model(emb(ids), dense, with_dwell=use_dwell)
            loss = F.binary_cross_entropy_with_logits(click_logit, click)
            if use_dwell:
                # dwell is only meaningful for clicked impressions
                mask = click > 0
                if mask.any():
                    loss = loss + args.aux_weight * F.smooth_l1_loss(dwell_pred[mask], dwell[mask])
                else:
                    loss = loss + 0.0 * dwell_pred.sum()
            emb_opt.zero_grad()
            opt.zero_grad()
            loss.backward()
            emb_opt.step()
            opt.step()
            step += 1
            if rank == 0 and step % 200 == 0:
                print(f"ep {epoch} step {step} loss {loss.item():.4f} "
                      f"{200 * args.batch_size * world / (time.time() - t0):.0f} samples/s", flush=True)
                t0 = time.time()

        emb.eval()
        model.eval()
        tot = torch.zeros(2, device=device)
        with torch.no_grad():
            for ids, dense, click, _ in val_loader:
                ids, dense, click = ids.to(device), dense.to(device), click.to(device)
                logit, _ = model(emb(ids), dense)
                tot[0] += F.binary_cross_entropy_with_logits(logit, click, reduction="sum")
                tot[1] += click.numel()
        dist.all_reduce(tot)
        if rank == 0:
            print(f"epoch {epoch} val logloss {(tot[0] / tot[1]).item():.5f}", flush=True)

        os.makedirs(args.out, exist_ok=True)
        torch.save({"groups": emb.groups, "state": emb.state_dict()},
                   os.path.join(args.out, f"emb_{rank}_of_{world}.pt"))
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "step": step}, os.path.join(args.out, "dense.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
