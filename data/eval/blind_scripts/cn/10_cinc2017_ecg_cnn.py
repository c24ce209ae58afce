"""PhysioNet/CinC Challenge 2017: single-lead ECG (AliveCor, 300 Hz) -> Normal / AF / Other / Noisy.

Records vary from 9 to 60 s. Training draws random 20 s crops (zero padding when shorter);
evaluation slides 20 s windows with 50 % overlap over the whole record and averages the
window probabilities, so metrics are per record.

Stratified 5-fold CV over records (one record per patient in this release); --fold picks the
test fold, 10 % of the remaining records are used for early stopping.

    torchrun --nproc_per_node=4 10_cinc2017_ecg_cnn.py --data /data/cinc2017/training2017 --fold 1
"""
import argparse
import os

import numpy as np
import pandas as pd
import scipy.io
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from sklearn.metrics import f1_score, roc_auc_score
from sklearn.model_selection import StratifiedKFold, train_test_split
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

LABELS = {"N": 0, "A": 1, "O": 2, "~": 3}
FS = 300


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/cinc2017/training2017")
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--crop_s", type=float, default=20.0)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--patience", type=int, default=10)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--ckpt_dir", default="ckpts/cinc2017")
    p.add_argument("--wandb_project", default="ecg-cinc2017")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def read_record(data_dir, rec):
    x = scipy.io.loadmat(os.path.join(data_dir, rec + ".mat"))["val"][0].astype(np.float32)
    return (x - x.mean()) / (x.std() + 1e-6)


class CinCTrain(Dataset):
    def __init__(self, signals, labels, crop):
        self.signals, self.labels, self.crop = signals, labels, crop

    def __len__(self):
        return len(self.signals)

    def __getitem__(self, i):
        x = self.signals[i]
        if len(x) >= self.crop:
            s = np.random.randint(0, len(x) - self.crop + 1)
            x = x[s:s + self.crop]
        else:
            x = np.pad(x, (0, self.crop - len(x)))
        if np.random.rand() < 0.5:
            x = -x  # lead polarity flips are common with the handheld device
        return torch.from_numpy(np.ascontiguousarray(x))[None], self.labels[i]


class CinCRecords(Dataset):
    """Returns every 50 %-overlap window of one record; used with batch_size=1 per record."""

    def __init__(self, signals, labels, crop):
        self.signals, self.labels, self.crop = signals, labels, crop

    def __len__(self):
        return len(self.signals)

    def __getitem__(self, i):
        x = self.signals[i]
        if len(x) < self.crop:
            x = np.pad(x, (0, self.crop - len(x)))
        hop = self.crop // 2
        starts = list(range(0, len(x) - self.crop + 1, hop))
        wins = np.stack([x[s:s + self.crop] for s in starts])[:, None]
        return torch.from_numpy(wins), self.labels[i]


def conv_bn(cin, cout, k, s):
    return nn.Sequential(nn.Conv1d(cin, cout, k, s, k // 2, bias=False), nn.BatchNorm1d(cout), nn.ReLU(inplace=True))


class ECGNet(nn.Module):
    def __init__(self, n_classes=4):
        super().__init__()
        self.body = nn.Sequential(
            conv_bn(1, 32, 15, 2), conv_bn(32, 32, 9, 2),
            conv_bn(32, 64, 9, 2), conv_bn(64, 64, 9, 2),
            conv_bn(64, 128, 7, 2), conv_bn(128, 128, 7, 2),
            conv_bn(128, 256, 5, 2), conv_bn(256, 256, 5, 2),
        )
        self.rnn = nn.GRU(256, 128, batch_first=True, bidirectional=True)
        self.fc = nn.Linear(256, n_classes)

    def forward(self, x):
        h = self.body(x).transpose(1, 2)
        h, _ = self.rnn(h)
        return self.fc(h.mean(1))


@torch.no_grad()
def eval_records(model, ds, device):
    """Rank-strided record split; per-record probabilities are all-gathered as objects."""
    model.eval()
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = list(range(rank, len(ds), world))
    out = {}
    for i in mine:
        wins, _ = ds[i]
        out[i] = F.softmax(model(wins.to(device)), -1).mean(0).cpu().numpy()
    parts = [None] * world
    dist.all_gather_object(parts, out)
    merged = {k: v for part in parts for k, v in part.items()}
    probs = np.stack([merged[i] for i in range(len(ds))])
    y = np.asarray(ds.labels)
    pred = probs.argmax(1)
    # challenge score: mean F1 over N, A, O
    f1s = f1_score(y, pred, labels=[0, 1, 2, 3], average=None, zero_division=0)
    return {"cinc_f1": float(f1s[:3].mean()), "f1_af": float(f1s[1]),
            "auroc": float(roc_auc_score(y, probs, multi_class="ovr"))}


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed + rank)

    wandb.init(project=args.wandb_project, name=f"fold{args.fold}", config=vars(args))

    ref = pd.read_csv(os.path.join(args.data, "REFERENCE.csv"), header=None, names=["rec", "label"])
    y_all = ref["label"].map(LABELS).to_numpy()
    skf = StratifiedKFold(n_splits=5, shuffle=True, random_state=2017)
    trval, test = list(skf.split(ref["rec"], y_all))[args.fold]
    train, val = train_test_split(trval, test_size=0.1, stratify=y_all[trval], random_state=2017)
    signals = [read_record(args.data, r) for r in ref["rec"]]
    pick = lambda idx: ([signals[i] for i in idx], [int(y_all[i]) for i in idx])

    crop = int(args.crop_s * FS)
    train_ds = CinCTrain(*pick(train), crop)
    val_ds, test_ds = CinCRecords(*pick(val), crop), CinCRecords(*pick(test), crop)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(ECGNet()).to(device)
    model = DDP(model, device_ids=[local_rank])
    counts = np.bincount(y_all[train], minlength=4)
    class_w = torch.tensor(len(train) / (4 * counts), dtype=torch.float32, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-3)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.3, patience=4)

    os.makedirs(args.ckpt_dir, exist_ok=True)
    best_file = os.path.join(args.ckpt_dir, f"ecgnet_fold{args.fold}.pt")
    best, stale, gstep = -1.0, 0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y, weight=class_w)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            opt.step()
            gstep += 1
            if gstep % 20 == 0:
                wandb.log({"train/loss": loss.item(), "lr": opt.param_groups[0]["lr"]}, step=gstep)

        val = eval_records(model.module, val_ds, device)
        sched.step(val["cinc_f1"])
        if rank == 0:
            wandb.log({f"val/{k}": v for k, v in val.items()} | {"epoch": epoch}, step=gstep)
            print(f"epoch {epoch}: {val}", flush=True)
        if val["cinc_f1"] > best:
            best, stale = val["cinc_f1"], 0
            if rank == 0:
                torch.save(model.module.state_dict(), best_file)
        else:
            stale += 1
            if stale >= args.patience:
                break

    dist.barrier()
    model.module.load_state_dict(torch.load(best_file, map_location=device))
    test = eval_records(model.module, test_ds, device)
    if rank == 0:
        print(f"fold {args.fold} TEST {test}")
        wandb.summary.update({f"test/{k}": v for k, v in test.items()})
    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
