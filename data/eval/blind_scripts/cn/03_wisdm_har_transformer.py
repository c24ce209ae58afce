"""Human activity recognition on WISDM (phone + watch accelerometer/gyroscope)
with a small transformer encoder over patches of the raw signal.

Each subject's raw data is a CSV (subject_id, activity, timestamp, ax, ay, az, gx, gy, gz)
resampled to 20 Hz. Windows of 10 s (200 samples) with 50 % overlap.
Subject-wise 5-fold CV; --fold picks the test subjects.

Run:
    torchrun --nproc_per_node=4 03_wisdm_har_transformer.py --config configs/wisdm_tf.yaml --fold 2
"""
import argparse
import math
import os
from dataclasses import dataclass, field, asdict

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from sklearn.metrics import f1_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

ACTIVITIES = list("ABCDEFGHIJKLMOPQRS")  # WISDM activity codes (N is not used)


@dataclass
class Config:
    data_dir: str = "/data/wisdm/resampled"
    out_dir: str = "runs/wisdm"
    fold: int = 0
    n_folds: int = 5
    window: int = 200
    hop: int = 100
    channels: tuple = ("ax", "ay", "az", "gx", "gy", "gz")
    patch: int = 10
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 4
    dropout: float = 0.1
    pool: str = "mean"  # "mean" or "cls"
    batch_size: int = 256
    epochs: int = 80
    lr: float = 5e-4
    weight_decay: float = 0.05
    warmup_steps: int = 500
    patience: int = 10
    num_workers: int = 4
    seed: int = 1234
    extra: dict = field(default_factory=dict)


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--fold", type=int, default=None)
    a = ap.parse_args()
    cfg = Config()
    if a.config:
        with open(a.config) as f:
            for k, v in yaml.safe_load(f).items():
                setattr(cfg, k, tuple(v) if isinstance(getattr(cfg, k, None), tuple) else v)
    if a.fold is not None:
        cfg.fold = a.fold
    return cfg


def make_windows(df, cfg):
    xs, ys = [], []
    sig = df[list(cfg.channels)].to_numpy(np.float32)
    act = df["activity"].to_numpy()
    # windows never straddle two activity bouts
    bounds = np.flatnonzero(act[1:] != act[:-1]) + 1
    for seg_sig, seg_act in zip(np.split(sig, bounds), np.split(act, bounds)):
        for s in range(0, len(seg_sig) - cfg.window + 1, cfg.hop):
            xs.append(seg_sig[s:s + cfg.window].T)
            ys.append(ACTIVITIES.index(seg_act[0]))
    return xs, ys


def build_datasets(cfg):
    subjects = sorted(int(f.split("_")[1].split(".")[0]) for f in os.listdir(cfg.data_dir) if f.endswith(".csv"))
    subjects = np.array(subjects)
    rng = np.random.RandomState(cfg.seed)
    folds = np.array_split(rng.permutation(subjects), cfg.n_folds)
    test_subj = set(folds[cfg.fold].tolist())
    val_subj = set(folds[(cfg.fold + 1) % cfg.n_folds].tolist())
    split = {"train": ([], []), "val": ([], []), "test": ([], [])}
    for s in subjects:
        df = pd.read_csv(os.path.join(cfg.data_dir, f"subject_{s}.csv"))
        xs, ys = make_windows(df, cfg)
        key = "test" if s in test_subj else "val" if s in val_subj else "train"
        split[key][0].extend(xs)
        split[key][1].extend(ys)
    x_train = np.stack(split["train"][0])
    mean = x_train.mean(axis=(0, 2), keepdims=True)
    std = x_train.std(axis=(0, 2), keepdims=True) + 1e-6
    out = {}
    for k, (xs, ys) in split.items():
        x = (np.stack(xs) - mean) / std
        out[k] = TensorDataset(torch.from_numpy(x.astype(np.float32)), torch.tensor(ys, dtype=torch.long))
    return out


class PatchTransformer(nn.Module):
    def __init__(self, cfg, n_in, n_classes):
        super().__init__()
        self.pool = cfg.pool
        n_patches = cfg.window // cfg.patch
        self.patch_embed = nn.Conv1d(n_in, cfg.d_model, kernel_size=cfg.patch, stride=cfg.patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.d_model))
        self.pos_embed = nn.Parameter(torch.zeros(1, n_patches + 1, cfg.d_model))
        layer = nn.TransformerEncoderLayer(
            cfg.d_model, cfg.n_heads, dim_feedforward=4 * cfg.d_model, dropout=cfg.dropout,
            activation="gelu", batch_first=True, norm_first=True,
        )
        self.encoder = nn.TransformerEncoder(layer, cfg.n_layers)
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, n_classes)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)

    def forward(self, x):
        h = self.patch_embed(x).transpose(1, 2)  # [B, P, D]
        if self.pool == "cls":
            h = torch.cat([self.cls_token.expand(h.size(0), -1, -1), h], dim=1)
            h = h + self.pos_embed
        else:
            h = h + self.pos_embed[:, 1:]
        h = self.norm(self.encoder(h))
        h = h[:, 0] if self.pool == "cls" else h.mean(dim=1)
        return self.head(h)


