"""ISIC skin lesion (malignant vs benign) - train one fold, then predict the test set with the
best checkpoint of that fold so the submission blend can start right away.

    torchrun --nproc_per_node=4 11_isic_train_then_infer.py --fold 0 --arch tf_efficientnet_b5_ns
"""
import argparse
import os
import time

import cv2
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
import albumentations as A
from albumentations.pytorch import ToTensorV2
from sklearn.metrics import roc_auc_score
import timm


def opts():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/isic/jpeg-512")
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--arch", default="tf_efficientnet_b5_ns")
    p.add_argument("--size", type=int, default=448)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--bs", type=int, default=24)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--tta", type=int, default=8)
    p.add_argument("--out", default="weights_isic")
    return p.parse_args()


def tfms(size, train):
    if train:
        return A.Compose([
            A.Transpose(p=0.5), A.VerticalFlip(p=0.5), A.HorizontalFlip(p=0.5),
            A.RandomBrightnessContrast(0.2, 0.2, p=0.75),
            A.OneOf([A.MotionBlur(blur_limit=5), A.MedianBlur(blur_limit=5),
                     A.GaussianBlur(blur_limit=(3, 5)), A.GaussNoise()], p=0.7),
            A.HueSaturationValue(10, 20, 10, p=0.5),
            A.ShiftScaleRotate(0.1, 0.1, 15, border_mode=0, p=0.85),
            A.Resize(size, size),
            A.CoarseDropout(max_holes=1, max_height=int(size * 0.375),
                            max_width=int(size * 0.375), p=0.7),
            A.Normalize(), ToTensorV2()])
    return A.Compose([A.Resize(size, size), A.Normalize(), ToTensorV2()])


class ISIC(Dataset):
    def __init__(self, df, img_dir, tf, with_target=True):
        self.df = df.reset_index(drop=True)
        self.img_dir = img_dir
        self.tf = tf
        self.with_target = with_target

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        r = self.df.iloc[i]
        img = cv2.cvtColor(cv2.imread(f"{self.img_dir}/{r.image_name}.jpg"), cv2.COLOR_BGR2RGB)
        x = self.tf(image=img)["image"]
        y = float(r.target) if self.with_target else 0.0
        return x, torch.tensor(y), i


def build_model(arch, pretrained):
    return timm.create_model(arch, pretrained=pretrained, num_classes=1, drop_rate=0.3)


def tta_flip(x, k):
    if k >= 4:
        x = x.transpose(2, 3)
    if k % 4 in (1, 3):
        x = x.flip(2)
    if k % 4 in (2, 3):
        x = x.flip(3)
    return x


@torch.no_grad()
def run_eval(model, loader, device, tta=1):
    model.eval()
    preds, ids = [], []
    for x, _, i in loader:
        x = x.to(device, non_blocking=True)
        p = 0
        for k in range(tta):
            with torch.cuda.amp.autocast():
                p = p + model(tta_flip(x, k)).squeeze(1).sigmoid().float()
        preds.append((p / tta).cpu())
        ids.append(i)
    return torch.cat(preds).numpy(), torch.cat(ids).numpy()


def main():
    o = opts()
    lrank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(lrank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", lrank)

    df = pd.read_csv(f"{o.data}/train_folds.csv")
    tr, va = df[df.fold != o.fold], df[df.fold == o.fold].reset_index(drop=True)
    ds_tr = ISIC(tr, f"{o.data}/train", tfms(o.size, True))
    ds_va = ISIC(va, f"{o.data}/train", tfms(o.size, False))
    s_tr = DistributedSampler(ds_tr, shuffle=True)
    s_va = DistributedSampler(ds_va, shuffle=False)
    dl_tr = DataLoader(ds_tr, o.bs, sampler=s_tr, num_workers=8, pin_memory=True, drop_last=True)
    dl_va = DataLoader(ds_va, o.bs, sampler=s_va, num_workers=8, pin_memory=True)

    model = DDP(build_model(o.arch, True).to(dev), device_ids=[lrank])
    opt = torch.optim.Adam(model.parameters(), lr=o.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, o.epochs - 1)
    scaler = torch.cuda.amp.GradScaler()
    crit = nn.BCEWithLogitsLoss()
    ckpt_path = f"{o.out}/{o.arch}_best_fold{o.fold}.pth"
    if rank == 0:
        os.makedirs(o.out, exist_ok=True)

    best_auc = 0.0
    for ep in range(o.epochs):
        s_tr.set_epoch(ep)
        model.train()
        t0 = time.time()
        tl = torch.zeros(2, device=dev)
        for x, y, _ in dl_tr:
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            with torch.cuda.amp.autocast():
                loss = crit(model(x).squeeze(1), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            tl[0] += loss.detach() * len(x)
            tl[1] += len(x)
        sched.step()
        dist.all_reduce(tl)

        p, i = run_eval(model, dl_va, dev)
        allp = [None] * world
        dist.all_gather_object(allp, (p, i))
        if rank == 0:
            P = np.concatenate([a[0] for a in allp])
            I = np.concatenate([a[1] for a in allp])
            I, k = np.unique(I, return_index=True)
            auc = roc_auc_score(va.target.values[I], P[k])
            print(f"ep {ep} train_loss {(tl[0] / tl[1]).item():.4f} val_auc {auc:.4f} "
                  f"{time.time() - t0:.0f}s", flush=True)
            if auc > best_auc:
                best_auc = auc
                torch.save(model.state_dict(), ckpt_path)
        dist.barrier()

    # ---------------- test inference with this fold's best weights (rank 0) ----------------
    if rank == 0:
        test = pd.read_csv(f"{o.data}/test.csv")
        ds_te = ISIC(test, f"{o.data}/test", tfms(o.size, False), with_target=False)
        dl_te = DataLoader(ds_te, o.bs * 2, shuffle=False, num_workers=8)
        infer_model = build_model(o.arch, pretrained=False)
        infer_model.load_state_dict(torch.load(ckpt_path, map_location="cpu"))
        infer_model.to(dev)
        pt, _ = run_eval(infer_model, dl_te, dev, tta=o.tta)
        sub = pd.DataFrame({"image_name": test.image_name, "target": pt})
        sub.to_csv(f"{o.out}/sub_{o.arch}_fold{o.fold}.csv", index=False)
        print(f"fold {o.fold}: best val auc {best_auc:.4f}, wrote {len(sub)} test preds")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
