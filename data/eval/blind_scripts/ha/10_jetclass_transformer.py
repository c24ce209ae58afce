"""Plain particle transformer (no pair features) on JetClass, 10-class tagging.

Data: JetClass converted to h5 shards (part_features [N, 128, 17], part_mask [N, 128],
label [N]) by scripts/jetclass_to_h5.py.

    torchrun --nproc_per_node=8 10_jetclass_transformer.py --train-glob "/data/jetclass/h5/train_*.h5" \
        --val-glob "/data/jetclass/h5/val_*.h5" --test-glob "/data/jetclass/h5/test_*.h5"
"""
import argparse
import bisect
import glob
import json
import os

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

CLASSES = ["QCD", "Hbb", "Hcc", "Hgg", "H4q", "Hqql", "Zqq", "Wqq", "Tbqq", "Tbl"]


class H5Shards(Dataset):
    def __init__(self, pattern):
        self.files = sorted(glob.glob(pattern))
        self.offsets = [0]
        for fn in self.files:
            with h5py.File(fn, "r") as f:
                self.offsets.append(self.offsets[-1] + f["label"].shape[0])
        self.handles = {}

    def __len__(self):
        return self.offsets[-1]

    def __getitem__(self, i):
        k = bisect.bisect_right(self.offsets, i) - 1
        if k not in self.handles:
            self.handles[k] = h5py.File(self.files[k], "r")
        f, j = self.handles[k], i - self.offsets[k]
        return (torch.from_numpy(f["part_features"][j].astype(np.float32)),
                torch.from_numpy(f["part_mask"][j].astype(bool)),
                int(f["label"][j]))


class JetTransformer(nn.Module):
    def __init__(self, in_dim=17, d_model=128, n_heads=8, n_layers=8, n_classes=10, dropout=0.1):
        super().__init__()
        self.embed = nn.Sequential(nn.LayerNorm(in_dim), nn.Linear(in_dim, d_model), nn.GELU(),
                                   nn.Linear(d_model, d_model))
        layer = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layers)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d_model))
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, n_classes)

    def forward(self, x, mask):
        h = self.embed(x)
        cls = self.cls_token.expand(h.size(0), -1, -1)
        h = torch.cat([cls, h], dim=1)
        pad = torch.cat([torch.zeros_like(mask[:, :1]), ~mask], dim=1)
        h = self.encoder(h, src_key_padding_mask=pad)
        return self.head(self.norm(h[:, 0]))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    probs, labels, loss_sum = [], [], 0.0
    for x, m, y in loader:
        x, m, y = x.to(device, non_blocking=True), m.to(device, non_blocking=True), y.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x, m)
        loss_sum += F.cross_entropy(logits.float(), y, reduction="sum").item()
        probs.append(logits.float().softmax(-1).cpu().numpy())
        labels.append(y.cpu().numpy())
    probs, labels = np.concatenate(probs), np.concatenate(labels)
    res = {"loss": loss_sum / len(labels), "acc": float((probs.argmax(1) == labels).mean())}
    # signal-vs-QCD AUC for each signal class, as in the ParT paper
    for c in range(1, len(CLASSES)):
        sel = (labels == 0) | (labels == c)
        score = probs[sel, c] / (probs[sel, c] + probs[sel, 0] + 1e-12)
        res[f"auc_{CLASSES[c]}"] = roc_auc_score(labels[sel] == c, score)
    return res


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-glob", required=True)
    p.add_argument("--val-glob", required=True)
    p.add_argument("--test-glob", required=True)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--out", default="runs/jetclass_tf")
    return p.parse_args()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    train_ds, val_ds, test_ds = H5Shards(args.train_glob), H5Shards(args.val_glob), H5Shards(args.test_glob)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    loader_kw = dict(batch_size=args.batch_size, num_workers=args.workers, pin_memory=True,
                     persistent_workers=True)
    train_dl = DataLoader(train_ds, sampler=train_sampler, drop_last=True, **loader_kw)
    val_dl = DataLoader(val_ds, sampler=DistributedSampler(val_ds, shuffle=False), **loader_kw)
    test_dl = DataLoader(test_ds, sampler=DistributedSampler(test_ds, shuffle=False), **loader_kw)

    model = JetTransformer().to(device)
    model = DDP(model, device_ids=[local_rank])
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "cls_token" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "cls_token" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.98))
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total, pct_start=0.05)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for step, (x, m, y) in enumerate(train_dl):
            x, m, y = x.to(device, non_blocking=True), m.to(device, non_blocking=True), y.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x, m), y, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if rank == 0 and step % 1000 == 0:
                print(f"epoch {epoch} step {step}/{len(train_dl)} loss {loss.item():.4f}", flush=True)

        val = evaluate(model.module, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch} val " + json.dumps({k: round(v, 5) for k, v in val.items()}), flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(args.out, "last.pt"))
            if val["acc"] > best_acc:
                best_acc = val["acc"]
                torch.save({"model": model.module.state_dict(), "epoch": epoch},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    ckpt = torch.load(os.path.join(args.out, "best.pt"), map_location=device)
    model.module.load_state_dict(ckpt["model"])
    test = evaluate(model.module, test_dl, device)
    if rank == 0:
        print("TEST " + json.dumps(test, indent=1))
        with open(os.path.join(args.out, "test_metrics.json"), "w") as f:
            json.dump({"best_epoch": ckpt["epoch"], **test}, f, indent=1)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
