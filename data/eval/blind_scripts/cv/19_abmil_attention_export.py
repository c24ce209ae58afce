"""ABMIL for tumour-infiltrating-lymphocyte (TIL) high/low classification, DDP, plus export of
the top-attended patches of every test slide for pathologist review.

Features: <feat_dir>/h5_files/<slide_id>.h5 with 'features' [N, 1024] and 'coords' [N, 2].

    torchrun --nproc_per_node=4 19_abmil_attention_export.py --fold 3 --topk 32
"""
import argparse
import json
import os

import h5py
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--slides", default="meta/til_slides.csv")   # patient, slide_id, til_high
    ap.add_argument("--folds", default="meta/til_folds.csv")     # patient, fold
    ap.add_argument("--feat_dir", default="/data/til/feats_r50")
    ap.add_argument("--fold", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--topk", type=int, default=32)
    ap.add_argument("--out", default="out/til_abmil")
    ap.add_argument("--seed", type=int, default=8)
    return ap.parse_args()


class H5Slides(Dataset):
    def __init__(self, df, feat_dir, with_coords=False):
        self.df = df.reset_index(drop=True)
        self.feat_dir = feat_dir
        self.with_coords = with_coords

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        r = self.df.iloc[i]
        with h5py.File(os.path.join(self.feat_dir, "h5_files", f"{r.slide_id}.h5"), "r") as f:
            x = torch.from_numpy(f["features"][:])
            coords = torch.from_numpy(f["coords"][:]) if self.with_coords else torch.empty(0)
        return x, int(r.til_high), r.slide_id, coords


class ABMIL(nn.Module):
    def __init__(self, in_dim=1024, hid=512, att=128, n_classes=2):
        super().__init__()
        self.embed = nn.Sequential(nn.Linear(in_dim, hid), nn.ReLU(), nn.Dropout(0.25))
        self.att = nn.Sequential(nn.Linear(hid, att), nn.Tanh(), nn.Linear(att, 1))
        self.cls = nn.Linear(hid, n_classes)

    def attention_scores(self, x):
        """Un-normalised attention logits, one per patch."""
        return self.att(self.embed(x)).squeeze(-1)

    def forward(self, x):
        h = self.embed(x)
        a = torch.softmax(self.att(h).squeeze(-1), dim=0)
        return self.cls(a @ h).unsqueeze(0)


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    part = []
    for x, y, sid, _ in loader:
        p = net(x[0].to(device)).softmax(-1)[0, 1].item()
        part.append((sid[0], p, int(y)))
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, part)
    uniq = {s: (p, y) for chunk in parts for s, p, y in chunk}
    probs = np.array([v[0] for v in uniq.values()])
    ys = np.array([v[1] for v in uniq.values()])
    return roc_auc_score(ys, probs), uniq


@torch.no_grad()
def export_top_patches(model, dataset, device, k, path):
    model.eval()
    records = {}
    for i in range(len(dataset)):
        x, y, sid, coords = dataset[i]
        scores = model.attention_scores(x.to(device))
        top = torch.topk(scores, min(k, scores.numel())).indices.cpu()
        records[sid] = {"label": y, "coords": coords[top].tolist(), "scores": scores[top.to(device)].tolist()}
    with open(path, "w") as f:
        json.dump(records, f)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    slides = pd.read_csv(args.slides).merge(pd.read_csv(args.folds), on="patient")
    test_df = slides[slides.fold == args.fold]
    val_df = slides[slides.fold == (args.fold + 1) % slides.fold.nunique()]
    train_df = slides[~slides.index.isin(test_df.index) & ~slides.index.isin(val_df.index)]

    train_ds = H5Slides(train_df, args.feat_dir)
    val_ds = H5Slides(val_df, args.feat_dir)
    test_ds = H5Slides(test_df, args.feat_dir)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=1, sampler=train_sampler, num_workers=4, pin_memory=True)
    val_dl = DataLoader(val_ds, batch_size=1, sampler=DistributedSampler(val_ds, shuffle=False), num_workers=4)
    test_dl = DataLoader(test_ds, batch_size=1, sampler=DistributedSampler(test_ds, shuffle=False), num_workers=4)

    model = ABMIL().to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    out_dir = os.path.join(args.out, f"fold{args.fold}")
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
    best = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        loss_sum = torch.zeros(2, device=device)
        for x, y, _, _ in train_dl:
            loss = F.cross_entropy(model(x[0].to(device, non_blocking=True)), y.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(loss_sum)
        val_auc, _ = evaluate(model.module, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch}: loss {(loss_sum[0] / loss_sum[1]).item():.4f} val AUC {val_auc:.4f}", flush=True)
            if val_auc > best:
                best = val_auc
                torch.save(model.module.state_dict(), os.path.join(out_dir, "best.pt"))
        dist.barrier()

    model.module.load_state_dict(torch.load(os.path.join(out_dir, "best.pt"), map_location=device))
    test_auc, preds = evaluate(model.module, test_dl, device)
    if rank == 0:
        print(f"fold {args.fold}: best val AUC {best:.4f}  test AUC {test_auc:.4f}")
        pd.DataFrame([(s, p, y) for s, (p, y) in preds.items()], columns=["slide_id", "prob", "til_high"]).to_csv(
            os.path.join(out_dir, "test_predictions.csv"), index=False)
        export_top_patches(model, H5Slides(test_df, args.feat_dir, with_coords=True), device, args.topk,
                           os.path.join(out_dir, "top_attention.json"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
