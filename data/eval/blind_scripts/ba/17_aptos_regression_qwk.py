"""APTOS 2019 Blindness Detection - regression head + optimized QWK thresholds.

Pretrain on 2015 DR data is done separately; this script fine-tunes on APTOS 5 folds.
    torchrun --nproc_per_node=4 17_aptos_regression_qwk.py --arch tf_efficientnet_b4_ns --size 456
"""
import argparse
import functools
import os
import time

import cv2
import numpy as np
import pandas as pd
import scipy.optimize
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import cohen_kappa_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T


def get_parser():
    parser = argparse.ArgumentParser(description="aptos finetune")
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--data", default="/data/aptos2019-blindness-detection")
    parser.add_argument("--pretrained-ckpt", default="./dr2015/b4_456_pretrain.pth")
    parser.add_argument("--arch", default="tf_efficientnet_b4_ns")
    parser.add_argument("--size", type=int, default=456)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--out", default="./aptos_b4")
    return parser


def ben_graham(img, size, sigma=10):
    img = cv2.resize(img, (size, size))
    img = cv2.addWeighted(img, 4, cv2.GaussianBlur(img, (0, 0), sigma), -4, 128)
    mask = np.zeros(img.shape, np.uint8)
    cv2.circle(mask, (size // 2, size // 2), int(size * 0.48), (1, 1, 1), -1)
    return img * mask + 128 * (1 - mask)


class FundusDS(Dataset):
    def __init__(self, df, img_dir, size, train):
        self.codes, self.y = df.id_code.values, df.diagnosis.values.astype(np.float32)
        self.img_dir, self.size = img_dir, size
        aug = [T.RandomHorizontalFlip(), T.RandomVerticalFlip(), T.RandomRotation(180),
               T.ColorJitter(0.2, 0.2)] if train else []
        self.tf = T.Compose([T.ToPILImage()] + aug + [T.ToTensor(), T.Normalize([0.5] * 3, [0.5] * 3)])

    def __len__(self):
        return len(self.codes)

    def __getitem__(self, i):
        img = cv2.cvtColor(cv2.imread(os.path.join(self.img_dir, f"{self.codes[i]}.png")), cv2.COLOR_BGR2RGB)
        return self.tf(ben_graham(img, self.size)), self.y[i], i


class OptimizedRounder:
    def __init__(self):
        self.coef = [0.5, 1.5, 2.5, 3.5]

    @staticmethod
    def _apply(x, coef):
        return np.digitize(x, coef)

    def _loss(self, coef, x, y):
        return -cohen_kappa_score(y, self._apply(x, np.sort(coef)), weights="quadratic")

    def fit(self, x, y):
        self.coef = np.sort(scipy.optimize.minimize(functools.partial(self._loss, x=x, y=y), self.coef,
                                                    method="nelder-mead").x)
        return self

    def predict(self, x):
        return self._apply(x, self.coef)


@torch.no_grad()
def predict(model, loader, device, n):
    model.eval()
    idx, out = [], []
    for x, _, i in loader:
        x = x.to(device)
        with torch.cuda.amp.autocast():
            p = (model(x) + model(x.flip(3))).float().squeeze(1) / 2
        out.append(p.cpu().numpy())
        idx.append(i.numpy())
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (np.concatenate(idx), np.concatenate(out)))
    res = np.zeros(n, np.float32)
    for i, p in parts:
        res[i] = p
    return res


def main():
    args = get_parser().parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    torch.manual_seed(0)
    np.random.seed(0)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world size {world}")

    df = pd.read_csv(os.path.join(args.data, "train_folds.csv"))
    img_dir = os.path.join(args.data, "train_images")
    oof = np.zeros(len(df), np.float32)

    for fold in range(args.folds):
        tr_mask, va_mask = (df.fold != fold).values, (df.fold == fold).values
        trn, val = df[tr_mask].reset_index(drop=True), df[va_mask].reset_index(drop=True)
        trn_ds, val_ds = FundusDS(trn, img_dir, args.size, True), FundusDS(val, img_dir, args.size, False)
        sampler = DistributedSampler(trn_ds, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
        trn_dl = DataLoader(trn_ds, batch_size=args.batch_size, sampler=sampler, num_workers=6, pin_memory=True,
                            drop_last=True)
        val_dl = DataLoader(val_ds, batch_size=args.batch_size * 2,
                            sampler=DistributedSampler(val_ds, num_replicas=world, rank=rank, shuffle=False),
                            num_workers=6)

        model = timm.create_model(args.arch, pretrained=False, num_classes=1)
        model.load_state_dict(torch.load(args.pretrained_ckpt, map_location="cpu"))
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
        model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
        scaler = torch.cuda.amp.GradScaler()
        crit = nn.SmoothL1Loss()

        best_k, best_pred = -1.0, None
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            t0 = time.time()
            for x, y, _ in trn_dl:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with torch.cuda.amp.autocast():
                    loss = crit(model(x).squeeze(1).float(), y)
                opt.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            sched.step()
            pred = predict(model.module, val_dl, device, len(val_ds))
            k = cohen_kappa_score(val.diagnosis.values, OptimizedRounder._apply(pred, [0.5, 1.5, 2.5, 3.5]),
                                  weights="quadratic")
            if k > best_k:
                best_k, best_pred = k, pred
                if rank == 0:
                    torch.save(model.module.state_dict(), os.path.join(args.out, f"{args.arch}_f{fold}.pth"))
            if rank == 0:
                print(f"fold {fold} epoch {epoch} qwk {k:.4f} best {best_k:.4f} ({time.time() - t0:.0f}s)", flush=True)
            dist.barrier()
        oof[va_mask] = best_pred
        del model, opt
        torch.cuda.empty_cache()

    if rank == 0:
        rounder = OptimizedRounder().fit(oof, df.diagnosis.values)
        qwk = cohen_kappa_score(df.diagnosis.values, rounder.predict(oof), weights="quadratic")
        df.assign(oof=oof).to_csv(os.path.join(args.out, "oof.csv"), index=False)
        np.save(os.path.join(args.out, "thresholds.npy"), rounder.coef)
        print(f"OOF qwk with optimized thresholds {qwk:.4f}  coef {np.round(rounder.coef, 3)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
