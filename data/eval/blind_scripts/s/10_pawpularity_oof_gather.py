#!/usr/bin/env python
# PetFinder Pawpularity - swin regression (BCE on score/100), 10 folds, OOF kept for stacking
# torchrun --nproc_per_node=4 10_pawpularity_oof_gather.py --fold 0
import os
import sys
import time
import argparse

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.distributed as dist
from torch.utils.data import Dataset, DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
import torchvision.io as tvio
import torchvision.transforms.v2 as T
import timm

META = ["Subject Focus", "Eyes", "Face", "Near", "Action", "Accessory", "Group", "Collage",
        "Human", "Occlusion", "Info", "Blur"]


def get_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/kaggle/input/petfinder-pawpularity-score")
    p.add_argument("--folds_csv", default="train_10folds.csv")
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--model", default="swin_large_patch4_window7_224")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--bs", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--out", default="./pawp_out")
    return p


class PawDS(Dataset):
    def __init__(self, df, root, train):
        self.ids = df.Id.values
        self.meta = df[META].values.astype(np.float32)
        self.y = (df.Pawpularity.values / 100.0).astype(np.float32)
        self.root = root
        if train:
            self.tf = T.Compose([T.RandomResizedCrop(224, scale=(0.8, 1.0), antialias=True),
                                 T.RandomHorizontalFlip(), T.ColorJitter(0.1, 0.1, 0.1)])
        else:
            self.tf = T.Resize((224, 224), antialias=True)
        self.norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        img = tvio.read_image(f"{self.root}/train/{self.ids[i]}.jpg", tvio.ImageReadMode.RGB)
        img = self.norm(self.tf(img).float() / 255.0)
        return img, torch.from_numpy(self.meta[i]), torch.tensor(self.y[i])


class PawNet(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.backbone = timm.create_model(name, pretrained=True, num_classes=0)
        nf = self.backbone.num_features
        self.drop = nn.Dropout(0.1)
        self.head = nn.Sequential(nn.Linear(nf + len(META), 128), nn.GELU(), nn.Linear(128, 1))

    def forward(self, x, meta):
        f = self.drop(self.backbone(x))
        return self.head(torch.cat([f, meta], 1)).squeeze(1)


@torch.no_grad()
def predict_local(model, loader, device):
    model.eval()
    out = []
    for x, m, _ in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            out.append(model(x.to(device), m.to(device)).sigmoid().float())
    return torch.cat(out) * 100.0


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    df = pd.read_csv(os.path.join(args.root, args.folds_csv))
    trn = df[df.fold != args.fold].reset_index(drop=True)
    val = df[df.fold == args.fold].reset_index(drop=True)
    ds_tr = PawDS(trn, args.root, True)
    ds_va = PawDS(val, args.root, False)
    # contiguous chunks of the validation fold per rank, so the gathered OOF keeps row order
    my_rows = np.array_split(np.arange(len(ds_va)), world)[rank]
    dl_va = DataLoader(Subset(ds_va, my_rows), batch_size=args.bs * 4, shuffle=False,
                       num_workers=4, pin_memory=True)
    sampler = DistributedSampler(ds_tr, shuffle=True, drop_last=True)
    dl_tr = DataLoader(ds_tr, batch_size=args.bs, sampler=sampler, num_workers=6,
                       pin_memory=True, drop_last=True)

    net = PawNet(args.model).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW([
        {"params": net.backbone.parameters(), "lr": args.lr},
        {"params": list(net.head.parameters()), "lr": args.lr * 50},
    ], weight_decay=1e-6)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=len(dl_tr) * args.epochs,
                                                       eta_min=1e-7)
    scaler = torch.cuda.amp.GradScaler()
    bce = nn.BCEWithLogitsLoss()
    y_val = torch.tensor(val.Pawpularity.values, dtype=torch.float32, device=device)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_rmse = 1e9
    for ep in range(args.epochs):
        sampler.set_epoch(ep)
        model.train()
        t0 = time.time()
        for step, (x, m, y) in enumerate(dl_tr):
            x, m, y = x.to(device), m.to(device), y.to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = bce(model(x, m), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            scaler.step(opt)
            scaler.update()
            sched.step()

        local = predict_local(net, dl_va, device)
        chunks = [torch.zeros_like(local) for _ in range(world)]
        dist.all_gather(chunks, local)
        preds = torch.cat(chunks)
        rmse = torch.sqrt(((preds - y_val) ** 2).mean()).item()

        if rank == 0:
            print(f"fold {args.fold} epoch {ep} rmse {rmse:.4f} ({time.time() - t0:.0f}s)",
                  flush=True)
            if rmse < best_rmse:
                best_rmse = rmse
                torch.save(net.state_dict(), f"{args.out}/{args.model}_f{args.fold}.pth")
                oof = val[["Id", "Pawpularity", "fold"]].copy()
                oof["pred"] = preds.cpu().numpy()
                oof.to_csv(f"{args.out}/oof_f{args.fold}.csv", index=False)
        dist.barrier()

    if rank == 0:
        print(f"best rmse fold {args.fold}: {best_rmse:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
