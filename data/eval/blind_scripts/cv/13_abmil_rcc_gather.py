"""Multi-class ABMIL for renal cell carcinoma subtyping (ccRCC / pRCC / chRCC), DDP.

Evaluation shards the slide list over ranks without DistributedSampler so that no slide
is scored twice, then all-gathers the class probabilities for a macro one-vs-rest AUC.

    torchrun --nproc_per_node=4 13_abmil_rcc_gather.py --fold 2
"""
import argparse
import os
import time

import h5py
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

SUBTYPES = {"ccRCC": 0, "pRCC": 1, "chRCC": 2}


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", default="data/rcc/slides.csv")       # case_id,slide_id,subtype,fold
    p.add_argument("--h5_dir", default="data/rcc/feats_uni/h5_files")
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--accum", type=int, default=8, help="bags per optimizer step")
    p.add_argument("--out", default="checkpoints/rcc_abmil")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class H5Bags(Dataset):
    def __init__(self, frame, h5_dir):
        self.frame = frame.reset_index(drop=True)
        self.h5_dir = h5_dir

    def __len__(self):
        return len(self.frame)

    def __getitem__(self, i):
        r = self.frame.iloc[i]
        with h5py.File(os.path.join(self.h5_dir, r.slide_id + ".h5"), "r") as f:
            feats = torch.as_tensor(f["features"][()], dtype=torch.float32)
        return feats, SUBTYPES[r.subtype]


class GatedAttentionPool(nn.Module):
    def __init__(self, dim, hidden=256):
        super().__init__()
        self.v = nn.Linear(dim, hidden)
        self.u = nn.Linear(dim, hidden)
        self.w = nn.Linear(hidden, 1)

    def forward(self, h):
        a = self.w(torch.tanh(self.v(h)) * torch.sigmoid(self.u(h)))
        return torch.softmax(a, dim=0)


class ABMIL(nn.Module):
    def __init__(self, in_dim=1024, dim=512, n_classes=3):
        super().__init__()
        self.proj = nn.Sequential(nn.Linear(in_dim, dim), nn.ReLU(), nn.Dropout(0.25))
        self.pool = GatedAttentionPool(dim)
        self.head = nn.Linear(dim, n_classes)

    def forward(self, x):
        h = self.proj(x)
        return self.head((self.pool(h) * h).sum(0, keepdim=True))


@torch.no_grad()
def evaluate(net, dataset, device, rank, world):
    net.eval()
    shard = Subset(dataset, list(range(rank, len(dataset), world)))
    loader = DataLoader(shard, batch_size=1, num_workers=4, pin_memory=True)
    probs, labels = [], []
    for x, y in loader:
        probs.append(F.softmax(net(x[0].to(device, non_blocking=True)), dim=-1))
        labels.append(y.to(device))
    probs = torch.cat(probs)
    labels = torch.cat(labels)

    all_probs = [torch.zeros_like(probs) for _ in range(world)]
    all_labels = [torch.zeros_like(labels) for _ in range(world)]
    dist.all_gather(all_probs, probs)
    dist.all_gather(all_labels, labels)
    probs = torch.cat(all_probs).cpu().numpy()
    labels = torch.cat(all_labels).cpu().numpy()
    auc = roc_auc_score(labels, probs, multi_class="ovr", average="macro")
    acc = float((probs.argmax(1) == labels).mean())
    return auc, acc


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    df = pd.read_csv(args.csv)
    df = df[df.subtype.isin(SUBTYPES)]
    train_df = df[(df.fold != args.fold) & (df.fold != (args.fold + 1) % 5)]
    val_df = df[df.fold == (args.fold + 1) % 5]
    test_df = df[df.fold == args.fold]
    train_ds, val_ds, test_ds = H5Bags(train_df, args.h5_dir), H5Bags(val_df, args.h5_dir), H5Bags(test_df, args.h5_dir)

    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=1, sampler=sampler, num_workers=4, pin_memory=True)

    net = ABMIL().to(device)
    model = DDP(net, device_ids=[local_rank])
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-3)
    counts = np.bincount(train_df.subtype.map(SUBTYPES), minlength=3)
    weight = torch.tensor(counts.sum() / (3.0 * counts), dtype=torch.float32, device=device)

    os.makedirs(args.out, exist_ok=True)
    ckpt_path = os.path.join(args.out, f"fold{args.fold}_best.pt")
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        optim.zero_grad(set_to_none=True)
        for step, (x, y) in enumerate(train_loader):
            loss = F.cross_entropy(model(x[0].to(device, non_blocking=True)), y.to(device), weight=weight)
            last = (step + 1) % args.accum == 0 or step + 1 == len(train_loader)
            if last:
                (loss / args.accum).backward()
                optim.step()
                optim.zero_grad(set_to_none=True)
            else:
                with model.no_sync():
                    (loss / args.accum).backward()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(running)

        val_auc, val_acc = evaluate(net, val_ds, device, rank, world)
        if rank == 0:
            print(f"ep {epoch:02d} loss {(running[0] / running[1]).item():.4f} "
                  f"val auc {val_auc:.4f} acc {val_acc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if val_auc > best:
                best = val_auc
                torch.save({"state_dict": net.state_dict(), "epoch": epoch, "val_auc": val_auc}, ckpt_path)
        dist.barrier()

    net.load_state_dict(torch.load(ckpt_path, map_location=device)["state_dict"])
    test_auc, test_acc = evaluate(net, test_ds, device, rank, world)
    if rank == 0:
        print(f"fold {args.fold}: test macro AUC {test_auc:.4f}  acc {test_acc:.4f}  (n={len(test_ds)})")
        with open(os.path.join(args.out, "results.tsv"), "a") as f:
            f.write(f"{args.fold}\t{best:.4f}\t{test_auc:.4f}\t{test_acc:.4f}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
