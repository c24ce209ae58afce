"""PetFinder Pawpularity - swin_base, BCE on score/100 + auxiliary meta-feature head.

The 12 binary photo-metadata columns are predicted by an auxiliary head during the first
epochs (acts as a regulariser), then the aux loss is switched off.

    torchrun --nproc_per_node=4 17_petfinder_swin_aux_meta.py --fold 0 --aux_epochs 2
"""
import argparse
import os

import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T

META = ["Subject Focus", "Eyes", "Face", "Near", "Action", "Accessory",
        "Group", "Collage", "Human", "Occlusion", "Info", "Blur"]


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default="input/train_10folds.csv")
    ap.add_argument("--img_dir", default="input/train")
    ap.add_argument("--backbone", default="swin_base_patch4_window7_224")
    ap.add_argument("--weights", default="input/timm-pretrained/swin_base_patch4_window7_224.pth")
    ap.add_argument("--fold", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--aux_epochs", type=int, default=2)
    ap.add_argument("--aux_weight", type=float, default=0.3)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--out", default="models")
    return ap.parse_args()


class PawDataset(Dataset):
    def __init__(self, df, img_dir, tf):
        self.paths = [os.path.join(img_dir, f"{i}.jpg") for i in df.Id]
        self.meta = df[META].values.astype(np.float32)
        self.y = (df.Pawpularity.values / 100.0).astype(np.float32)
        self.tf = tf

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = self.tf(Image.open(self.paths[i]).convert("RGB"))
        return img, torch.tensor(self.y[i]), torch.from_numpy(self.meta[i])


class PawModel(nn.Module):
    def __init__(self, backbone, weights):
        super().__init__()
        self.backbone = timm.create_model(backbone, pretrained=False, num_classes=0)
        if weights and os.path.exists(weights):
            sd = torch.load(weights, map_location="cpu")
            self.backbone.load_state_dict({k: v for k, v in sd.items() if not k.startswith("head")},
                                          strict=False)
        d = self.backbone.num_features
        self.dropout = nn.Dropout(0.2)
        self.score_head = nn.Linear(d, 1)
        self.meta_head = nn.Sequential(nn.Linear(d, 128), nn.GELU(), nn.Linear(128, len(META)))

    def forward(self, x):
        f = self.dropout(self.backbone(x))
        return self.score_head(f).squeeze(-1), self.meta_head(f)


@torch.no_grad()
def rmse_stats(model, loader, device):
    model.eval()
    se = torch.zeros(2, device=device, dtype=torch.float64)
    for x, y, _ in loader:
        x, y = x.to(device), y.to(device)
        score, _ = model(x)
        se[0] += ((torch.sigmoid(score) * 100 - y * 100) ** 2).sum()
        se[1] += y.numel()
    return se


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    tr_tf = T.Compose([T.RandomResizedCrop(224, scale=(0.7, 1.0)), T.RandomHorizontalFlip(),
                       T.ColorJitter(0.1, 0.1, 0.1), T.ToTensor(), norm])
    va_tf = T.Compose([T.Resize((224, 224)), T.ToTensor(), norm])
    df = pd.read_csv(args.csv)
    tr_ds = PawDataset(df[df.kfold != args.fold], args.img_dir, tr_tf)
    va_ds = PawDataset(df[df.kfold == args.fold], args.img_dir, va_tf)
    sampler = DistributedSampler(tr_ds, shuffle=True, drop_last=True)
    tr_dl = DataLoader(tr_ds, batch_size=args.bs, sampler=sampler, num_workers=4, pin_memory=True,
                       drop_last=True)
    va_dl = DataLoader(Subset(va_ds, range(rank, len(va_ds), world)), batch_size=args.bs * 2,
                       num_workers=4)

    model = PawModel(args.backbone, args.weights).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-6)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=len(tr_dl) * args.epochs, eta_min=1e-7)
    scaler = torch.cuda.amp.GradScaler()
    bce = nn.BCEWithLogitsLoss()

    best = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        aux_w = args.aux_weight if epoch < args.aux_epochs else 0.0
        for it, (x, y, meta) in enumerate(tr_dl):
            x, y, meta = x.to(device), y.to(device), meta.to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                score, meta_logits = model(x)
                loss = bce(score.float(), y)
                if aux_w > 0:
                    loss = loss + aux_w * bce(meta_logits.float(), meta)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            if rank == 0 and it % 50 == 0:
                print(f"ep {epoch} it {it}/{len(tr_dl)} loss {loss.item():.4f} aux_w {aux_w}", flush=True)

        se = rmse_stats(model.module, va_dl, device)
        dist.all_reduce(se)
        rmse = torch.sqrt(se[0] / se[1]).item()
        if rank == 0:
            print(f"fold {args.fold} epoch {epoch} RMSE {rmse:.4f}", flush=True)
            if rmse < best:
                best = rmse
                os.makedirs(args.out, exist_ok=True)
                torch.save(model.module.state_dict(), os.path.join(args.out, f"swin_fold{args.fold}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
