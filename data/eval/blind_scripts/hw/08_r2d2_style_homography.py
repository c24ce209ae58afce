"""R2D2-style detector/descriptor (repeatability + reliability) trained on web images with random homographies.

Two nodes, shared /nfs:
    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=$NODE_RANK --master_addr=$MASTER --master_port=29500 \
        08_r2d2_style_homography.py --images /nfs/datasets/revisitop1m/jpg --ckpt_dir /nfs/exp/r2d2_wasf
"""
import argparse
import glob
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms as T
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", required=True)
    ap.add_argument("--ckpt_dir", required=True)
    ap.add_argument("--crop", type=int, default=192)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--weight_decay", type=float, default=5e-4)
    ap.add_argument("--epochs", type=int, default=25)
    ap.add_argument("--rep_patch", type=int, default=16)
    ap.add_argument("--n_samples", type=int, default=2048)
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


def random_homography(size, strength=0.25):
    s = size
    src = torch.tensor([[-1, -1], [1, -1], [1, 1], [-1, 1]], dtype=torch.float32)
    dst = src + (torch.rand(4, 2) * 2 - 1) * strength
    ang = (random.random() * 2 - 1) * math.pi / 8
    R = torch.tensor([[math.cos(ang), -math.sin(ang)], [math.sin(ang), math.cos(ang)]])
    dst = dst @ R.T * random.uniform(0.8, 1.25)
    A = []
    for (x, y), (u, v) in zip(src.tolist(), dst.tolist()):
        A.append([x, y, 1, 0, 0, 0, -u * x, -u * y, -u])
        A.append([0, 0, 0, x, y, 1, -v * x, -v * y, -v])
    _, _, Vt = torch.linalg.svd(torch.tensor(A))
    Hn = Vt[-1].reshape(3, 3)
    return Hn / Hn[2, 2]  # acts on [-1, 1] normalised coordinates


