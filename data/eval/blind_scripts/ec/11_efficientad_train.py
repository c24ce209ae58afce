"""EfficientAD-S (student-teacher + autoencoder) for the blister-pack line.

The PDN teacher was distilled from WRN101 beforehand (teacher_small.pth).
Student predicts the teacher features (hard-mined loss) plus the autoencoder
output; the AE learns logical constraints. Trained per product variant.

    torchrun --nproc_per_node=4 11_efficientad_train.py --train-dir /data/blister/A12/train/good \
        --test-dir /data/blister/A12/test --teacher weights/teacher_small.pth --out runs/A12
"""
import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

OUT_CH = 384
IMG = 256


def pdn_small(out_channels=OUT_CH, padding=False):
    p = 1 if padding else 0
    return nn.Sequential(
        nn.Conv2d(3, 128, 4, padding=3 * p), nn.ReLU(inplace=True), nn.AvgPool2d(2, 2, padding=p),
        nn.Conv2d(128, 256, 4, padding=3 * p), nn.ReLU(inplace=True), nn.AvgPool2d(2, 2, padding=p),
        nn.Conv2d(256, 256, 3, padding=p), nn.ReLU(inplace=True),
        nn.Conv2d(256, out_channels, 4))


def autoencoder(out_channels=OUT_CH):
    def up(c_in, size):
        return [nn.Upsample(size=size, mode="bilinear"), nn.Conv2d(c_in, 64, 4, 1, 2), nn.ReLU(True),
                nn.Dropout(0.2)]
    return nn.Sequential(
        nn.Conv2d(3, 32, 4, 2, 1), nn.ReLU(True), nn.Conv2d(32, 32, 4, 2, 1), nn.ReLU(True),
        nn.Conv2d(32, 64, 4, 2, 1), nn.ReLU(True), nn.Conv2d(64, 64, 4, 2, 1), nn.ReLU(True),
        nn.Conv2d(64, 64, 4, 2, 1), nn.ReLU(True), nn.Conv2d(64, 64, 8),
        *up(64, 3), *up(64, 8), *up(64, 15), *up(64, 32), *up(64, 63), *up(64, 127),
        nn.Upsample(size=56, mode="bilinear"), nn.Conv2d(64, 64, 3, 1, 1), nn.ReLU(True),
        nn.Conv2d(64, out_channels, 3, 1, 1))


class StudentAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.student = pdn_small(2 * OUT_CH)
        self.ae = autoencoder(OUT_CH)

    def forward(self, x, x_aug):
        s = self.student(x)
        s_aug = self.student(x_aug)
        a = self.ae(x_aug)
        return s, s_aug, a


