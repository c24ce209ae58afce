"""12-lead ECG rhythm classification (PTB-XL superclasses) with a 1-D ResNet, DDP.

Macro-F1 on the validation fold picks the checkpoint; the chosen checkpoint is
then scored on the test fold.

    torchrun --nproc_per_node=4 15_ecg_resnet1d_f1.py --data /data/ptbxl_npz --out runs/ecg_r1d
"""
import argparse
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

CLASSES = ["NORM", "MI", "STTC", "CD", "HYP"]
logger = logging.getLogger("ecg")


def load_fold(path):
    d = np.load(path)
    x = torch.from_numpy(d["signals"].astype(np.float32))  # (N, 12, 1000) at 100 Hz
    x = (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + 1e-6)
    y = torch.from_numpy(d["labels"].astype(np.int64))
    return TensorDataset(x, y)


class ResBlock1d(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv1d(cin, cout, 7, stride, 3, bias=False)
        self.bn1 = nn.BatchNorm1d(cout)
        self.conv2 = nn.Conv1d(cout, cout, 7, 1, 3, bias=False)
        self.bn2 = nn.BatchNorm1d(cout)
        self.skip = nn.Sequential() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv1d(cin, cout, 1, stride, bias=False), nn.BatchNorm1d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.skip(x))


class ResNet1d(nn.Module):
    def __init__(self, n_classes, widths=(64, 128, 192, 256)):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv1d(12, widths[0], 15, 2, 7, bias=False), nn.BatchNorm1d(widths[0]),
                                  nn.ReLU())
        blocks, cin = [], widths[0]
        for w in widths:
            blocks += [ResBlock1d(cin, w, 2), ResBlock1d(w, w, 1)]
            cin = w
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, n_classes)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean(-1))


@torch.no_grad()
def predict(model, loader, device):
    model.eval()
    preds, targets = [], []
    for x, y in loader:
        preds.append(model(x.to(device, non_blocking=True)).argmax(1).cpu())
        targets.append(y)
    model.train()
    return torch.cat(preds).numpy(), torch.cat(targets).numpy()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="folder with train.npz, val.npz, test.npz")
    p.add_argument("--out", default="runs/ecg_r1d")
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")

    train_ds = load_fold(os.path.join(args.data, "train.npz"))
    val_ds = load_fold(os.path.join(args.data, "val.npz"))
    test_ds = load_fold(os.path.join(args.data, "test.npz"))

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=3)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, drop_last=True,
                              num_workers=2, pin_memory=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=256)
    test_loader = DataLoader(Subset(test_ds, range(rank, len(test_ds), world)), batch_size=256)

    model = ResNet1d(len(CLASSES))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    class_counts = torch.bincount(train_ds.tensors[1], minlength=len(CLASSES)).float()
    weights = (class_counts.sum() / (len(CLASSES) * class_counts)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-3)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, epochs=args.epochs,
                                                    steps_per_epoch=len(train_loader), pct_start=0.2)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_path = os.path.join(args.out, "best_macro_f1.pt")
    best_f1, best_epoch = -1.0, -1

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y, weight=weights)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()

        preds, targets = predict(model.module, val_loader, device)
        val_f1 = f1_score(targets, preds, average="macro")
        if rank == 0:
            logger.info("epoch %02d loss %.4f val macro-F1 %.4f (%.0fs)", epoch, loss.item(), val_f1,
                        time.time() - t0)
            if val_f1 > best_f1:
                best_f1, best_epoch = val_f1, epoch
                torch.save({"epoch": epoch, "model": model.module.state_dict(), "val_f1": val_f1}, best_path)
                logger.info("  -> new best")

    dist.barrier()
    ckpt = torch.load(best_path, map_location=device)
    model.module.load_state_dict(ckpt["model"])
    preds, targets = predict(model.module, test_loader, device)
    shards = [None] * world
    dist.all_gather_object(shards, (preds, targets))
    if rank == 0:
        all_p = np.concatenate([s[0] for s in shards])
        all_t = np.concatenate([s[1] for s in shards])
        per_class = f1_score(all_t, all_p, average=None, labels=list(range(len(CLASSES))))
        logger.info("best epoch %d (val F1 %.4f): test macro-F1 %.4f", ckpt["epoch"], ckpt["val_f1"],
                    per_class.mean())
        for name, v in zip(CLASSES, per_class):
            logger.info("  %-5s F1 %.4f", name, v)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
