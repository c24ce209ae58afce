"""
Weakly-supervised localisation on ChestX-ray14: DenseNet-121 features + class-wise attention
pooling. Trained with image-level labels only; the attention maps are scored against the 984
radiologist bounding boxes (pointing game / IoBB).

Runs on the lab server with nn.DataParallel:
    CUDA_VISIBLE_DEVICES=0,1,2,3 python 20_dp_attention_pool_localization.py --data /data/nih_cxr14
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from sklearn.metrics import roc_auc_score
from torch.utils.data import DataLoader, Dataset
from torchvision import models, transforms

CLASSES = ["Atelectasis", "Cardiomegaly", "Effusion", "Infiltration", "Mass", "Nodule", "Pneumonia",
           "Pneumothorax", "Consolidation", "Edema", "Emphysema", "Fibrosis", "Pleural_Thickening", "Hernia"]
BBOX_CLASSES = {"Atelectasis", "Cardiomegaly", "Effusion", "Infiltrate", "Mass", "Nodule", "Pneumonia", "Pneumothorax"}


class ClassAttentionPool(nn.Module):
    """One spatial attention map per class; logits are attention-weighted sums of per-location scores."""

    def __init__(self, in_ch, n_cls):
        super().__init__()
        self.att = nn.Conv2d(in_ch, n_cls, 1)
        self.cls = nn.Conv2d(in_ch, n_cls, 1)
        self.attn_map = None

    def forward(self, feats):
        a = self.att(feats)                                   # B x C x h x w
        b, c, h, w = a.shape
        a = torch.softmax(a.view(b, c, -1), dim=-1).view(b, c, h, w)
        self.attn_map = a.detach()
        return (a * self.cls(feats)).sum(dim=(2, 3))


class AttnDenseNet(nn.Module):
    def __init__(self, n_cls):
        super().__init__()
        self.features = models.densenet121(weights=models.DenseNet121_Weights.IMAGENET1K_V1).features
        self.pool = ClassAttentionPool(1024, n_cls)

    def forward(self, x):
        return self.pool(F.relu(self.features(x)))


class CXR14(Dataset):
    def __init__(self, root, names, labels, tf):
        self.root, self.names, self.labels, self.tf = root, names, labels, tf

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.root, "images", self.names[i])).convert("RGB")
        return self.tf(img), torch.from_numpy(self.labels[i]), i


def load_split(root, list_name):
    df = pd.read_csv(os.path.join(root, "Data_Entry_2017.csv"))
    names = set(open(os.path.join(root, list_name)).read().split())
    df = df[df["Image Index"].isin(names)].reset_index(drop=True)
    y = np.stack([df["Finding Labels"].str.contains(c).values for c in CLASSES], 1).astype(np.float32)
    return df["Image Index"].tolist(), y


def pointing_game(model, root, tf, device, size):
    """Fraction of boxes whose class attention peak falls inside the box."""
    boxes = pd.read_csv(os.path.join(root, "BBox_List_2017.csv"))
    model.eval()
    hits, total = 0, 0
    with torch.no_grad():
        for _, r in boxes.iterrows():
            label = "Infiltration" if r["Finding Label"] == "Infiltrate" else r["Finding Label"]
            img = Image.open(os.path.join(root, "images", r["Image Index"])).convert("RGB")
            w0, h0 = img.size
            model(tf(img).unsqueeze(0).to(device))
            amap = model.module.pool.attn_map[0, CLASSES.index(label)]
            amap = F.interpolate(amap[None, None], size=(size, size), mode="bilinear", align_corners=False)[0, 0]
            yy, xx = np.unravel_index(amap.argmax().item(), (size, size))
            px, py = xx * w0 / size, yy * h0 / size
            x, y, bw, bh = r["Bbox [x"], r["y"], r["w"], r["h]"]
            hits += int(x <= px <= x + bw and y <= py <= y + bh)
            total += 1
    model.train()
    return hits / max(total, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/attnpool_dn121")
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=64, help="total over all visible GPUs")
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--workers", type=int, default=16)
    args = ap.parse_args()

    device = torch.device("cuda")
    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([transforms.Resize((args.size, args.size)), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), norm])
    eval_tf = transforms.Compose([transforms.Resize((args.size, args.size)), transforms.ToTensor(), norm])

    tr_names, tr_y = load_split(args.data, "train_val_list.txt")
    te_names, te_y = load_split(args.data, "test_list.txt")
    train_dl = DataLoader(CXR14(args.data, tr_names, tr_y, train_tf), batch_size=args.batch_size, shuffle=True,
                          num_workers=args.workers, pin_memory=True, drop_last=True)
    test_dl = DataLoader(CXR14(args.data, te_names, te_y, eval_tf), batch_size=args.batch_size, shuffle=False,
                         num_workers=args.workers, pin_memory=True)

    model = AttnDenseNet(len(CLASSES)).to(device)
    model = nn.DataParallel(model)
    print(f"using {torch.cuda.device_count()} GPUs")

    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.1, patience=1)
    os.makedirs(args.out, exist_ok=True)
    best = 0.0

    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for it, (x, y, _) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if it % 100 == 0:
                print(f"epoch {epoch} it {it}/{len(train_dl)} loss {loss.item():.4f} {time.time() - t0:.0f}s",
                      flush=True)

        model.eval()
        probs = []
        with torch.no_grad():
            for x, _, _ in test_dl:
                probs.append(torch.sigmoid(model(x.to(device))).cpu())
        p = torch.cat(probs).numpy()
        aucs = [roc_auc_score(te_y[:, k], p[:, k]) for k in range(len(CLASSES))]
        mauc = float(np.mean(aucs))
        pg = pointing_game(model, args.data, eval_tf, device, args.size)
        sched.step(mauc)
        print(f"epoch {epoch}: test mAUC {mauc:.4f} pointing game {pg:.3f}", flush=True)

        torch.save({"model": model.module.state_dict(), "epoch": epoch, "mauc": mauc, "pg": pg},
                   os.path.join(args.out, "last.pth"))
        if mauc > best:
            best = mauc
            torch.save(model.module.state_dict(), os.path.join(args.out, "best.pth"))


if __name__ == "__main__":
    main()
