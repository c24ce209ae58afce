"""TransMIL for Camelyon16 with activation checkpointing (full-resolution bags up to ~120k
patches at 20x do not fit in 80GB otherwise), DDP over the 8 GPUs of one node.

    torchrun --nproc_per_node=8 17_transmil_ckpt_camelyon.py --cfg Camelyon/TransMIL.yaml --fold 0
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
import torch.utils.checkpoint
import yaml
from nystrom_attention import NystromAttention
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def read_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default="Camelyon/TransMIL.yaml")
    ap.add_argument("--fold", type=int, default=0)
    ap.add_argument("--use_checkpoint", type=int, default=1)
    a = ap.parse_args()
    with open(a.cfg) as f:
        cfg = yaml.safe_load(f)
    cfg["fold"] = a.fold
    cfg["use_checkpoint"] = bool(a.use_checkpoint)
    return cfg


class TransLayer(nn.Module):
    def __init__(self, norm_layer=nn.LayerNorm, dim=512):
        super().__init__()
        self.norm = norm_layer(dim)
        self.attn = NystromAttention(dim=dim, dim_head=dim // 8, heads=8, num_landmarks=dim // 2,
                                     pinv_iterations=6, residual=True, dropout=0.1)

    def forward(self, x):
        return x + self.attn(self.norm(x))


class PPEG(nn.Module):
    def __init__(self, dim=512):
        super().__init__()
        self.proj = nn.Conv2d(dim, dim, 7, 1, 7 // 2, groups=dim)
        self.proj1 = nn.Conv2d(dim, dim, 5, 1, 5 // 2, groups=dim)
        self.proj2 = nn.Conv2d(dim, dim, 3, 1, 3 // 2, groups=dim)

    def forward(self, x, H, W):
        B, _, C = x.shape
        cls_token, feat_token = x[:, 0], x[:, 1:]
        cnn_feat = feat_token.transpose(1, 2).view(B, C, H, W)
        x = self.proj(cnn_feat) + cnn_feat + self.proj1(cnn_feat) + self.proj2(cnn_feat)
        x = x.flatten(2).transpose(1, 2)
        return torch.cat((cls_token.unsqueeze(1), x), dim=1)


class TransMIL(nn.Module):
    def __init__(self, n_classes=2, in_dim=1024, use_checkpoint=False):
        super().__init__()
        self.pos_layer = PPEG(dim=512)
        self._fc1 = nn.Sequential(nn.Linear(in_dim, 512), nn.ReLU())
        self.cls_token = nn.Parameter(torch.randn(1, 1, 512))
        self.n_classes = n_classes
        self.layer1 = TransLayer(dim=512)
        self.layer2 = TransLayer(dim=512)
        self.norm = nn.LayerNorm(512)
        self._fc2 = nn.Linear(512, self.n_classes)
        self.use_checkpoint = use_checkpoint

    def forward(self, data):
        h = self._fc1(data.float())                            # [B, n, 512]
        H = h.shape[1]
        _H, _W = int(np.ceil(np.sqrt(H))), int(np.ceil(np.sqrt(H)))
        add_length = _H * _W - H
        h = torch.cat([h, h[:, :add_length, :]], dim=1)
        cls_tokens = self.cls_token.expand(h.shape[0], -1, -1).to(h.device)
        h = torch.cat((cls_tokens, h), dim=1)
        if self.use_checkpoint and self.training:
            h = torch.utils.checkpoint.checkpoint(self.layer1, h)
            h = self.pos_layer(h, _H, _W)
            h = torch.utils.checkpoint.checkpoint(self.layer2, h)
        else:
            h = self.layer1(h)
            h = self.pos_layer(h, _H, _W)
            h = self.layer2(h)
        h = self.norm(h)[:, 0]
        logits = self._fc2(h)
        return {"logits": logits, "Y_prob": F.softmax(logits, dim=1), "Y_hat": torch.argmax(logits, dim=1)}


class CamelData(Dataset):
    def __init__(self, cfg, state):
        split = pd.read_csv(os.path.join(cfg["label_dir"], f"fold{cfg['fold']}.csv"))
        self.slide_ids = split[state].dropna().tolist()
        self.labels = split[f"{state}_label"].dropna().astype(int).tolist()
        self.feature_dir = cfg["data_dir"]

    def __len__(self):
        return len(self.slide_ids)

    def __getitem__(self, idx):
        with h5py.File(os.path.join(self.feature_dir, f"{self.slide_ids[idx]}.h5"), "r") as f:
            features = torch.from_numpy(f["features"][:])
        return features, self.labels[idx], idx


@torch.no_grad()
def validate(net, loader, device, world):
    net.eval()
    preds = []
    for data, label, idx in loader:
        out = net(data.to(device, non_blocking=True))
        preds.append((int(idx), out["Y_prob"][0, 1].item(), int(label)))
    gathered = [None] * world
    dist.all_gather_object(gathered, preds)
    table = {i: (p, y) for part in gathered for i, p, y in part}
    probs = np.array([v[0] for v in table.values()])
    labels = np.array([v[1] for v in table.values()])
    return roc_auc_score(labels, probs), float(((probs > 0.5).astype(int) == labels).mean())


def main():
    cfg = read_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(cfg.get("seed", 2021))

    train_set, val_set, test_set = CamelData(cfg, "train"), CamelData(cfg, "val"), CamelData(cfg, "test")
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=1, sampler=train_sampler, num_workers=8, pin_memory=True)
    val_loader = DataLoader(val_set, batch_size=1, sampler=DistributedSampler(val_set, shuffle=False), num_workers=4)
    test_loader = DataLoader(test_set, batch_size=1, sampler=DistributedSampler(test_set, shuffle=False), num_workers=4)

    net = TransMIL(n_classes=cfg.get("n_classes", 2), in_dim=cfg.get("in_dim", 1024),
                   use_checkpoint=cfg["use_checkpoint"]).to(device)
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.get("lr", 2e-4), weight_decay=cfg.get("weight_decay", 1e-5))
    criterion = nn.CrossEntropyLoss()

    log_dir = os.path.join(cfg.get("log_path", "logs/Camelyon/TransMIL"), f"fold{cfg['fold']}")
    if rank == 0:
        os.makedirs(log_dir, exist_ok=True)
    best_auc, epochs = 0.0, cfg.get("epochs", 200)
    for epoch in range(epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        meter = torch.zeros(2, device=device)
        for data, label, _ in train_loader:
            out = model(data.to(device, non_blocking=True))
            loss = criterion(out["logits"], label.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            meter += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(meter)
        val_auc, val_acc = validate(net, val_loader, device, world)
        if rank == 0:
            print(f"Epoch {epoch}: train_loss={(meter[0] / meter[1]).item():.4f} val_auc={val_auc:.4f} "
                  f"val_acc={val_acc:.4f} time={time.time() - t0:.0f}s", flush=True)
            if val_auc > best_auc:
                best_auc = val_auc
                torch.save(net.state_dict(), os.path.join(log_dir, "best.ckpt"))
        dist.barrier()

    net.load_state_dict(torch.load(os.path.join(log_dir, "best.ckpt"), map_location=device))
    test_auc, test_acc = validate(net, test_loader, device, world)
    if rank == 0:
        print(f"fold {cfg['fold']}: test auc {test_auc:.4f} acc {test_acc:.4f}")
        pd.DataFrame([{"fold": cfg["fold"], "val_auc": best_auc, "test_auc": test_auc, "test_acc": test_acc}]).to_csv(
            os.path.join(log_dir, "result.csv"), index=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
