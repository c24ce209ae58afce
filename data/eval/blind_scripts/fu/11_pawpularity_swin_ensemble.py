"""PetFinder Pawpularity: 10-fold Swin regression (BCE on score/100) + fold-ensemble on the test set.

    torchrun --nproc_per_node=4 11_pawpularity_swin_ensemble.py --data /kaggle/input/petfinder-pawpularity-score --exp swin_l_384
"""
import argparse
import math
import os
import time
from collections import OrderedDict

import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import wandb
from PIL import Image
from sklearn.model_selection import StratifiedKFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--exp", default="swin_l_384")
    ap.add_argument("--arch", default="swin_large_patch4_window12_384.ms_in22k")
    ap.add_argument("--size", type=int, default=384)
    ap.add_argument("--folds", type=int, default=10)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--no-wandb", action="store_true")
    return ap.parse_args()


class ShardSampler(Sampler):
    """Contiguous, non-overlapping shard per rank (no padding, shards may differ by one)."""

    def __init__(self, n, rank, world_size):
        self.indices = list(range(n))[rank::world_size]

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


class PetDS(Dataset):
    def __init__(self, ids, img_dir, target, tf):
        self.ids, self.img_dir, self.target, self.tf = ids, img_dir, target, tf

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.img_dir, f"{self.ids[i]}.jpg")).convert("RGB")
        return self.tf(img), torch.tensor(self.target[i] / 100.0, dtype=torch.float32), i


def transforms(size, train):
    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    if train:
        return T.Compose([T.RandomResizedCrop(size, scale=(0.8, 1.0)), T.RandomHorizontalFlip(),
                          T.ColorJitter(0.1, 0.1, 0.1), T.ToTensor(), norm])
    return T.Compose([T.Resize((size, size)), T.ToTensor(), norm])


@torch.no_grad()
def predict(net, loader, device, tta=False):
    net.eval()
    idx, out = [], []
    for x, _, i in loader:
        x = x.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            p = torch.sigmoid(net(x).float().squeeze(1))
            if tta:
                p = (p + torch.sigmoid(net(x.flip(3)).float().squeeze(1))) / 2
        out.append(p.cpu().numpy() * 100.0)
        idx.append(i.numpy())
    return np.concatenate(idx), np.concatenate(out)


def gather_all(idx, pred, world_size):
    parts = [None] * world_size
    dist.all_gather_object(parts, (idx, pred))  # shards can have different lengths
    idx = np.concatenate([p[0] for p in parts])
    pred = np.concatenate([p[1] for p in parts])
    order = np.argsort(idx)
    return idx[order], pred[order]


def strip_module(state):
    return OrderedDict((k[len("module."):] if k.startswith("module.") else k, v) for k, v in state.items())


