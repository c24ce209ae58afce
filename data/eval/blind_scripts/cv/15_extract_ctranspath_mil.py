"""Extract tile embeddings for a cohort (sharded over GPUs), then train a gated-ABMIL head.

Stage 1 reads tiles pre-cut by the tiling step (<tile_dir>/<slide_id>/*.jpg, file name
"<x>_<y>.jpg") and writes <feat_dir>/<slide_id>.h5 ('feats', 'coords').  Slides whose
features already exist are skipped, so a re-run resumes where the last one stopped.
Stage 2 trains on whatever feature files are present.

    torchrun --nproc_per_node=8 15_extract_ctranspath_mil.py --tile_dir /tiles/lusc_luad --feat_dir /feats/lung
"""
import argparse
import glob
import os
from datetime import timedelta

import h5py
import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import StratifiedGroupKFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tile_dir", required=True)
    ap.add_argument("--feat_dir", required=True)
    ap.add_argument("--labels", default="meta/nsclc_labels.csv")  # patient_id, slide_id, subtype
    ap.add_argument("--encoder_ckpt", default="weights/ctranspath.pth")
    ap.add_argument("--fold", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--out", default="runs/nsclc_abmil")
    ap.add_argument("--seed", type=int, default=5)
    return ap.parse_args()


class TileFolder(Dataset):
    tf = transforms.Compose([transforms.Resize(224), transforms.ToTensor(),
                             transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __init__(self, paths):
        self.paths = paths

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        p = self.paths[i]
        x, y = os.path.splitext(os.path.basename(p))[0].split("_")
        return self.tf(Image.open(p).convert("RGB")), torch.tensor([int(x), int(y)])


def load_encoder(ckpt, device):
    enc = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, num_classes=0)
    state = torch.load(ckpt, map_location="cpu")
    enc.load_state_dict(state.get("model", state), strict=False)
    return enc.to(device).eval()


@torch.no_grad()
def extract(args, slide_ids, rank, world, device):
    enc = load_encoder(args.encoder_ckpt, device)
    os.makedirs(args.feat_dir, exist_ok=True)
    for sid in slide_ids[rank::world]:
        out = os.path.join(args.feat_dir, f"{sid}.h5")
        if os.path.exists(out):
            continue
        tiles = sorted(glob.glob(os.path.join(args.tile_dir, sid, "*.jpg")))
        if not tiles:
            continue
        dl = DataLoader(TileFolder(tiles), batch_size=256, num_workers=8, pin_memory=True)
        feats, coords = [], []
        for img, xy in dl:
            with torch.autocast("cuda", dtype=torch.float16):
                feats.append(enc(img.to(device, non_blocking=True)).float().cpu())
            coords.append(xy)
        with h5py.File(out, "w") as f:
            f["feats"] = torch.cat(feats).numpy()
            f["coords"] = torch.cat(coords).numpy()
        print(f"[rank {rank}] {sid}: {len(tiles)} tiles", flush=True)
    del enc
    torch.cuda.empty_cache()


class FeatBags(Dataset):
    def __init__(self, df, feat_dir):
        self.df, self.feat_dir = df.reset_index(drop=True), feat_dir

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        r = self.df.iloc[i]
        with h5py.File(os.path.join(self.feat_dir, f"{r.slide_id}.h5"), "r") as f:
            x = torch.from_numpy(f["feats"][:])
        return x, int(r.y), i


class GatedABMIL(nn.Module):
    def __init__(self, d=768, h=256):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Dropout(0.25))
        self.a = nn.Linear(h, 128)
        self.b = nn.Linear(h, 128)
        self.c = nn.Linear(128, 1)
        self.out = nn.Linear(h, 2)

    def forward(self, x):
        h = self.fc(x)
        w = torch.softmax(self.c(torch.tanh(self.a(h)) * torch.sigmoid(self.b(h))), dim=0)
        return self.out((w * h).sum(0, keepdim=True))


@torch.no_grad()
def test(net, loader, device):
    net.eval()
    rows = []
    for x, y, i in loader:
        rows.append((int(i), net(x[0].to(device)).softmax(-1)[0, 1].item(), int(y)))
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, rows)
    d = {i: (p, y) for part in parts for i, p, y in part}
    p, y = np.array([v[0] for v in d.values()]), np.array([v[1] for v in d.values()])
    return roc_auc_score(y, p)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=timedelta(hours=4))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    labels = pd.read_csv(args.labels)
    labels["y"] = (labels.subtype == "LUSC").astype(int)
    extract(args, sorted(labels.slide_id.unique()), rank, world, device)

    have = labels.slide_id.map(lambda s: os.path.exists(os.path.join(args.feat_dir, f"{s}.h5")))
    df = labels[have].reset_index(drop=True)
    if rank == 0:
        print(f"{len(df)}/{len(labels)} slides with features", flush=True)

    cv = StratifiedGroupKFold(n_splits=5, shuffle=True, random_state=args.seed)
    tr_idx, te_idx = list(cv.split(df, df.y, df.patient_id))[args.fold]
    tr_ds, te_ds = FeatBags(df.iloc[tr_idx], args.feat_dir), FeatBags(df.iloc[te_idx], args.feat_dir)
    tr_sampler = DistributedSampler(tr_ds, shuffle=True, seed=args.seed)
    tr_dl = DataLoader(tr_ds, batch_size=1, sampler=tr_sampler, num_workers=4, pin_memory=True)
    te_dl = DataLoader(te_ds, batch_size=1, sampler=DistributedSampler(te_ds, shuffle=False), num_workers=4)

    net = GatedABMIL().to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        s = torch.zeros(2, device=device)
        for x, y, _ in tr_dl:
            loss = F.cross_entropy(model(x[0].to(device, non_blocking=True)), y.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            s += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(s)
        if rank == 0:
            print(f"epoch {epoch}: loss {(s[0] / s[1]).item():.4f}", flush=True)
            torch.save({"epoch": epoch, "model": net.state_dict(), "optimizer": opt.state_dict()},
                       os.path.join(args.out, f"fold{args.fold}_last.pt"))

    auc = test(net, te_dl, device)
    if rank == 0:
        print(f"fold {args.fold} test AUC: {auc:.4f} on {len(te_ds)} slides")
        with open(os.path.join(args.out, "auc.txt"), "a") as f:
            f.write(f"{args.fold}\t{auc:.5f}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
