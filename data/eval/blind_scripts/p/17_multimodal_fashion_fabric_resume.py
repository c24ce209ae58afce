"""New-product first-month sales prediction from product photo + catalogue attributes.

ConvNeXt-tiny image features + categorical/numeric attributes -> log(sales).
Lightning Fabric loop; jobs get pre-empted on the shared cluster, so it resumes
from the last checkpoint automatically.

    fabric run --accelerator cuda --devices 4 --precision bf16-mixed \
        17_multimodal_fashion_fabric_resume.py --root /data/visuelle --resume auto
"""
import argparse
import glob
import os
import time

import numpy as np
import pandas as pd
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.fabric import Fabric
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms as T

CATS = ["category", "color", "fabric", "season", "price_band"]
NUMS = ["price", "discount", "n_colors", "release_week"]


class ProductSet(Dataset):
    def __init__(self, df, img_root, vocab, stats, train):
        self.paths = [os.path.join(img_root, p) for p in df["image_path"]]
        self.cat = np.stack([df[c].map(vocab[c]).fillna(0).astype(np.int64).values for c in CATS], 1)
        self.num = ((df[NUMS] - stats[0]) / stats[1]).values.astype(np.float32)
        self.y = np.log1p(df["sales_4w"].values.astype(np.float32))
        aug = [T.RandomResizedCrop(224, scale=(0.8, 1.0)), T.RandomHorizontalFlip()] if train \
            else [T.Resize(236), T.CenterCrop(224)]
        self.tf = T.Compose(aug + [T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return (self.tf(Image.open(self.paths[i]).convert("RGB")), torch.from_numpy(self.cat[i]),
                torch.from_numpy(self.num[i]), torch.tensor(self.y[i]))


class SalesNet(nn.Module):
    def __init__(self, cards, n_num, backbone="convnext_tiny"):
        super().__init__()
        self.img = timm.create_model(backbone, pretrained=True, num_classes=0)
        self.embs = nn.ModuleList([nn.Embedding(c, 32) for c in cards])
        self.num = nn.Sequential(nn.Linear(n_num, 64), nn.GELU())
        d = self.img.num_features + 32 * len(cards) + 64
        self.head = nn.Sequential(nn.Linear(d, 512), nn.GELU(), nn.Dropout(0.2), nn.Linear(512, 1))

    def forward(self, img, cat, num):
        e = torch.cat([emb(cat[:, i]) for i, emb in enumerate(self.embs)], 1)
        return self.head(torch.cat([self.img(img), e, self.num(num)], 1)).squeeze(1)


def find_latest(ckpt_dir):
    files = sorted(glob.glob(os.path.join(ckpt_dir, "epoch*.ckpt")), key=os.path.getmtime)
    return files[-1] if files else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="data/visuelle")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--bs", type=int, default=48)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--ckpt-dir", default="ckpt/fashion")
    ap.add_argument("--resume", default="auto", help="'auto', a path, or 'none'")
    args = ap.parse_args()

    fabric = Fabric()
    fabric.launch()
    fabric.seed_everything(21)

    df = pd.read_csv(os.path.join(args.root, "products.csv"))
    df[CATS] = df[CATS].astype(str)
    tr, va = df[df["release_year"] < 2019], df[df["release_year"] == 2019]
    vocab = {c: {v: i + 1 for i, v in enumerate(sorted(tr[c].unique()))} for c in CATS}
    stats = (tr[NUMS].mean(), tr[NUMS].std() + 1e-6)
    train_dl = DataLoader(ProductSet(tr, args.root, vocab, stats, True), batch_size=args.bs, shuffle=True,
                          num_workers=8, pin_memory=True, drop_last=True)
    val_dl = DataLoader(ProductSet(va, args.root, vocab, stats, False), batch_size=args.bs * 2,
                        num_workers=8, pin_memory=True)

    model = SalesNet([len(vocab[c]) + 1 for c in CATS], len(NUMS))
    head_params = [p for n, p in model.named_parameters() if not n.startswith("img.")]
    opt = torch.optim.AdamW([{"params": model.img.parameters(), "lr": args.lr * 0.2},
                             {"params": head_params, "lr": args.lr}], weight_decay=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs, eta_min=1e-6)

    start_epoch, best = 0, float("inf")
    resume_path = find_latest(args.ckpt_dir) if args.resume == "auto" else (
        None if args.resume == "none" else args.resume)
    ckpt = None
    if resume_path:
        ckpt = torch.load(resume_path)
        model.load_state_dict(ckpt["model"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]

    model, opt = fabric.setup(model, opt)
    if ckpt is not None:
        # optimizer state has to land on the device the params now live on
        opt.load_state_dict(ckpt["opt"])
        fabric.print(f"resumed from {resume_path} at epoch {start_epoch}")
    train_dl, val_dl = fabric.setup_dataloaders(train_dl, val_dl)

    for epoch in range(start_epoch, args.epochs):
        t0 = time.time()
        model.train()
        for i, (img, cat, num, y) in enumerate(train_dl):
            loss = F.huber_loss(model(img, cat, num), y, delta=1.0)
            opt.zero_grad(set_to_none=True)
            fabric.backward(loss)
            opt.step()
            if i % 100 == 0:
                fabric.print(f"ep {epoch} it {i} loss {loss.item():.4f}")
        sched.step()

        model.eval()
        err = torch.zeros(2, device=fabric.device)
        with torch.no_grad():
            for img, cat, num, y in val_dl:
                pred = model(img, cat, num)
                err[0] += (torch.expm1(pred.float()) - torch.expm1(y)).abs().sum()
                err[1] += y.numel()
        err = fabric.all_reduce(err, reduce_op="sum")
        val_mae = (err[0] / err[1]).item()
        fabric.print(f"epoch {epoch} val MAE (units) {val_mae:.2f}  [{time.time() - t0:.0f}s]")

        best = min(best, val_mae)
        fabric.save(os.path.join(args.ckpt_dir, f"epoch{epoch:03d}.ckpt"),
                    {"model": model, "opt": opt, "sched": sched, "epoch": epoch, "best": best})


if __name__ == "__main__":
    main()