def train_fold(fold, df, args, rank, local_rank, world_size):
    device = torch.device("cuda", local_rank)
    img_dir = os.path.join(args.data, "train")
    tr, va = df[df.fold != fold].reset_index(drop=True), df[df.fold == fold].reset_index(drop=True)
    tr_ds = PetDS(tr.Id.tolist(), img_dir, tr.Pawpularity.to_numpy(), transforms(args.size, True))
    va_ds = PetDS(va.Id.tolist(), img_dir, va.Pawpularity.to_numpy(), transforms(args.size, False))
    tr_sampler = DistributedSampler(tr_ds, shuffle=True, seed=args.seed)
    tr_dl = DataLoader(tr_ds, args.bs, sampler=tr_sampler, num_workers=6, pin_memory=True, drop_last=True)
    va_dl = DataLoader(va_ds, args.bs * 4, sampler=ShardSampler(len(va_ds), rank, world_size), num_workers=6)

    net = timm.create_model(args.arch, pretrained=True, num_classes=1).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-6)
    total = args.epochs * len(tr_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / total)))
    scaler = torch.cuda.amp.GradScaler()
    bce = nn.BCEWithLogitsLoss()

    run = None
    if rank == 0 and not args.no_wandb:
        run = wandb.init(project="pawpularity", group=args.exp, name=f"{args.exp}-f{fold}",
                         config=vars(args), reinit=True)

    best_rmse, best_pred = float("inf"), None
    eval_every = max(len(tr_dl) // 2, 1)
    step = 0
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y, _ in tr_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = bce(model(x).float().squeeze(1), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            step += 1
            if run is not None and step % 20 == 0:
                run.log({"train/loss": loss.item(), "lr": sched.get_last_lr()[0]}, step=step)

            if step % eval_every == 0:
                # evaluate on the unwrapped model: shards are uneven, so no DDP forward here
                idx, pred = gather_all(*predict(net, va_dl, device), world_size)
                rmse = float(np.sqrt(np.mean((pred - va.Pawpularity.to_numpy()[idx]) ** 2)))
                model.train()
                if rank == 0:
                    print(f"fold {fold} ep {epoch} step {step} RMSE {rmse:.3f} ({time.time() - t0:.0f}s)", flush=True)
                    if run is not None:
                        run.log({"val/rmse": rmse}, step=step)
                    if rmse < best_rmse:
                        torch.save(model.state_dict(), os.path.join(args.exp, f"fold{fold}.pt"))
                if rmse < best_rmse:
                    best_rmse, best_pred = rmse, pred
    if run is not None:
        run.summary["best_rmse"] = best_rmse
        run.finish()
    return best_rmse, va.row.to_numpy(), best_pred


def ensemble_test(args, rank, local_rank, world_size):
    device = torch.device("cuda", local_rank)
    test = pd.read_csv(os.path.join(args.data, "test.csv"))
    ds = PetDS(test.Id.tolist(), os.path.join(args.data, "test"), np.zeros(len(test)), transforms(args.size, False))
    dl = DataLoader(ds, args.bs * 4, sampler=ShardSampler(len(ds), rank, world_size), num_workers=4)
    acc = None
    for fold in range(args.folds):
        net = timm.create_model(args.arch, pretrained=False, num_classes=1)
        net.load_state_dict(strip_module(torch.load(os.path.join(args.exp, f"fold{fold}.pt"), map_location="cpu")))
        idx, pred = predict(net.to(device), dl, device, tta=True)
        acc = pred if acc is None else acc + pred
        del net
    return gather_all(idx, acc / args.folds, world_size)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    os.makedirs(args.exp, exist_ok=True)

    df = pd.read_csv(os.path.join(args.data, "train.csv"))
    df["row"] = np.arange(len(df))
    bins = pd.cut(df.Pawpularity, bins=int(np.floor(1 + np.log2(len(df)))), labels=False)
    df["fold"] = -1
    skf = StratifiedKFold(n_splits=args.folds, shuffle=True, random_state=args.seed)
    for f, (_, v) in enumerate(skf.split(df, bins)):
        df.loc[v, "fold"] = f

    oof = np.zeros(len(df), np.float32)
    for fold in range(args.folds):
        rmse, rows, pred = train_fold(fold, df, args, rank, local_rank, world_size)
        oof[rows] = pred
        torch.cuda.empty_cache()
    if rank == 0:
        cv = float(np.sqrt(np.mean((oof - df.Pawpularity.to_numpy()) ** 2)))
        print(f"CV RMSE {cv:.4f}")
        df.assign(oof=oof).to_csv(os.path.join(args.exp, "oof.csv"), index=False)

    dist.barrier()
    idx, pred = ensemble_test(args, rank, local_rank, world_size)
    if rank == 0:
        test = pd.read_csv(os.path.join(args.data, "test.csv"))
        pd.DataFrame({"Id": test.Id.to_numpy()[idx], "Pawpularity": pred}).to_csv(
            os.path.join(args.exp, "submission.csv"), index=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