class Folder(Dataset):
    def __init__(self, root, labelled=False):
        self.files = sorted(p for p in Path(root).rglob("*") if p.suffix.lower() in (".png", ".jpg", ".bmp"))
        self.labelled = labelled
        self.base = transforms.Compose([transforms.Resize((IMG, IMG)), transforms.ToTensor(),
                                        transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
        self.ae_aug = transforms.RandomChoice([transforms.ColorJitter(brightness=0.2),
                                               transforms.ColorJitter(contrast=0.2),
                                               transforms.ColorJitter(saturation=0.2)])

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        img = Image.open(self.files[i]).convert("RGB")
        if self.labelled:
            return self.base(img), int(self.files[i].parent.name != "good")
        return self.base(img), self.base(self.ae_aug(img))


@torch.no_grad()
def teacher_channel_stats(teacher, loader, device):
    s = torch.zeros(OUT_CH, device=device, dtype=torch.float64)
    sq = torch.zeros_like(s)
    n = torch.zeros(1, device=device, dtype=torch.float64)
    for x, _ in loader:
        t = teacher(x.to(device)).double()
        s += t.sum(dim=(0, 2, 3))
        sq += (t ** 2).sum(dim=(0, 2, 3))
        n += t.shape[0] * t.shape[2] * t.shape[3]
    for v in (s, sq, n):
        dist.all_reduce(v)
    mean = s / n
    std = (sq / n - mean ** 2).clamp(min=1e-12).sqrt()
    return mean.float()[None, :, None, None], std.float()[None, :, None, None]


def hard_st_loss(t, s, q=0.999):
    d = (t - s) ** 2
    thr = torch.quantile(d.flatten()[::17], q)  # subsample; quantile has an input size limit
    return d[d >= thr].mean()


@torch.no_grad()
def anomaly_maps(teacher, model, x, t_mean, t_std):
    t = (teacher(x) - t_mean) / t_std
    s = model.student(x)
    a = model.ae(x)
    st = ((t - s[:, :OUT_CH]) ** 2).mean(1, keepdim=True)
    sae = ((a - s[:, OUT_CH:]) ** 2).mean(1, keepdim=True)
    return st, sae


@torch.no_grad()
def evaluate(teacher, model, loader, device, t_mean, t_std):
    model.eval()
    st_maps, ae_maps, labels = [], [], []
    for x, y in loader:
        st, sae = anomaly_maps(teacher, model, x.to(device), t_mean, t_std)
        st_maps.append(st.cpu())
        ae_maps.append(sae.cpu())
        labels.extend(y.tolist())
    st, sae = torch.cat(st_maps), torch.cat(ae_maps)
    # simple normalisation on the test distribution of good images (no separate val split here)
    good = torch.tensor(labels) == 0
    def norm(m):
        lo, hi = torch.quantile(m[good].flatten()[::7], 0.9), torch.quantile(m[good].flatten()[::7], 0.995)
        return 0.1 * (m - lo) / (hi - lo + 1e-8)
    combined = 0.5 * norm(st) + 0.5 * norm(sae)
    combined = F.pad(combined, (4, 4, 4, 4))
    combined = F.interpolate(combined, size=(IMG, IMG), mode="bilinear")
    scores = combined.flatten(1).amax(1).numpy()
    model.train()
    return roc_auc_score(labels, scores)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-dir", required=True)
    ap.add_argument("--test-dir", required=True)
    ap.add_argument("--teacher", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=4, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--workers", type=int, default=4)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    teacher = pdn_small(OUT_CH)
    teacher.load_state_dict(torch.load(args.teacher, map_location="cpu"))
    teacher = teacher.to(device).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)

    train_ds = Folder(args.train_dir)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    stats_dl = DataLoader(Subset(train_ds, range(rank, len(train_ds), world)), batch_size=16,
                          num_workers=args.workers)
    t_mean, t_std = teacher_channel_stats(teacher, stats_dl, device)

    model = DDP(StudentAE().to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=int(0.95 * args.epochs), gamma=0.1)

    test_dl = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        test_dl = DataLoader(Folder(args.test_dir, labelled=True), batch_size=8, num_workers=args.workers)

    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        meter = torch.zeros(3, device=device)
        for x, x_aug in train_dl:
            x, x_aug = x.to(device, non_blocking=True), x_aug.to(device, non_blocking=True)
            with torch.no_grad():
                t = (teacher(x) - t_mean) / t_std
                t_aug = (teacher(x_aug) - t_mean) / t_std
            s, s_aug, a = model(x, x_aug)
            loss_st = hard_st_loss(t, s[:, :OUT_CH])
            loss_ae = F.mse_loss(a, t_aug)
            loss_stae = F.mse_loss(s_aug[:, OUT_CH:], a)
            loss = loss_st + loss_ae + loss_stae
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            meter += torch.stack([loss_st.detach(), loss_ae.detach(), loss_stae.detach()])
        sched.step()
        dist.all_reduce(meter)

        if rank == 0:
            m = (meter / (world * len(train_dl))).tolist()
            line = f"epoch {epoch:3d} st {m[0]:.4f} ae {m[1]:.4f} stae {m[2]:.4f} ({time.time() - t0:.0f}s)"
            if (epoch + 1) % 25 == 0 or epoch + 1 == args.epochs:
                auroc = evaluate(teacher, model.module, test_dl, device, t_mean, t_std)
                line += f" | AUROC {auroc:.4f}"
                torch.save({"model": model.module.state_dict(), "t_mean": t_mean.cpu(), "t_std": t_std.cpu(),
                            "epoch": epoch, "auroc": auroc}, os.path.join(args.out, "efficientad_last.pth"))
            print(line, flush=True)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
