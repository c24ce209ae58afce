"""Retail PD model (12-month default) for the IFRS9 staging pipeline.

Trains an embedding MLP on application + bureau features with torchrun, keeps the best
epoch by validation Gini, and exports a CPU TorchScript bundle for the scoring service.

    torchrun --nproc_per_node=4 14_pd_model_torchscript_export.py --config conf/pd_retail.json
"""
import argparse
import json
import os
import shutil

import joblib
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

DEFAULT_CFG = {
    "data": "data/pd/applications.parquet",
    "target": "default_12m",
    "categorical": ["product", "channel", "housing", "employment_type", "region", "bureau_band"],
    "numerical": ["age", "income", "loan_amount", "term_months", "dti", "bureau_score", "n_enquiries_6m",
                  "months_at_address", "months_employed", "existing_debt"],
    "oot_start": "2023-01-01",
    "batch_size": 1024,
    "lr": 5e-4,
    "epochs": 20,
    "hidden": [256, 128],
    "out_dir": "artifacts/pd_retail",
}


class PDNet(nn.Module):
    def __init__(self, cards, n_num, hidden):
        super().__init__()
        self.embeddings = nn.ModuleList([nn.Embedding(c + 1, min(16, c // 2 + 2)) for c in cards])
        d = sum(e.embedding_dim for e in self.embeddings) + n_num
        layers = []
        for h in hidden:
            layers += [nn.Linear(d, h), nn.SiLU(), nn.Dropout(0.2)]
            d = h
        self.body = nn.Sequential(*layers)
        self.logit = nn.Linear(d, 1)

    def forward(self, x_cat, x_num):
        z = torch.cat([emb(x_cat[:, i]) for i, emb in enumerate(self.embeddings)] + [x_num], dim=1)
        return self.logit(self.body(z)).squeeze(-1)


def prepare(cfg):
    df = pd.read_parquet(cfg["data"])
    df["application_date"] = pd.to_datetime(df["application_date"])
    dev = df[df["application_date"] < cfg["oot_start"]]
    oot = df[df["application_date"] >= cfg["oot_start"]]
    enc = {c: {v: i + 1 for i, v in enumerate(sorted(dev[c].dropna().astype(str).unique()))} for c in cfg["categorical"]}
    lo, hi = dev[cfg["numerical"]].quantile(0.01), dev[cfg["numerical"]].quantile(0.99)
    clipped = dev[cfg["numerical"]].clip(lo, hi, axis=1)
    mean, std = clipped.mean(), clipped.std() + 1e-6

    def tensors(frame):
        xc = np.stack([frame[c].astype(str).map(enc[c]).fillna(0).astype(np.int64).values for c in cfg["categorical"]], 1)
        xn = ((frame[cfg["numerical"]].clip(lo, hi, axis=1) - mean) / std).fillna(0).values.astype(np.float32)
        y = frame[cfg["target"]].values.astype(np.float32)
        return TensorDataset(torch.arange(len(frame)), torch.from_numpy(xc), torch.from_numpy(xn), torch.from_numpy(y))

    prep = {"encoders": enc, "clip_lo": lo, "clip_hi": hi, "mean": mean, "std": std}
    return tensors(dev), tensors(oot), prep, [len(enc[c]) for c in cfg["categorical"]]


@torch.no_grad()
def gini(model, loader, device, world):
    model.eval()
    chunk = []
    for idx, xc, xn, y in loader:
        p = torch.sigmoid(model(xc.to(device), xn.to(device))).cpu().numpy()
        chunk.append(np.column_stack([idx.numpy(), p, y.numpy()]))
    everything = [None] * world
    dist.all_gather_object(everything, np.concatenate(chunk))
    arr = np.concatenate(everything)
    _, first = np.unique(arr[:, 0], return_index=True)
    arr = arr[first]
    return 2 * roc_auc_score(arr[:, 2], arr[:, 1]) - 1


def export_scoring_bundle(weights_path, cards, n_num, cfg, prep):
    cpu_model = PDNet(cards, n_num, cfg["hidden"])
    cpu_model.load_state_dict(torch.load(weights_path, map_location="cpu"))
    cpu_model.eval()
    example = (torch.zeros(1, len(cards), dtype=torch.long), torch.zeros(1, n_num))
    traced = torch.jit.trace(cpu_model, example)
    bundle_dir = os.path.join(cfg["out_dir"], "bundle")
    os.makedirs(bundle_dir, exist_ok=True)
    traced.save(os.path.join(bundle_dir, "pd_model.ts"))
    joblib.dump(prep, os.path.join(bundle_dir, "preprocessing.joblib"))
    with open(os.path.join(bundle_dir, "features.json"), "w") as f:
        json.dump({"categorical": cfg["categorical"], "numerical": cfg["numerical"]}, f, indent=2)
    shutil.copy(weights_path, os.path.join(bundle_dir, "weights.pt"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    cli = ap.parse_args()
    cfg = dict(DEFAULT_CFG)
    if cli.config:
        with open(cli.config) as f:
            cfg.update(json.load(f))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(20240101)

    dev_ds, oot_ds, prep, cards = prepare(cfg)
    n_num = len(cfg["numerical"])
    per_gpu = cfg["batch_size"] // world
    sampler = DistributedSampler(dev_ds, shuffle=True, drop_last=True)
    loader = DataLoader(dev_ds, batch_size=per_gpu, sampler=sampler, num_workers=4, pin_memory=True)
    oot_loader = DataLoader(oot_ds, batch_size=8192, sampler=DistributedSampler(oot_ds, shuffle=False))

    model = DDP(PDNet(cards, n_num, cfg["hidden"]).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg["epochs"])
    weights_path = os.path.join(cfg["out_dir"], "pd_best_weights.pt")
    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)

    best = -1.0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        for _, xc, xn, y in loader:
            xc, xn, y = xc.to(device, non_blocking=True), xn.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(xc, xn), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sched.step()

        g = gini(model, oot_loader, device, world)
        if rank == 0:
            print(f"epoch {epoch:02d}  OOT gini {g:.4f}", flush=True)
            if g > best:
                best = g
                torch.save(model.state_dict(), weights_path)
        dist.barrier()

    if rank == 0:
        export_scoring_bundle(weights_path, cards, n_num, cfg, prep)
        print(f"best OOT gini {best:.4f}; bundle written to {cfg['out_dir']}/bundle")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
