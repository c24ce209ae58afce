# HAM10000 7-class lesion classifier with class-balanced sampling + EMA.
# torchrun --nproc_per_node=8 12_ham_balanced_sampler.py --fold 4 --epochs 30
import os
import csv
import time
import random
import argparse

import numpy as np
import pandas as pd
from PIL import Image
import torch
import torch.nn as nn
import torch.distributed as dist
from torch.utils.data import Dataset, DataLoader, WeightedRandomSampler
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
import torchvision.transforms as T
from sklearn.metrics import balanced_accuracy_score, f1_score
import timm
from timm.utils import ModelEmaV2

CLASSES = ["akiec", "bcc", "bkl", "df", "mel", "nv", "vasc"]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/data/ham10000")
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--model", default="resnest50d")
    p.add_argument("--img", type=int, default=384)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--bs", type=int, default=32)
    p.add_argument("--lr", type=float, default=4e-4)
    p.add_argument("--ema", type=float, default=0.998)
    p.add_argument("--balance_power", type=float, default=0.5,
                   help="sample weight = 1 / count**power")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--logdir", default="logs_ham")
    return p.parse_args()


def seed_all(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class HamDS(Dataset):
    def __init__(self, df, root, tf):
        self.files = [os.path.join(root, "images", f + ".jpg") for f in df.image_id]
        self.y = df.dx.map({c: i for i, c in enumerate(CLASSES)}).values
        self.tf = tf

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        return self.tf(Image.open(self.files[i]).convert("RGB")), int(self.y[i]), i


def make_tf(sz):
    mean, std = (0.763, 0.546, 0.570), (0.141, 0.153, 0.170)
    tr = T.Compose([T.RandomResizedCrop(sz, scale=(0.4, 1.0)), T.RandomHorizontalFlip(),
                    T.RandomVerticalFlip(), T.RandomRotation(180),
                    T.ColorJitter(0.2, 0.2, 0.2, 0.02), T.ToTensor(), T.Normalize(mean, std)])
    va = T.Compose([T.Resize(sz), T.CenterCrop(sz), T.ToTensor(), T.Normalize(mean, std)])
    return tr, va


class CSVLogger:
    def __init__(self, path, fields):
        self.f = open(path, "w", newline="")
        self.w = csv.DictWriter(self.f, fieldnames=fields)
        self.w.writeheader()

    def log(self, **row):
        self.w.writerow(row)
        self.f.flush()

    def close(self):
        self.f.close()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    seed_all(args.seed)

    df = pd.read_csv(os.path.join(args.root, "HAM10000_metadata_folds.csv"))
    tr_df = df[df.fold != args.fold].reset_index(drop=True)
    va_df = df[df.fold == args.fold].reset_index(drop=True)
    tf_tr, tf_va = make_tf(args.img)
    ds_tr, ds_va = HamDS(tr_df, args.root, tf_tr), HamDS(va_df, args.root, tf_va)

    counts = np.bincount(ds_tr.y, minlength=len(CLASSES)).astype(np.float64)
    sample_w = (1.0 / counts ** args.balance_power)[ds_tr.y]
    train_sampler = WeightedRandomSampler(torch.as_tensor(sample_w), num_samples=len(ds_tr),
                                          replacement=True)
    dl_tr = DataLoader(ds_tr, batch_size=args.bs, sampler=train_sampler, num_workers=8,
                       pin_memory=True, drop_last=True)
    va_sampler = DistributedSampler(ds_va, shuffle=False)
    dl_va = DataLoader(ds_va, batch_size=args.bs * 2, sampler=va_sampler, num_workers=8,
                       pin_memory=True)

    model = timm.create_model(args.model, pretrained=True, num_classes=len(CLASSES))
    model.to(device)
    ema = ModelEmaV2(model, decay=args.ema)
    model = DDP(model, device_ids=[local_rank])

    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4,
                          nesterov=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs,
                                                steps_per_epoch=len(dl_tr), pct_start=0.2)
    scaler = torch.cuda.amp.GradScaler()
    crit = nn.CrossEntropyLoss()

    logger = None
    if rank == 0:
        os.makedirs(args.logdir, exist_ok=True)
        logger = CSVLogger(os.path.join(args.logdir, f"{args.model}_f{args.fold}.csv"),
                           ["epoch", "loss", "bacc", "macro_f1", "secs"])
    best = 0.0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for x, y, _ in dl_tr:
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            with torch.cuda.amp.autocast():
                loss = crit(model(x), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            ema.update(model.module)
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(run)

        ema.module.eval()
        preds, idx = [], []
        with torch.no_grad():
            for x, _, i in dl_va:
                with torch.cuda.amp.autocast():
                    preds.append(ema.module(x.to(device)).argmax(1).cpu())
                idx.append(i)
        out = [None] * world
        dist.all_gather_object(out, (torch.cat(preds).numpy(), torch.cat(idx).numpy()))
        if rank == 0:
            P = np.concatenate([o[0] for o in out])
            I = np.concatenate([o[1] for o in out])
            I, k = np.unique(I, return_index=True)
            yt = ds_va.y[I]
            bacc = balanced_accuracy_score(yt, P[k])
            mf1 = f1_score(yt, P[k], average="macro")
            secs = time.time() - t0
            print(f"ep {epoch:02d} loss {(run[0] / run[1]).item():.4f} bacc {bacc:.4f} "
                  f"f1 {mf1:.4f} {secs:.0f}s", flush=True)
            logger.log(epoch=epoch, loss=(run[0] / run[1]).item(), bacc=bacc, macro_f1=mf1,
                       secs=round(secs, 1))
            if bacc > best:
                best = bacc
                torch.save(ema.module.state_dict(),
                           os.path.join(args.logdir, f"{args.model}_f{args.fold}_ema.pth"))
        dist.barrier()

    if logger:
        logger.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
