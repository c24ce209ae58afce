"""EfficientAD-S style training (student-teacher + autoencoder) on one MVTec / VisA category.

Part of the good training images is held out as a validation set; it is used to fit the
quantile-based normalisation of the local and global anomaly maps after training.

    torchrun --nproc_per_node=4 09_efficientad_split.py --category capsule \
        --teacher-weights weights/teacher_small.pth
"""
import argparse
import os
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

OUT_CH = 384
IMG = 256
default_tf = transforms.Compose([
    transforms.Resize((IMG, IMG)), transforms.ToTensor(),
    transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
ae_tf = transforms.RandomChoice([transforms.ColorJitter(brightness=0.2), transforms.ColorJitter(contrast=0.2),
                                 transforms.ColorJitter(saturation=0.2)])


class FileList(Dataset):
    def __init__(self, files, train):
        self.files, self.train = files, train

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        path, label = self.files[i]
        img = Image.open(path).convert("RGB")
        if self.train:
            return default_tf(img), default_tf(ae_tf(img))
        return default_tf(img), label


def pdn_small(out_ch=OUT_CH, padding=False):
    p = 1 if padding else 0
    return nn.Sequential(
        nn.Conv2d(3, 128, 4, padding=3 * p), nn.ReLU(inplace=True), nn.AvgPool2d(2, 2, padding=p),
        nn.Conv2d(128, 256, 4, padding=3 * p), nn.ReLU(inplace=True), nn.AvgPool2d(2, 2, padding=p),
        nn.Conv2d(256, 256, 3, padding=p), nn.ReLU(inplace=True),
        nn.Conv2d(256, out_ch, 4))


class AutoEncoder(nn.Module):
    def __init__(self, out_ch=OUT_CH):
        super().__init__()
        enc = [nn.Conv2d(3, 32, 4, 2, 1), nn.ReLU(True), nn.Conv2d(32, 32, 4, 2, 1), nn.ReLU(True),
               nn.Conv2d(32, 64, 4, 2, 1), nn.ReLU(True), nn.Conv2d(64, 64, 4, 2, 1), nn.ReLU(True),
               nn.Conv2d(64, 64, 4, 2, 1), nn.ReLU(True), nn.Conv2d(64, 64, 8)]
        self.encoder = nn.Sequential(*enc)
        sizes = [3, 8, 15, 32, 63, 127, 56]
        self.dec_sizes = sizes
        self.dec = nn.ModuleList([nn.Conv2d(64, 64, 4, 1, 2) for _ in range(6)])
        self.head = nn.Sequential(nn.Conv2d(64, 64, 3, 1, 1), nn.ReLU(True), nn.Conv2d(64, out_ch, 3, 1, 1))

    def forward(self, x):
        z = self.encoder(x)
        for size, conv in zip(self.dec_sizes, self.dec):
            z = F.relu(conv(F.interpolate(z, size=size, mode="bilinear")))
        z = F.interpolate(z, size=self.dec_sizes[-1], mode="bilinear")
        return self.head(z)


class StudentAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.student = pdn_small(2 * OUT_CH)
        self.ae = AutoEncoder()

    def forward(self, x, x_aug):
        return self.student(x), self.student(x_aug), self.ae(x_aug)


@torch.no_grad()
def teacher_stats(teacher, loader, device):
    means, sq, n = 0, 0, 0
    for x, _ in loader:
        f = teacher(x.to(device))
        means = means + f.sum(dim=(0, 2, 3))
        sq = sq + (f ** 2).sum(dim=(0, 2, 3))
        n += f.shape[0] * f.shape[2] * f.shape[3]
    mean = means / n
    std = (sq / n - mean ** 2).clamp_min(1e-8).sqrt()
    return mean[None, :, None, None], std[None, :, None, None]


@torch.no_grad()
def maps(teacher, net, x, t_mean, t_std):
    t = (teacher(x) - t_mean) / t_std
    s = net.student(x)
    a = net.ae(x)
    st = ((t - s[:, :OUT_CH]) ** 2).mean(1, keepdim=True)
    ae = ((a - s[:, OUT_CH:]) ** 2).mean(1, keepdim=True)
    return st, ae


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-root", default="/data/mvtec")
    ap.add_argument("--category", default="capsule")
    ap.add_argument("--teacher-weights", default="weights/teacher_small.pth")
    ap.add_argument("--val-fraction", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=70000)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--out", default="output/efficientad")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    root = Path(args.data_root) / args.category
    good = [(str(p), 0) for p in sorted((root / "train" / "good").glob("*.png"))]
    random.shuffle(good)
    n_val = max(1, int(len(good) * args.val_fraction))
    val_files, train_files = good[:n_val], good[n_val:]
    test_files = [(str(p), int(p.parent.name != "good")) for p in sorted((root / "test").glob("*/*.png"))]

    train_ds = FileList(train_files, train=True)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True)

    teacher = pdn_small(OUT_CH)
    teacher.load_state_dict(torch.load(args.teacher_weights, map_location="cpu"))
    teacher = teacher.to(device).eval().requires_grad_(False)
    stats_loader = DataLoader(FileList(train_files, train=False), batch_size=16, num_workers=6)
    t_mean, t_std = teacher_stats(teacher, stats_loader, device)

    net = DDP(StudentAE().to(device), device_ids=[local_rank])
    optimizer = torch.optim.Adam(net.parameters(), lr=args.lr, weight_decay=1e-5)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=int(0.95 * args.steps), gamma=0.1)

    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, x_aug in loader:
            x, x_aug = x.to(device, non_blocking=True), x_aug.to(device, non_blocking=True)
            with torch.no_grad():
                t = (teacher(x) - t_mean) / t_std
                t_aug = (teacher(x_aug) - t_mean) / t_std
            s, s_aug, ae = net(x, x_aug)
            d_st = (t - s[:, :OUT_CH]) ** 2
            d_hard = torch.quantile(d_st.flatten()[:: max(1, d_st.numel() // 2 ** 24)], 0.999)
            loss_st = d_st[d_st >= d_hard].mean()
            loss_ae = ((t_aug - ae) ** 2).mean()
            loss_stae = ((ae.detach() - s_aug[:, OUT_CH:]) ** 2).mean()
            loss = loss_st + loss_ae + loss_stae
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            if rank == 0 and step % 500 == 0:
                print(f"step {step}/{args.steps} st {loss_st.item():.4f} ae {loss_ae.item():.4f} "
                      f"stae {loss_stae.item():.4f}", flush=True)
            if step >= args.steps:
                break
        epoch += 1

    if rank == 0:
        model = net.module.eval()
        val_loader = DataLoader(FileList(val_files, train=False), batch_size=8)
        st_all, ae_all = [], []
        for x, _ in val_loader:
            st, ae = maps(teacher, model, x.to(device), t_mean, t_std)
            st_all.append(st.flatten()); ae_all.append(ae.flatten())
        st_all, ae_all = torch.cat(st_all), torch.cat(ae_all)
        q_st = (torch.quantile(st_all, 0.9), torch.quantile(st_all, 0.995))
        q_ae = (torch.quantile(ae_all, 0.9), torch.quantile(ae_all, 0.995))

        scores, labels = [], []
        for x, y in DataLoader(FileList(test_files, train=False), batch_size=8):
            st, ae = maps(teacher, model, x.to(device), t_mean, t_std)
            st = 0.1 * (st - q_st[0]) / (q_st[1] - q_st[0])
            ae = 0.1 * (ae - q_ae[0]) / (q_ae[1] - q_ae[0])
            amap = F.interpolate(0.5 * st + 0.5 * ae, size=(IMG, IMG), mode="bilinear")
            scores.append(amap.flatten(1).max(1).values.cpu())
            labels.append(y)
        auroc = roc_auc_score(torch.cat(labels).numpy(), torch.cat(scores).numpy())
        print(f"[{args.category}] image AUROC {auroc:.4f}", flush=True)

        out = Path(args.out) / args.category
        out.mkdir(parents=True, exist_ok=True)
        torch.save({"student_ae": model.state_dict(), "t_mean": t_mean.cpu(), "t_std": t_std.cpu(),
                    "q_st": [q.item() for q in q_st], "q_ae": [q.item() for q in q_ae]}, out / "efficientad.pth")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
