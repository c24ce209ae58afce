# SETI Breakthrough Listen - cadence snippets (6 x 273 x 256) -> stacked ON/OFF image, timm cnn
# k-fold with OOF csv for the blend
#
#   for f in 0 1 2 3 4; do torchrun --nproc_per_node=4 19_seti_oof_auc.py --fold $f; done
import os
import glob
import time
import argparse

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.distributed as dist
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
from sklearn.metrics import roc_auc_score
import timm

p = argparse.ArgumentParser()
p.add_argument("--data", default="/kaggle/input/seti-breakthrough-listen")
p.add_argument("--fold", type=int, default=0)
p.add_argument("--arch", default="efficientnet_b1")
p.add_argument("--epochs", type=int, default=20)
p.add_argument("--bs", type=int, default=64)
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--mixup", type=float, default=0.5)
p.add_argument("--out", default="./seti_out")
ARGS = p.parse_args()


class SetiDS(Dataset):
    def __init__(self, df, root, train):
        self.ids = df.id.values
        self.y = df.target.values.astype(np.float32)
        self.root = root
        self.train = train

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        x = np.load(f"{self.root}/train/{self.ids[i][0]}/{self.ids[i]}.npy").astype(np.float32)
        x = x[::2]  # ON cadences only
        if self.train:
            if np.random.rand() < 0.5:
                x = x[:, :, ::-1]
            if np.random.rand() < 0.5:
                x = np.roll(x, np.random.randint(-32, 32), axis=2)
        x = np.vstack(x)  # 819 x 256
        x = (x - x.mean()) / (x.std() + 1e-6)
        return torch.from_numpy(x[None].copy()), torch.tensor(self.y[i]), i


def build_model():
    return timm.create_model(ARGS.arch, pretrained=True, num_classes=1, in_chans=1)


def run_valid(model, loader, device):
    model.eval()
    P, Y, I = [], [], []
    with torch.no_grad():
        for x, y, i in loader:
            with torch.cuda.amp.autocast():
                P.append(model(x.to(device)).squeeze(1).float().sigmoid().cpu().numpy())
            Y.append(y.numpy())
            I.append(i.numpy())
    return np.concatenate(P), np.concatenate(Y), np.concatenate(I)


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(2021)

    df = pd.read_csv(f"{ARGS.data}/train_labels_folds.csv")
    trn = df[df.fold != ARGS.fold].reset_index(drop=True)
    val = df[df.fold == ARGS.fold].reset_index(drop=True)
    ds_t, ds_v = SetiDS(trn, ARGS.data, True), SetiDS(val, ARGS.data, False)
    st = DistributedSampler(ds_t, shuffle=True)
    sv = DistributedSampler(ds_v, shuffle=False)
    dl_t = DataLoader(ds_t, ARGS.bs, sampler=st, num_workers=8, pin_memory=True, drop_last=True)
    dl_v = DataLoader(ds_v, ARGS.bs * 2, sampler=sv, num_workers=8, pin_memory=True)

    model = DDP(build_model().to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=ARGS.lr, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=ARGS.lr, epochs=ARGS.epochs,
                                                steps_per_epoch=len(dl_t), pct_start=0.1)
    scaler = torch.cuda.amp.GradScaler()
    bce = nn.BCEWithLogitsLoss()

    if rank == 0:
        os.makedirs(ARGS.out, exist_ok=True)
    best_auc = 0.0
    for epoch in range(ARGS.epochs):
        st.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for x, y, _ in dl_t:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if np.random.rand() < ARGS.mixup:
                lam = np.random.beta(1.0, 1.0)
                perm = torch.randperm(x.size(0), device=device)
                x = lam * x + (1 - lam) * x[perm]
                y = lam * y + (1 - lam) * y[perm]
            with torch.cuda.amp.autocast():
                loss = bce(model(x).squeeze(1), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            tot[0] += loss.detach() * x.size(0)
            tot[1] += x.size(0)
        dist.all_reduce(tot)

        preds, ys, idx = run_valid(model, dl_v, device)
        auc = roc_auc_score(ys, preds)
        if rank == 0:
            print(f"fold {ARGS.fold} ep {epoch} loss {(tot[0] / tot[1]).item():.4f} "
                  f"auc {auc:.4f} {time.time() - t0:.0f}s", flush=True)
            if auc > best_auc:
                best_auc = auc
                torch.save(model.module.state_dict(), f"{ARGS.out}/{ARGS.arch}_f{ARGS.fold}.pth")
                oof = val.copy()
                oof["pred"] = np.nan
                oof.loc[idx, "pred"] = preds
                oof.to_csv(f"{ARGS.out}/oof_f{ARGS.fold}.csv", index=False)
        dist.barrier()

    if rank == 0:
        with open(f"{ARGS.out}/cv.txt", "a") as f:
            f.write(f"{ARGS.arch}\tfold{ARGS.fold}\t{best_auc:.5f}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
