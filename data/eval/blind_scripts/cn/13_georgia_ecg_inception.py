"""Multi-label 12-lead ECG classification on the Georgia (G12EC) subset of PhysioNet/CinC 2021
with an InceptionTime-style 1D network.

Records (WFDB .mat/.hea) were converted by convert_g12ec.py into
    {data_dir}/signals.npy   float16 [N, 12, 2500]   (10 s, resampled to 250 Hz, zero-padded)
    {data_dir}/labels.npy    uint8   [N, C]          (scored SNOMED-CT classes, see classes.txt)
    {data_dir}/patients.npy  int64   [N]             (patient hash from the header)

Training is long (~8 h on 4 GPUs for 100 epochs) and runs in 4 h slots, so it checkpoints
every epoch and can be resumed with --resume.

    torchrun --nproc_per_node=4 13_georgia_ecg_inception.py --data_dir /data/g12ec --fold 2
    torchrun --nproc_per_node=4 13_georgia_ecg_inception.py --data_dir /data/g12ec --fold 2 \
        --resume out/g12ec/fold2/last.pt
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import f1_score, roc_auc_score
from sklearn.model_selection import GroupKFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", required=True)
    p.add_argument("--out_dir", default="out/g12ec")
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--n_folds", type=int, default=5)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--resume", default=None)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--seed", type=int, default=5)
    return p.parse_args()


class ECGSet(Dataset):
    def __init__(self, X, Y, idx, train):
        self.X, self.Y, self.idx, self.train = X, Y, idx, train

    def __len__(self):
        return len(self.idx)

    def __getitem__(self, i):
        j = self.idx[i]
        x = self.X[j].astype(np.float32)
        if self.train:
            shift = np.random.randint(-125, 126)
            x = np.roll(x, shift, axis=1)
            x = x + np.random.normal(0, 0.01, x.shape).astype(np.float32)
        return torch.from_numpy(x), torch.from_numpy(self.Y[j].astype(np.float32))


class InceptionModule(nn.Module):
    def __init__(self, cin, nf=32, kernels=(39, 19, 9), bottleneck=32):
        super().__init__()
        self.bottleneck = nn.Conv1d(cin, bottleneck, 1, bias=False) if cin > 1 else nn.Identity()
        bc = bottleneck if cin > 1 else cin
        self.convs = nn.ModuleList([nn.Conv1d(bc, nf, k, padding=k // 2, bias=False) for k in kernels])
        self.pool_conv = nn.Sequential(nn.MaxPool1d(3, 1, 1), nn.Conv1d(cin, nf, 1, bias=False))
        self.bn = nn.BatchNorm1d(nf * (len(kernels) + 1))

    def forward(self, x):
        b = self.bottleneck(x)
        out = torch.cat([c(b) for c in self.convs] + [self.pool_conv(x)], dim=1)
        return F.relu(self.bn(out))


class InceptionTime(nn.Module):
    def __init__(self, cin=12, n_classes=26, nf=32, depth=6):
        super().__init__()
        self.blocks, self.shortcuts = nn.ModuleList(), nn.ModuleList()
        c, res_c = cin, cin
        for d in range(depth):
            self.blocks.append(InceptionModule(c, nf))
            c = nf * 4
            if d % 3 == 2:
                self.shortcuts.append(nn.Sequential(nn.Conv1d(res_c, c, 1, bias=False), nn.BatchNorm1d(c)))
                res_c = c
        self.fc = nn.Linear(c, n_classes)

    def forward(self, x):
        res = x
        for d, blk in enumerate(self.blocks):
            x = blk(x)
            if d % 3 == 2:
                x = F.relu(x + self.shortcuts[d // 3](res))
                res = x
        return self.fc(x.mean(-1))


@torch.no_grad()
def evaluate(model, loader, n, device):
    model.eval()
    probs, ys = [], []
    for x, y in loader:
        probs.append(torch.sigmoid(model(x.to(device, non_blocking=True))))
        ys.append(y.to(device, non_blocking=True))
    probs, ys = torch.cat(probs), torch.cat(ys)
    W = dist.get_world_size()
    gp, gy = [torch.empty_like(probs) for _ in range(W)], [torch.empty_like(ys) for _ in range(W)]
    dist.all_gather(gp, probs)
    dist.all_gather(gy, ys)
    P = torch.stack(gp, 1).flatten(0, 1)[:n].cpu().numpy()
    Y = torch.stack(gy, 1).flatten(0, 1)[:n].cpu().numpy().astype(int)
    valid = (Y.sum(0) > 0) & (Y.sum(0) < len(Y))
    return {
        "macro_auroc": float(roc_auc_score(Y[:, valid], P[:, valid], average="macro")),
        "macro_f1": float(f1_score(Y, P > 0.5, average="macro", zero_division=0)),
    }


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    X = np.load(os.path.join(args.data_dir, "signals.npy"), mmap_mode="r")
    Y = np.load(os.path.join(args.data_dir, "labels.npy"))
    groups = np.load(os.path.join(args.data_dir, "patients.npy"))
    folds = list(GroupKFold(args.n_folds).split(X, Y, groups))
    trval, test = folds[args.fold]
    _, val = folds[(args.fold + 1) % args.n_folds]
    val = np.intersect1d(val, trval)
    train = np.setdiff1d(trval, val)

    train_ds, val_ds, test_ds = ECGSet(X, Y, train, True), ECGSet(X, Y, val, False), ECGSet(X, Y, test, False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    mk = lambda ds, bs, s: DataLoader(ds, batch_size=bs, sampler=s, num_workers=args.workers, pin_memory=True,
                                      drop_last=isinstance(s, DistributedSampler) and s.shuffle)
    train_dl = mk(train_ds, args.batch_size, train_sampler)
    val_dl = mk(val_ds, 128, DistributedSampler(val_ds, shuffle=False))
    test_dl = mk(test_ds, 128, DistributedSampler(test_ds, shuffle=False))

    model = nn.SyncBatchNorm.convert_sync_batchnorm(InceptionTime(n_classes=Y.shape[1])).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs,
                                                steps_per_epoch=len(train_dl))
    prevalence = torch.tensor(Y[train].mean(0), device=device).clamp(1e-3, 1 - 1e-3)
    pos_weight = ((1 - prevalence) / prevalence).sqrt()

    run_dir = os.path.join(args.out_dir, f"fold{args.fold}")
    os.makedirs(run_dir, exist_ok=True)
    start, best = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start, best = ckpt["epoch"] + 1, ckpt["best"]
        if rank == 0:
            print(f"resumed from {args.resume} at epoch {start} (best so far {best:.4f})")

    for epoch in range(start, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(x), y, pos_weight=pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(acc)
        m = evaluate(model, val_dl, len(val_ds), device)
        if rank == 0:
            print(f"epoch {epoch:03d} loss {(acc[0] / acc[1]).item():.4f} val AUROC {m['macro_auroc']:.4f} "
                  f"F1 {m['macro_f1']:.4f} ({time.time() - t0:.0f}s)", flush=True)
        if m["macro_auroc"] > best:
            best = m["macro_auroc"]
            if rank == 0:
                torch.save(model.module.state_dict(), os.path.join(run_dir, "best.pt"))
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "best": best}, os.path.join(run_dir, "last.pt"))

    dist.barrier()
    model.module.load_state_dict(torch.load(os.path.join(run_dir, "best.pt")))
    m = evaluate(model, test_dl, len(test_ds), device)
    if rank == 0:
        print(f"fold {args.fold} TEST macro AUROC {m['macro_auroc']:.4f} macro F1 {m['macro_f1']:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
