"""Cassava leaf disease: 5-fold ViT/CNN training on all GPUs, then a TTA ensemble of the fold models.

    torchrun --nproc_per_node=8 07_cassava_folds_ensemble.py --arch tf_efficientnet_b4_ns --size 512 --epochs 10
"""
import argparse
import glob
import os
import time

import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from sklearn.model_selection import StratifiedKFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T

N_CLASSES = 5


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/datasets/cassava")
    p.add_argument("--arch", default="tf_efficientnet_b4_ns")
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--folds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--bs", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--smoothing", type=float, default=0.2)
    p.add_argument("--workdir", default="work/cassava")
    p.add_argument("--tta", type=int, default=4)
    return p.parse_args()


class LeafDataset(Dataset):
    def __init__(self, files, labels, tf):
        self.files, self.labels, self.tf = files, labels, tf

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        img = Image.open(self.files[i]).convert("RGB")
        return self.tf(img), self.labels[i], i


def make_tf(size, train):
    norm = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    if train:
        return T.Compose([T.RandomResizedCrop(size, scale=(0.5, 1.0)), T.RandomHorizontalFlip(),
                          T.RandomVerticalFlip(), T.ColorJitter(0.2, 0.2, 0.2, 0.1), T.ToTensor(), norm,
                          T.RandomErasing(p=0.25)])
    return T.Compose([T.Resize((size, size)), T.ToTensor(), norm])


def tta_tf(size):
    norm = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    return T.Compose([T.RandomResizedCrop(size, scale=(0.8, 1.0)), T.RandomHorizontalFlip(),
                      T.RandomVerticalFlip(), T.ToTensor(), norm])


def gather_logits(idx, logits, world_size):
    objs = [None] * world_size
    dist.all_gather_object(objs, (idx, logits))
    idx = np.concatenate([o[0] for o in objs])
    logits = np.concatenate([o[1] for o in objs])
    idx, keep = np.unique(idx, return_index=True)
    return idx, logits[keep]


def train_fold(fold, df, args, rank, local_rank, world_size):
    device = torch.device("cuda", local_rank)
    tr, va = df[df.fold != fold].reset_index(drop=True), df[df.fold == fold].reset_index(drop=True)
    tr_ds = LeafDataset(tr.path.tolist(), tr.label.tolist(), make_tf(args.size, True))
    va_ds = LeafDataset(va.path.tolist(), va.label.tolist(), make_tf(args.size, False))
    tr_sampler = DistributedSampler(tr_ds, shuffle=True)
    tr_dl = DataLoader(tr_ds, args.bs, sampler=tr_sampler, num_workers=8, pin_memory=True, drop_last=True)
    va_dl = DataLoader(va_ds, args.bs * 2, sampler=DistributedSampler(va_ds, shuffle=False), num_workers=8)

    model = timm.create_model(args.arch, pretrained=True, num_classes=N_CLASSES).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-6)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs, eta_min=1e-6)
    scaler = torch.cuda.amp.GradScaler()
    crit = nn.CrossEntropyLoss(label_smoothing=args.smoothing)

    best_acc = 0.0
    oof_logits = None
    for epoch in range(args.epochs):
        model.train()
        tr_sampler.set_epoch(epoch)
        t0 = time.time()
        for x, y, _ in tr_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.cuda.amp.autocast():
                loss = crit(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        sched.step()

        model.eval()
        idx_l, log_l = [], []
        with torch.no_grad(), torch.cuda.amp.autocast():
            for x, _, i in va_dl:
                log_l.append(model(x.to(device)).float().cpu().numpy())
                idx_l.append(i.numpy())
        idx, logits = gather_logits(np.concatenate(idx_l), np.concatenate(log_l), world_size)
        acc = float((logits.argmax(1) == va.label.to_numpy()[idx]).mean())
        if rank == 0:
            print(f"fold {fold} epoch {epoch} acc {acc:.4f} last loss {loss.item():.4f} {time.time() - t0:.0f}s",
                  flush=True)
        if acc > best_acc:
            best_acc = acc
            oof_logits = np.zeros((len(va), N_CLASSES), np.float32)
            oof_logits[idx] = logits
            if rank == 0:
                torch.save(model.state_dict(), os.path.join(args.workdir, f"{args.arch}_fold{fold}.pth"))
    return best_acc, va.row.to_numpy(), oof_logits


@torch.no_grad()
def ensemble_predict(args, device):
    test_files = sorted(glob.glob(os.path.join(args.root, "test_images", "*.jpg")))
    ds = LeafDataset(test_files, [0] * len(test_files), tta_tf(args.size))
    dl = DataLoader(ds, args.bs * 2, shuffle=False, num_workers=8)
    probs = np.zeros((len(test_files), N_CLASSES), np.float32)
    ckpts = sorted(glob.glob(os.path.join(args.workdir, f"{args.arch}_fold*.pth")))
    for path in ckpts:
        model = timm.create_model(args.arch, pretrained=False, num_classes=N_CLASSES)
        model.load_state_dict(torch.load(path, map_location="cpu"))
        model.to(device).eval()
        for _ in range(args.tta):
            for x, _, i in dl:
                with torch.cuda.amp.autocast():
                    p = F.softmax(model(x.to(device)).float(), dim=1)
                probs[i.numpy()] += p.cpu().numpy()
        print(f"  ensembled {os.path.basename(path)}", flush=True)
    probs /= max(len(ckpts) * args.tta, 1)
    return pd.DataFrame({"image_id": [os.path.basename(f) for f in test_files], "label": probs.argmax(1)})


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    os.makedirs(args.workdir, exist_ok=True)

    df = pd.read_csv(os.path.join(args.root, "train.csv"))
    df["path"] = args.root + "/train_images/" + df.image_id
    df["row"] = np.arange(len(df))
    skf = StratifiedKFold(n_splits=args.folds, shuffle=True, random_state=719)
    for f, (_, v) in enumerate(skf.split(df, df.label)):
        df.loc[v, "fold"] = f

    oof = np.zeros((len(df), N_CLASSES), np.float32)
    for fold in range(args.folds):
        acc, rows, logits = train_fold(fold, df, args, rank, local_rank, world_size)
        oof[rows] = logits
        if rank == 0:
            print(f"== fold {fold} best acc {acc:.4f}")

    dist.barrier()
    dist.destroy_process_group()

    if rank == 0:
        print("OOF accuracy", float((oof.argmax(1) == df.label.to_numpy()).mean()))
        np.save(os.path.join(args.workdir, f"oof_{args.arch}.npy"), oof)
        sub = ensemble_predict(args, torch.device("cuda", local_rank))
        sub.to_csv(os.path.join(args.workdir, "submission.csv"), index=False)


if __name__ == "__main__":
    main()
