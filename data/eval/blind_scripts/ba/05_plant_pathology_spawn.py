# ---
# Plant Pathology 2021 - FGVC8
# converted from the kaggle notebook (jupytext) so it can run on the 4-GPU box:
#   python 05_plant_pathology_spawn.py
# ---
import os
import random
import time
import warnings

import albumentations as A
import cv2
import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from albumentations.pytorch import ToTensorV2
from sklearn.metrics import f1_score
from timm.utils import ModelEmaV2
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

warnings.filterwarnings("ignore")

# %% config
CFG = {
    "img_dir": "/data/plant-pathology-2021/train_images_512",
    "csv": "/data/plant-pathology-2021/train_folds.csv",
    "out_dir": "./pp21_effv2s",
    "arch": "tf_efficientnetv2_s_in21k",
    "img_size": 512,
    "batch_size": 24,
    "epochs": 15,
    "lr": 2e-4,
    "weight_decay": 1e-5,
    "ema_decay": 0.9997,
    "folds": [0, 1, 2, 3, 4],
    "num_workers": 6,
    "seed": 42,
    "threshold": 0.4,
    "master_port": "29533",
}
LABELS = ["complex", "frog_eye_leaf_spot", "healthy", "powdery_mildew", "rust", "scab"]


def seed_torch(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


# %% data
class LeafDataset(Dataset):
    def __init__(self, df, img_dir, tfm):
        self.images = df["image"].values
        self.targets = df[LABELS].values.astype(np.float32)
        self.img_dir = img_dir
        self.tfm = tfm

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        img = cv2.cvtColor(cv2.imread(os.path.join(self.img_dir, self.images[i])), cv2.COLOR_BGR2RGB)
        return self.tfm(image=img)["image"], self.targets[i], i


def make_tfms(size):
    train = A.Compose([
        A.RandomResizedCrop(size, size, scale=(0.6, 1.0)),
        A.Flip(),
        A.ShiftScaleRotate(shift_limit=0.1, scale_limit=0.1, rotate_limit=30, p=0.5),
        A.OneOf([A.MotionBlur(), A.GaussianBlur(), A.GaussNoise()], p=0.3),
        A.ColorJitter(0.2, 0.2, 0.2, 0.05, p=0.5),
        A.Normalize(),
        ToTensorV2(),
    ])
    valid = A.Compose([A.Resize(size, size), A.Normalize(), ToTensorV2()])
    return train, valid


# %% train / valid
def train_epoch(model, ema, loader, opt, sched, scaler, crit, device):
    model.train()
    stats = torch.zeros(2, device=device)
    for x, y, _ in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():
            loss = crit(model(x), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        ema.update(model.module)
        stats += torch.stack([loss.detach() * len(x), torch.tensor(float(len(x)), device=device)])
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item()


@torch.no_grad()
def predict(net, loader, device):
    net.eval()
    idx, out = [], []
    for x, _, i in loader:
        with torch.cuda.amp.autocast():
            p = torch.sigmoid(net(x.to(device)).float())
        out.append(p.cpu().numpy())
        idx.append(i.numpy())
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (np.concatenate(idx), np.concatenate(out)))
    idx = np.concatenate([a for a, _ in parts])
    out = np.concatenate([b for _, b in parts])
    keep = np.unique(idx, return_index=True)[1]
    return idx[keep], out[keep]


def worker(rank, cfg, world_size):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = cfg["master_port"]
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    seed_torch(cfg["seed"])
    torch.backends.cudnn.benchmark = True

    df = pd.read_csv(cfg["csv"])
    train_tfm, valid_tfm = make_tfms(cfg["img_size"])
    fold_scores = {}
    oof_all = []

    for fold in cfg["folds"]:
        trn = df[df.fold != fold].reset_index(drop=True)
        val = df[df.fold == fold].reset_index(drop=True)
        trn_ds = LeafDataset(trn, cfg["img_dir"], train_tfm)
        val_ds = LeafDataset(val, cfg["img_dir"], valid_tfm)
        trn_sampler = DistributedSampler(trn_ds, world_size, rank, shuffle=True, drop_last=True)
        val_sampler = DistributedSampler(val_ds, world_size, rank, shuffle=False)
        trn_dl = DataLoader(trn_ds, cfg["batch_size"], sampler=trn_sampler, num_workers=cfg["num_workers"],
                            pin_memory=True, drop_last=True, persistent_workers=True)
        val_dl = DataLoader(val_ds, cfg["batch_size"] * 2, sampler=val_sampler, num_workers=cfg["num_workers"])

        model = timm.create_model(cfg["arch"], pretrained=True, num_classes=len(LABELS)).to(device)
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        model = DDP(model, device_ids=[rank])
        ema = ModelEmaV2(model.module, decay=cfg["ema_decay"])

        opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg["lr"], epochs=cfg["epochs"],
                                                    steps_per_epoch=len(trn_dl), pct_start=0.15)
        scaler = torch.cuda.amp.GradScaler()
        crit = nn.BCEWithLogitsLoss()

        best = -1.0
        for epoch in range(cfg["epochs"]):
            trn_sampler.set_epoch(epoch)
            t0 = time.time()
            tl = train_epoch(model, ema, trn_dl, opt, sched, scaler, crit, device)
            idx, probs = predict(ema.module, val_dl, device)
            f1 = f1_score(val[LABELS].values[idx], probs > cfg["threshold"], average="samples")
            if rank == 0:
                print(f"fold {fold} ep {epoch:02d} loss {tl:.4f} ema_f1 {f1:.4f} {time.time() - t0:.0f}s", flush=True)
                if f1 > best:
                    best = f1
                    torch.save(ema.module.state_dict(), os.path.join(cfg["out_dir"], f"{cfg['arch']}_f{fold}.pth"))
                    oof = val.loc[idx, ["image"]].copy()
                    oof[LABELS] = probs
            dist.barrier()
        fold_scores[fold] = best
        if rank == 0:
            oof_all.append(oof)
        del model, ema, opt
        torch.cuda.empty_cache()

    if rank == 0:
        pd.concat(oof_all).to_csv(os.path.join(cfg["out_dir"], "oof.csv"), index=False)
        print("fold F1:", fold_scores, "mean", np.mean(list(fold_scores.values())))
    dist.destroy_process_group()


# %% run
if __name__ == "__main__":
    os.makedirs(CFG["out_dir"], exist_ok=True)
    n_gpus = torch.cuda.device_count()
    print(f"spawning {n_gpus} workers")
    mp.spawn(worker, args=(n_gpus, CFG), nprocs=n_gpus, join=True)