@torch.no_grad()
def evaluate(model, loader, n_total, device):
    model.eval()
    probs, labels = [], []
    for x, y in loader:
        probs.append(model(x.to(device, non_blocking=True)).float().softmax(-1))
        labels.append(y.to(device, non_blocking=True))
    probs, labels = torch.cat(probs), torch.cat(labels)
    world = dist.get_world_size()
    gp = [torch.empty_like(probs) for _ in range(world)]
    gl = [torch.empty_like(labels) for _ in range(world)]
    dist.all_gather(gp, probs)
    dist.all_gather(gl, labels)
    # undo DistributedSampler(shuffle=False) interleaving and drop its padding
    probs = torch.stack(gp, 1).flatten(0, 1)[:n_total].cpu().numpy()
    labels = torch.stack(gl, 1).flatten(0, 1)[:n_total].cpu().numpy()
    preds = probs.argmax(1)
    present = np.unique(labels)
    auroc = roc_auc_score(labels, probs[:, present] / probs[:, present].sum(1, keepdims=True),
                          multi_class="ovr", average="macro", labels=present)
    return {
        "acc": float((preds == labels).mean()),
        "macro_f1": float(f1_score(labels, preds, average="macro")),
        "auroc": float(auroc),
    }


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)

    run_dir = os.path.join(cfg.out_dir, f"fold{cfg.fold}")
    writer = None
    if rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        writer = SummaryWriter(run_dir)
        with open(os.path.join(run_dir, "config.yaml"), "w") as f:
            yaml.safe_dump({k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()}, f)

    data = build_datasets(cfg)
    samplers = {
        "train": DistributedSampler(data["train"], shuffle=True, seed=cfg.seed, drop_last=True),
        "val": DistributedSampler(data["val"], shuffle=False),
        "test": DistributedSampler(data["test"], shuffle=False),
    }
    loaders = {
        k: DataLoader(ds, batch_size=cfg.batch_size, sampler=samplers[k], num_workers=cfg.num_workers,
                      pin_memory=True, drop_last=(k == "train"))
        for k, ds in data.items()
    }

    model = PatchTransformer(cfg, n_in=len(cfg.channels), n_classes=len(ACTIVITIES)).to(device)
    model = DDP(model, device_ids=[local_rank])

    decay = [p for n, p in model.named_parameters() if p.ndim > 1 and "embed" not in n and "token" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim > 1 and "embed" not in n and "token" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr
    )
    total_steps = cfg.epochs * len(loaders["train"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / cfg.warmup_steps) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total_steps))),
    )
    counts = np.bincount(data["train"].tensors[1].numpy(), minlength=len(ACTIVITIES))
    class_w = torch.tensor(counts.sum() / np.maximum(counts, 1) / len(ACTIVITIES), dtype=torch.float32, device=device)
    criterion = nn.CrossEntropyLoss(weight=class_w, label_smoothing=0.05)

    best_f1, bad, step = -1.0, 0, 0
    for epoch in range(cfg.epochs):
        samplers["train"].set_epoch(epoch)
        model.train()
        for x, y in loaders["train"]:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if rank == 0 and step % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/lr", scheduler.get_last_lr()[0], step)

        val = evaluate(model, loaders["val"], len(data["val"]), device)
        # every rank holds the same gathered metrics, so every rank takes the same decision
        if val["macro_f1"] > best_f1:
            best_f1, bad = val["macro_f1"], 0
            if rank == 0:
                torch.save(model.module.state_dict(), os.path.join(run_dir, "best.pt"))
        else:
            bad += 1
        if rank == 0:
            for k, v in val.items():
                writer.add_scalar(f"val/{k}", v, epoch)
            print(f"epoch {epoch} val {val} best_f1 {best_f1:.4f}", flush=True)
        if bad >= cfg.patience:
            break

    dist.barrier()
    model.module.load_state_dict(torch.load(os.path.join(run_dir, "best.pt"), map_location=device))
    test = evaluate(model, loaders["test"], len(data["test"]), device)
    if rank == 0:
        print(f"fold {cfg.fold} test {test}")
        writer.add_hparams({"fold": cfg.fold, "pool": cfg.pool}, {f"test/{k}": v for k, v in test.items()})
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
