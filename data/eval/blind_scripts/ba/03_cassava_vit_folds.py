# Cassava Leaf Disease Classification
# ViT / EffNet 5-fold training with label smoothing + hflip TTA on validation.
# Launch: torchrun --nproc_per_node=8 03_cassava_vit_folds.py --arch vit_base_patch16_384 --bs 16
import argparse
import logging
import os
import random
import sys

import albumentations as A
import cv2
import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from albumentations.pytorch import ToTensorV2
from sklearn.metrics import accuracy_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

N_CLASSES = 5


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/kaggle/input/cassava-leaf-disease-classification")
    ap.add_argument("--folds-csv", default="/kaggle/input/cassava-folds/train_folds.csv")
    ap.add_argument("--arch", default="vit_base_patch16_384")
    ap.add_argument("--size", type=int, default=384)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--min-lr", type=float, default=1e-6)
    ap.add_argument("--smoothing", type=float, default=0.2)
    ap.add_argument("--folds", type=str, default="0,1,2,3,4")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=719)
    ap.add_argument("--save-dir", default="./weights")
    return ap.parse_args()


def setup_logger(rank):
    logger = logging.getLogger("cassava")
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    logger.addHandler(h)
    return logger


def seed_all(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def train_aug(size):
    return A.Compose([
        A.RandomResizedCrop(size, size),
        A.Transpose(p=0.5),
        A.HorizontalFlip(p=0.5),
        A.VerticalFlip(p=0.5),
        A.ShiftScaleRotate(p=0.5),
        A.HueSaturationValue(hue_shift_limit=0.2, sat_shift_limit=0.2, val_shift_limit=0.2, p=0.5),
        A.RandomBrightnessContrast(brightness_limit=(-0.1, 0.1), contrast_limit=(-0.1, 0.1), p=0.5),
        A.Normalize(mean=[0.5, 0.5, 0.5], std=[0.5, 0.5, 0.5]),
        A.CoarseDropout(p=0.5),
        ToTensorV2(),
    ])


def valid_aug(size):
    return A.Compose([
        A.CenterCrop(size, size, p=1.0),
        A.Resize(size, size),
        A.Normalize(mean=[0.5, 0.5, 0.5], std=[0.5, 0.5, 0.5]),
        ToTensorV2(),
    ])


class CassavaDS(Dataset):
    def __init__(self, df, img_dir, tfm):
        self.files = df.image_id.values
        self.labels = df.label.values
        self.img_dir = img_dir
        self.tfm = tfm

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        im = cv2.imread(os.path.join(self.img_dir, self.files[i]))[:, :, ::-1]
        return self.tfm(image=im)["image"], int(self.labels[i])


class LabelSmoothingCE(nn.Module):
    def __init__(self, smoothing):
        super().__init__()
        self.s = smoothing

    def forward(self, logits, target):
        logp = F.log_softmax(logits, dim=-1)
        nll = -logp.gather(1, target.unsqueeze(1)).squeeze(1)
        smooth = -logp.mean(dim=-1)
        return ((1 - self.s) * nll + self.s * smooth).mean()


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    probs, ys = [], []
    for x, y in loader:
        x = x.to(device)
        with torch.cuda.amp.autocast():
            p = net(x).softmax(-1) + net(torch.flip(x, dims=[3])).softmax(-1)
        probs.append((p / 2).float().cpu().numpy())
        ys.append(y.numpy())
    probs, ys = np.concatenate(probs), np.concatenate(ys)
    return probs, accuracy_score(ys, probs.argmax(1))


def train_fold(fold, df, args, rank, local_rank, log):
    device = torch.device(f"cuda:{local_rank}")
    img_dir = os.path.join(args.root, "train_images")
    trn = df[df.fold != fold].reset_index(drop=True)
    val = df[df.fold == fold].reset_index(drop=True)

    train_loader = DataLoader(CassavaDS(trn, img_dir, train_aug(args.size)), batch_size=args.bs,
                              shuffle=True, num_workers=args.workers, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(CassavaDS(val, img_dir, valid_aug(args.size)), batch_size=args.bs * 2,
                              shuffle=False, num_workers=args.workers, pin_memory=True)

    model = timm.create_model(args.arch, pretrained=True, num_classes=N_CLASSES).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-6)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=args.epochs, T_mult=1, eta_min=args.min_lr)
    scaler = torch.cuda.amp.GradScaler()
    crit = LabelSmoothingCE(args.smoothing)

    best_acc, oof = 0.0, None
    for epoch in range(args.epochs):
        model.train()
        loss_sum = torch.zeros(2, device=device)
        pbar = tqdm(train_loader, disable=rank != 0, desc=f"f{fold} e{epoch}")
        for i, (x, y) in enumerate(pbar):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.cuda.amp.autocast():
                loss = crit(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step(epoch + i / len(train_loader))
            loss_sum += torch.stack([loss.detach() * x.size(0), torch.tensor(float(x.size(0)), device=device)])
            if rank == 0 and i % 50 == 0:
                pbar.set_postfix(loss=f"{loss.item():.4f}")
        dist.all_reduce(loss_sum)

        if rank == 0:
            probs, acc = evaluate(model.module, valid_loader, device)
            log.info(f"fold {fold} epoch {epoch} train_loss {(loss_sum[0] / loss_sum[1]).item():.4f} val_acc {acc:.4f}")
            if acc > best_acc:
                best_acc = acc
                oof = val[["image_id", "label"]].copy()
                oof[[f"p{c}" for c in range(N_CLASSES)]] = probs
                torch.save(model.module.state_dict(), os.path.join(args.save_dir, f"{args.arch}_fold{fold}_best.pth"))
                log.info(f"  -> best {best_acc:.4f}")
        dist.barrier()
    return best_acc, oof


def main():
    args = get_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    log = setup_logger(rank)
    seed_all(args.seed)
    os.makedirs(args.save_dir, exist_ok=True)

    df = pd.read_csv(args.folds_csv)
    log.info(f"train images {len(df)}, world_size {dist.get_world_size()}")
    folds = [int(f) for f in args.folds.split(",")]
    accs, oofs = [], []
    for fold in folds:
        acc, oof = train_fold(fold, df, args, rank, local_rank, log)
        accs.append(acc)
        oofs.append(oof)

    if rank == 0:
        oof = pd.concat(oofs, ignore_index=True)
        oof.to_csv(os.path.join(args.save_dir, f"oof_{args.arch}.csv"), index=False)
        cv = accuracy_score(oof.label, oof[[f"p{c}" for c in range(N_CLASSES)]].values.argmax(1))
        log.info(f"fold accs {['%.4f' % a for a in accs]} | OOF acc {cv:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
