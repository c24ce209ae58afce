"""FiBiNET (SENET field re-weighting + bilinear interaction) for news-feed CTR.

    torchrun --standalone --nproc_per_node=8 19_fibinet_eval.py --config configs/fibinet.yaml
"""
import argparse
import json
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from sklearn.metrics import log_loss, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DEFAULT_CFG = {
    "data": {"train": "/shared/newsfeed/ctr/train.parquet", "valid": "/shared/newsfeed/ctr/valid.parquet",
             "vocab": "/shared/newsfeed/ctr/vocab_sizes.json"},
    "model": {"dim": 10, "reduction": 3, "hidden": [400, 400, 400], "dropout": 0.1},
    "train": {"batch_size": 1024, "lr": 1e-3, "epochs": 5, "eval_every": 2000, "seed": 2023},
    "out_dir": "/shared/newsfeed/runs/fibinet",
}


def load_config():
    p = argparse.ArgumentParser()
    p.add_argument("--config")
    a = p.parse_args()
    cfg = json.loads(json.dumps(DEFAULT_CFG))
    if a.config:
        with open(a.config) as f:
            user = yaml.safe_load(f) or {}
        for k, v in user.items():
            if isinstance(v, dict):
                cfg[k].update(v)
            else:
                cfg[k] = v
    return cfg


class FeedCTR(Dataset):
    def __init__(self, path, fields):
        df = pd.read_parquet(path, columns=fields + ["label"])
        self.x = df[fields].to_numpy(np.int64)
        self.y = df["label"].to_numpy(np.float32)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class SENet(nn.Module):
    def __init__(self, n_fields, reduction):
        super().__init__()
        r = max(1, n_fields // reduction)
        self.fc = nn.Sequential(nn.Linear(n_fields, r), nn.ReLU(), nn.Linear(r, n_fields), nn.ReLU())

    def forward(self, e):                       # B, F, D
        w = self.fc(e.mean(-1))
        return e * w.unsqueeze(-1)


class Bilinear(nn.Module):
    """'field-all' bilinear type: one shared W."""

    def __init__(self, n_fields, dim):
        super().__init__()
        self.W = nn.Linear(dim, dim, bias=False)
        i, j = torch.triu_indices(n_fields, n_fields, offset=1)
        self.register_buffer("i", i, persistent=False)
        self.register_buffer("j", j, persistent=False)

    def forward(self, e):
        return (self.W(e[:, self.i]) * e[:, self.j]).flatten(1)


class FiBiNET(nn.Module):
    def __init__(self, vocab_sizes, dim, reduction, hidden, dropout):
        super().__init__()
        n = len(vocab_sizes)
        self.embs = nn.ModuleList(nn.Embedding(v, dim) for v in vocab_sizes)
        self.lin = nn.ModuleList(nn.Embedding(v, 1) for v in vocab_sizes)
        self.senet = SENet(n, reduction)
        self.bi_p = Bilinear(n, dim)
        self.bi_q = Bilinear(n, dim)
        d = 2 * (n * (n - 1) // 2) * dim
        layers = []
        for h in hidden:
            layers += [nn.Linear(d, h), nn.ReLU(), nn.Dropout(dropout)]
            d = h
        layers.append(nn.Linear(d, 1))
        self.dnn = nn.Sequential(*layers)

    def forward(self, x):
        e = torch.stack([emb(x[:, k]) for k, emb in enumerate(self.embs)], 1)
        lin = sum(l(x[:, k]) for k, l in enumerate(self.lin)).squeeze(-1)
        p = self.bi_p(e)
        q = self.bi_q(self.senet(e))
        return lin + self.dnn(torch.cat([p, q], 1)).squeeze(-1)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    preds, labels = [], []
    for x, y in loader:
        preds.append(torch.sigmoid(model(x.to(device, non_blocking=True))).cpu())
        labels.append(y)
    model.train()
    p = torch.cat(preds).double().numpy()
    y = torch.cat(labels).numpy()
    return roc_auc_score(y, p), log_loss(y, np.clip(p, 1e-7, 1 - 1e-7))


def main():
    cfg = load_config()
    tcfg, mcfg = cfg["train"], cfg["model"]
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(tcfg["seed"])

    with open(cfg["data"]["vocab"]) as f:
        vocab = json.load(f)
    fields = list(vocab.keys())
    train = FeedCTR(cfg["data"]["train"], fields)
    valid = FeedCTR(cfg["data"]["valid"], fields)
    sampler = DistributedSampler(train, shuffle=True, seed=tcfg["seed"])
    train_dl = DataLoader(train, batch_size=tcfg["batch_size"], sampler=sampler, num_workers=4,
                          pin_memory=True, drop_last=True)
    valid_dl = DataLoader(valid, batch_size=8192, sampler=DistributedSampler(valid, shuffle=False),
                          num_workers=4, pin_memory=True)

    model = FiBiNET([vocab[f] for f in fields], mcfg["dim"], mcfg["reduction"], mcfg["hidden"], mcfg["dropout"])
    model = DDP(model.to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=tcfg["lr"])

    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)
        with open(os.path.join(cfg["out_dir"], "config.yaml"), "w") as f:
            yaml.safe_dump(cfg, f)

    step, best_auc, history = 0, 0.0, []
    for epoch in range(tcfg["epochs"]):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if rank == 0 and step % 200 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.5f} {time.time() - t0:.0f}s", flush=True)

            if step % tcfg["eval_every"] == 0:
                auc, ll = evaluate(model, valid_dl, device)
                if rank == 0:
                    history.append({"step": step, "auc": auc, "logloss": ll})
                    print(f"[valid] step {step} auc {auc:.5f} logloss {ll:.5f}", flush=True)
                    if auc > best_auc:
                        best_auc = auc
                        torch.save({"model": model.module.state_dict(), "step": step, "auc": auc},
                                   os.path.join(cfg["out_dir"], "best.pt"))
                dist.barrier()

    if rank == 0:
        with open(os.path.join(cfg["out_dir"], "history.json"), "w") as f:
            json.dump({"best_auc": best_auc, "history": history}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
