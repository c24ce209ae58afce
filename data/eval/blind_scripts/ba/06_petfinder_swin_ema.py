"""PetFinder.my - Pawpularity Contest.

Swin-L 224 regressor (BCE on score/100), 10 folds, model EMA, early stopping, fold-ensemble test
prediction with hflip TTA.  torchrun --nproc_per_node=8 06_petfinder_swin_ema.py
"""
import argparse
import copy
import os
import time

import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision.transforms as T
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/petfinder-pawpularity-score")
    p.add_argument("--out", default="./out/swin_l_224")
    p.add_argument("--arch", default="swin_large_patch4_window7_224")
    p.add_argument("--folds", type=int, default=10)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--bs", type=int, default=8, help="per-gpu batch")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--ema", type=float, default=0.998)
    p.add_argument("--patience", type=int, default=2)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
TRAIN_TF = T.Compose([T.RandomResizedCrop(224, scale=(0.8, 1.0)), T.RandomHorizontalFlip(),
                      T.ColorJitter(0.1, 0.1, 0.1), T.ToTensor(), T.Normalize(MEAN, STD)])
VALID_TF = T.Compose([T.Resize((224, 224)), T.ToTensor(), T.Normalize(MEAN, STD)])


class PetDS(Dataset):
    def __init__(self, df, img_dir, tf):
        self.ids = df.Id.values
        self.y = (df.Pawpularity.values / 100.0).astype(np.float32) if "Pawpularity" in df else np.zeros(len(df), np.float32)
        self.img_dir, self.tf = img_dir, tf

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.img_dir, f"{self.ids[i]}.jpg")).convert("RGB")
        return self.tf(img), self.y[i], i


class ModelEMA:
    def __init__(self, model, decay):
        self.module = copy.deepcopy(model).eval()
        self.decay = decay
        for p in self.module.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model):
        for e, m in zip(self.module.state_dict().values(), model.state_dict().values()):
            if e.dtype.is_floating_point:
                e.mul_(self.decay).add_(m.detach(), alpha=1 - self.decay)
            else:
                e.copy_(m)


def sharded_predict(model, ds, bs, device, tta=False):
    """Each rank predicts its shard, every rank gets all predictions back in dataset order."""
    sampler = DistributedSampler(ds, shuffle=False)
    loader = DataLoader(ds, batch_size=bs, sampler=sampler, num_workers=4, pin_memory=True)
    model.eval()
    idx, out = [], []
    with torch.no_grad(), torch.cuda.amp.autocast():
        for x, _, i in loader:
            x = x.to(device, non_blocking=True)
            p = torch.sigmoid(model(x).squeeze(-1).float())
            if tta:
                p = 0.5 * (p + torch.sigmoid(model(torch.flip(x, [3])).squeeze(-1).float()))
            out.append(p.cpu().numpy())
            idx.append(i.numpy())
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (np.concatenate(idx), np.concatenate(out)))
    full = np.zeros(len(ds), dtype=np.float32)
    for i, p in gathered:
        full[i] = p  # padded duplicates just overwrite the same slot
    return full * 100.0


def rmse(a, b):
    return float(np.sqrt(np.mean((a - b) ** 2)))


def train_fold(fold, df, args, rank, local_rank):
    device = torch.device("cuda", local_rank)
    img_dir = os.path.join(args.data, "train")
    trn, val = df[df.fold != fold].reset_index(drop=True), df[df.fold == fold].reset_index(drop=True)
    trn_ds, val_ds = PetDS(trn, img_dir, TRAIN_TF), PetDS(val, img_dir, VALID_TF)
    sampler = DistributedSampler(trn_ds, shuffle=True, seed=args.seed + fold, drop_last=True)
    loader = DataLoader(trn_ds, batch_size=args.bs, sampler=sampler, num_workers=6, pin_memory=True, drop_last=True)

    # only rank 0 pulls the pretrained weights; DDP broadcasts rank 0's parameters at construction
    model = timm.create_model(args.arch, pretrained=(rank == 0), num_classes=1).to(device)
    model = DDP(model, device_ids=[local_rank])
    ema = ModelEMA(model.module, args.ema)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-6)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader), eta_min=1e-7)
    scaler = torch.cuda.amp.GradScaler()
    crit = nn.BCEWithLogitsLoss()

    best, wait, ckpt = np.inf, 0, os.path.join(args.out, f"fold{fold}.pth")
    best_oof = None
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y, _ in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.cuda.amp.autocast():
                loss = crit(model(x).squeeze(-1), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            ema.update(model.module)

        # every rank gets the same full prediction vector, so the early-stopping decision is identical
        preds = sharded_predict(ema.module, val_ds, args.bs * 4, device)
        score = rmse(val.Pawpularity.values, preds)
        if score < best:
            best, wait, best_oof = score, 0, preds
            if rank == 0:
                torch.save(ema.module.state_dict(), ckpt)
        else:
            wait += 1
        if rank == 0:
            print(f"fold {fold} epoch {epoch} ema rmse {score:.4f} best {best:.4f} ({time.time() - t0:.0f}s)", flush=True)
        dist.barrier()
        if wait >= args.patience:
            break

    val = val.assign(pred=best_oof)
    return best, val[["Id", "Pawpularity", "pred"]]


def predict_test(args, rank, local_rank):
    device = torch.device("cuda", local_rank)
    test = pd.read_csv(os.path.join(args.data, "test.csv"))
    ds = PetDS(test, os.path.join(args.data, "test"), VALID_TF)
    preds = np.zeros(len(test))
    for fold in range(args.folds):
        model = timm.create_model(args.arch, pretrained=False, num_classes=1)
        model.load_state_dict(torch.load(os.path.join(args.out, f"fold{fold}.pth"), map_location="cpu"))
        preds += sharded_predict(model.to(device), ds, args.bs * 4, device, tta=True) / args.folds
    if rank == 0:
        test[["Id"]].assign(Pawpularity=preds).to_csv(os.path.join(args.out, "submission.csv"), index=False)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    os.makedirs(args.out, exist_ok=True)

    df = pd.read_csv(os.path.join(args.data, "train_10folds.csv"))
    oofs, scores = [], []
    for fold in range(args.folds):
        s, oof = train_fold(fold, df, args, rank, local_rank)
        scores.append(s)
        oofs.append(oof)
        torch.cuda.empty_cache()

    if rank == 0:
        oof = pd.concat(oofs, ignore_index=True)
        oof.to_csv(os.path.join(args.out, "oof.csv"), index=False)
        print("fold rmse", np.round(scores, 4), "OOF rmse", rmse(oof.Pawpularity.values, oof.pred.values))
    dist.barrier()
    predict_test(args, rank, local_rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