class WebImagePairs(Dataset):
    def __init__(self, root, crop):
        self.files = sorted(glob.glob(os.path.join(root, "**", "*.jpg"), recursive=True))
        self.crop = crop
        self.prep = T.Compose([T.Resize(crop + 32), T.RandomCrop(crop)])
        self.color = T.ColorJitter(0.3, 0.3, 0.3, 0.05)
        self.norm = T.Compose([T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        img = self.prep(Image.open(self.files[i]).convert("RGB"))
        x0 = self.norm(self.color(img))
        x1 = self.norm(self.color(img))
        Hn = random_homography(self.crop)
        # grid in image-1 coordinates mapped back to image 0 (inverse warp)
        lin = torch.linspace(-1, 1, self.crop)
        gy, gx = torch.meshgrid(lin, lin, indexing="ij")
        pts1 = torch.stack([gx, gy, torch.ones_like(gx)], -1).reshape(-1, 3)
        pts0 = pts1 @ torch.linalg.inv(Hn).T
        grid = (pts0[:, :2] / pts0[:, 2:]).reshape(self.crop, self.crop, 2)
        x1 = F.grid_sample(x1[None], grid[None], align_corners=True, padding_mode="zeros")[0]
        valid = ((grid.abs() <= 1).all(-1)).float()
        return x0, x1, grid, valid


class L2Net(nn.Module):
    def __init__(self, dim=128):
        super().__init__()
        ch = [3, 32, 32, 64, 64, 128, 128]
        dil = [1, 1, 1, 2, 2, 4]
        layers = []
        for i in range(6):
            layers += [nn.Conv2d(ch[i], ch[i + 1], 3, padding=dil[i], dilation=dil[i]),
                       nn.GroupNorm(8, ch[i + 1]), nn.ReLU(inplace=True)]
        self.body = nn.Sequential(*layers, nn.Conv2d(128, dim, 3, padding=4, dilation=4))
        self.clf = nn.Conv2d(dim, 2, 1)  # reliability
        self.sal = nn.Conv2d(dim, 2, 1)  # repeatability

    def forward(self, x):
        f = self.body(x)
        desc = F.normalize(f, dim=1)
        f2 = f ** 2
        rel = F.softmax(self.clf(f2), 1)[:, 1:2]
        rep = F.softmax(self.sal(f2), 1)[:, 1:2]
        return desc, rep, rel


def cosim_loss(rep0, rep1_w, valid, n=16):
    # repeatability: local patches of the two heatmaps should be identical up to the warp
    p0 = F.unfold(rep0, n, stride=n // 2).transpose(1, 2)
    p1 = F.unfold(rep1_w, n, stride=n // 2).transpose(1, 2)
    m = F.unfold(valid[:, None], n, stride=n // 2).transpose(1, 2).min(-1).values
    cs = F.cosine_similarity(p0, p1, dim=-1)
    return 1 - (cs * m).sum() / m.sum().clamp(min=1)


def peaky_loss(rep, n=16):
    return 1 - (F.max_pool2d(rep, n + 1, 1, n // 2) - F.avg_pool2d(rep, n + 1, 1, n // 2)).mean()


def reliability_ap_loss(d0, d1_w, rel0, valid, n_samples, kappa=0.5):
    b, c, h, w = d0.shape
    losses = []
    for k in range(b):
        idx = torch.nonzero(valid[k].flatten() > 0)[:, 0]
        if idx.numel() < 32:
            losses.append(rel0[k].sum() * 0)
            continue
        idx = idx[torch.randperm(idx.numel(), device=idx.device)[:n_samples]]
        q = d0[k].flatten(1)[:, idx].T
        db = d1_w[k].flatten(1)[:, idx].T
        sim = q @ db.T
        # soft AP with a differentiable ranking approximation
        pos = sim.diag()[:, None]
        rank_all = 1 + torch.sigmoid((sim - pos) / 0.01).sum(1) - 0.5
        ap = 1.0 / rank_all
        r = rel0[k, 0].flatten()[idx]
        losses.append((1 - (ap * r + kappa * (1 - r))).mean())
    return torch.stack(losses).mean()


def save_checkpoint(path, model, optimizer, epoch):
    torch.save({"epoch": epoch, "state_dict": model.module.state_dict(),
                "optimizer": optimizer.state_dict()}, path)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0
    random.seed(rank)
    torch.manual_seed(1234)

    ds = WebImagePairs(args.images, args.crop)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True,
                        worker_init_fn=lambda w: random.seed(torch.initial_seed() % 2 ** 31 + w))

    model = DDP(L2Net().to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    os.makedirs(args.ckpt_dir, exist_ok=True)

    start = 0
    last = os.path.join(args.ckpt_dir, "last.pt")
    if os.path.exists(last):
        ck = torch.load(last, map_location=device)
        model.module.load_state_dict(ck["state_dict"])
        opt.load_state_dict(ck["optimizer"])
        start = ck["epoch"] + 1

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        acc = torch.zeros(4, device=device)
        for it, (x0, x1, grid, valid) in enumerate(loader):
            x0, x1 = x0.to(device, non_blocking=True), x1.to(device, non_blocking=True)
            grid, valid = grid.to(device, non_blocking=True), valid.to(device, non_blocking=True)
            desc, rep, rel = model(torch.cat([x0, x1]))
            b = x0.size(0)
            d0, d1, rep0, rep1, rel0 = desc[:b], desc[b:], rep[:b], rep[b:], rel[:b]
            # bring image-0 predictions into image-1's frame
            d0_w = F.normalize(F.grid_sample(d0, grid, align_corners=True), dim=1)
            rep0_w = F.grid_sample(rep0, grid, align_corners=True)
            rel0_w = F.grid_sample(rel0, grid, align_corners=True)
            l_rep = cosim_loss(rep0_w, rep1, valid, args.rep_patch)
            l_peak = 0.5 * (peaky_loss(rep0) + peaky_loss(rep1))
            l_ap = reliability_ap_loss(d0_w, d1, rel0_w, valid, args.n_samples)
            loss = l_rep + l_peak + l_ap
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            acc += torch.stack([loss.detach(), l_rep.detach(), l_ap.detach(), torch.ones((), device=device)])
            if it % 200 == 0 and is_main:
                print(f"ep {epoch} it {it}/{len(loader)} loss {loss.item():.4f}", flush=True)

        dist.all_reduce(acc)
        if is_main:
            print(f"== epoch {epoch}: loss {acc[0] / acc[3]:.4f} rep {acc[1] / acc[3]:.4f} "
                  f"ap {acc[2] / acc[3]:.4f}", flush=True)
        save_checkpoint(last, model, opt, epoch)
        if (epoch + 1) % 5 == 0:
            save_checkpoint(os.path.join(args.ckpt_dir, f"epoch{epoch + 1:03d}.pt"), model, opt, epoch)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
