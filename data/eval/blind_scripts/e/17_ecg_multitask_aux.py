"""
PTB-XL 12-lead ECG, 5 diagnostic superclasses (multi-label).
1D ResNet encoder; for the first few epochs an auxiliary decoder reconstructs
the masked signal (denoising warm-up), afterwards only the classifier is trained.

    torchrun --nproc_per_node=4 17_ecg_multitask_aux.py --data data/ptbxl_100hz.npz
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

SUPERCLASSES = ["NORM", "MI", "STTC", "CD", "HYP"]


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/ptbxl_100hz.npz", help="npz with X (N,1000,12), y (N,5), fold (N,)")
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--aux_epochs", type=int, default=5, help="epochs with the reconstruction head")
    ap.add_argument("--aux_weight", type=float, default=0.5)
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", default="runs/ecg_resnet1d")
    return ap.parse_args()


class ECGDataset(Dataset):
    def __init__(self, X, y, train):
        self.X = torch.from_numpy(X.transpose(0, 2, 1).astype(np.float32))  # (N, 12, 1000)
        self.y = torch.from_numpy(y.astype(np.float32))
        self.train = train

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        x = self.X[i]
        if self.train:
            x = x * (1 + 0.1 * torch.randn(12, 1)) + 0.01 * torch.randn_like(x)
        return x, self.y[i]


class Block1d(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv1d(cin, cout, 7, stride, 3, bias=False)
        self.bn1 = nn.BatchNorm1d(cout)
        self.conv2 = nn.Conv1d(cout, cout, 7, 1, 3, bias=False)
        self.bn2 = nn.BatchNorm1d(cout)
        self.skip = nn.Sequential()
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(nn.Conv1d(cin, cout, 1, stride, bias=False), nn.BatchNorm1d(cout))

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(h)) + self.skip(x))


class ECGNet(nn.Module):
    def __init__(self, n_classes=5):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv1d(12, 64, 15, 2, 7, bias=False), nn.BatchNorm1d(64), nn.ReLU())
        self.encoder = nn.Sequential(Block1d(64, 64, 1), Block1d(64, 128, 2), Block1d(128, 128, 1),
                                     Block1d(128, 256, 2), Block1d(256, 256, 1))
        self.classifier = nn.Sequential(nn.Dropout(0.3), nn.Linear(512, n_classes))
        # auxiliary denoising decoder (only used during warm-up)
        self.decoder = nn.Sequential(
            nn.ConvTranspose1d(256, 128, 4, 2, 1), nn.ReLU(),
            nn.ConvTranspose1d(128, 64, 4, 2, 1), nn.ReLU(),
            nn.ConvTranspose1d(64, 12, 4, 2, 1))
        self.use_aux = True

    def forward(self, x):
        h = self.encoder(self.stem(x))
        pooled = torch.cat([h.mean(-1), h.amax(-1)], dim=1)
        logits = self.classifier(pooled)
        if self.training and self.use_aux:
            recon = self.decoder(h)[..., :x.shape[-1]]
            return logits, recon
        return logits, None


def mask_signal(x, p=0.15, span=50):
    B, C, T = x.shape
    n = int(p * T / span)
    starts = torch.randint(0, T - span, (B, n), device=x.device)
    mask = torch.zeros(B, 1, T, dtype=torch.bool, device=x.device)
    for k in range(n):
        idx = starts[:, k:k + 1] + torch.arange(span, device=x.device)
        mask.scatter_(2, idx.unsqueeze(1), True)
    return x.masked_fill(mask, 0.0), mask


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    d = np.load(args.data)
    X, y, fold = d["X"], d["y"], d["fold"]
    X = (X - X.mean(axis=(0, 1))) / (X.std(axis=(0, 1)) + 1e-6)
    tr, va = fold <= 8, fold == 9          # fold 10 kept for the final test
    train_ds, val_ds = ECGDataset(X[tr], y[tr], True), ECGDataset(X[va], y[va], False)

    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=256, shuffle=False, num_workers=4)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(ECGNet(len(SUPERCLASSES))).to(device)
    model = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr * world, weight_decay=1e-2)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_auc = 0.0
    for epoch in range(args.epochs):
        model.module.use_aux = epoch < args.aux_epochs
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        meter = torch.zeros(3, device=device)
        for x, target in tqdm(train_dl, disable=rank != 0, desc=f"ep {epoch}"):
            x, target = x.to(device, non_blocking=True), target.to(device, non_blocking=True)
            if model.module.use_aux:
                x_in, m = mask_signal(x)
                logits, recon = model(x_in)
                rec_loss = F.mse_loss(recon.masked_select(m.expand_as(x)), x.masked_select(m.expand_as(x)))
            else:
                logits, _ = model(x)
                rec_loss = torch.zeros((), device=device)
            cls_loss = F.binary_cross_entropy_with_logits(logits, target)
            loss = cls_loss + args.aux_weight * rec_loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            meter += torch.stack([cls_loss.detach(), rec_loss.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(meter)

        if rank == 0:
            model.eval()
            probs, labels = [], []
            with torch.no_grad():
                for x, target in val_dl:
                    logits, _ = model.module(x.to(device))
                    probs.append(torch.sigmoid(logits).cpu())
                    labels.append(target)
            auc = roc_auc_score(torch.cat(labels).numpy(), torch.cat(probs).numpy(), average="macro")
            print(f"epoch {epoch}: cls {(meter[0] / meter[2]).item():.4f} rec {(meter[1] / meter[2]).item():.4f} "
                  f"val macro-AUC {auc:.4f} ({time.time() - t0:.0f}s)")
            if auc > best_auc:
                best_auc = auc
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
