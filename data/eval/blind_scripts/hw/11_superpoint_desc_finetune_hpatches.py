"""Fine-tune the SuperPoint descriptor head on MegaDepth correspondences, then report HPatches MMA.

    torchrun --nproc_per_node=8 11_superpoint_desc_finetune_hpatches.py \
        --init weights/superpoint_v1.pth --md_corr /data/md_corr --hpatches /data/hpatches-sequences-release
"""
import argparse
import glob
import os

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class SuperPointNet(nn.Module):
    """Same layout as the Magic Leap release so the official weights load as is."""

    def __init__(self):
        super().__init__()
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(2, 2)
        c1, c2, c3, c4, c5, d1 = 64, 64, 128, 128, 256, 256
        self.conv1a = nn.Conv2d(1, c1, 3, 1, 1)
        self.conv1b = nn.Conv2d(c1, c1, 3, 1, 1)
        self.conv2a = nn.Conv2d(c1, c2, 3, 1, 1)
        self.conv2b = nn.Conv2d(c2, c2, 3, 1, 1)
        self.conv3a = nn.Conv2d(c2, c3, 3, 1, 1)
        self.conv3b = nn.Conv2d(c3, c3, 3, 1, 1)
        self.conv4a = nn.Conv2d(c3, c4, 3, 1, 1)
        self.conv4b = nn.Conv2d(c4, c4, 3, 1, 1)
        self.convPa = nn.Conv2d(c4, c5, 3, 1, 1)
        self.convPb = nn.Conv2d(c5, 65, 1, 1, 0)
        self.convDa = nn.Conv2d(c4, c5, 3, 1, 1)
        self.convDb = nn.Conv2d(c5, d1, 1, 1, 0)

    def forward(self, x):
        x = self.relu(self.conv1a(x))
        x = self.pool(self.relu(self.conv1b(x)))
        x = self.relu(self.conv2a(x))
        x = self.pool(self.relu(self.conv2b(x)))
        x = self.relu(self.conv3a(x))
        x = self.pool(self.relu(self.conv3b(x)))
        x = self.relu(self.conv4a(x))
        x = self.relu(self.conv4b(x))
        semi = self.convPb(self.relu(self.convPa(x)))
        desc = F.normalize(self.convDb(self.relu(self.convDa(x))), dim=1)
        return semi, desc


def freeze_detector(net):
    for name, p in net.named_parameters():
        if not name.startswith(("convDa", "convDb", "conv4")):
            p.requires_grad_(False)


class MDCorrespondences(Dataset):
    """Pre-computed MegaDepth pairs: grayscale crops (480x480) and 1024 depth-verified correspondences."""

    def __init__(self, root):
        self.files = sorted(glob.glob(os.path.join(root, "*.npz")))

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        z = np.load(self.files[i])
        im0 = torch.from_numpy(z["image0"].astype(np.float32) / 255.0)[None]
        im1 = torch.from_numpy(z["image1"].astype(np.float32) / 255.0)[None]
        return im0, im1, torch.from_numpy(z["corr"].astype(np.float32))  # (1024, 4): x0 y0 x1 y1


def sample(desc, pts, hw):
    h, w = hw
    g = torch.stack([pts[..., 0] / (w - 1), pts[..., 1] / (h - 1)], -1) * 2 - 1
    return F.normalize(F.grid_sample(desc, g[:, None], mode="bilinear", align_corners=True)[:, :, 0], dim=1)


def contrastive_loss(d0, d1, corr, hw, temp=0.1):
    s0 = sample(d0, corr[..., :2], hw).transpose(1, 2)
    s1 = sample(d1, corr[..., 2:], hw).transpose(1, 2)
    logits = s0 @ s1.transpose(1, 2) / temp
    tgt = torch.arange(logits.size(1), device=logits.device)[None].expand(logits.size(0), -1)
    return 0.5 * (F.cross_entropy(logits.flatten(0, 1), tgt.flatten()) +
                  F.cross_entropy(logits.transpose(1, 2).flatten(0, 1), tgt.flatten()))


@torch.no_grad()
def extract(net, img, device, max_kpts=2000, thr=0.005, nms=4):
    x = torch.from_numpy(img.astype(np.float32) / 255.0)[None, None].to(device)
    semi, desc = net(x)
    prob = F.pixel_shuffle(semi.softmax(1)[:, :-1], 8)[0, 0]
    mx = F.max_pool2d(prob[None, None], 2 * nms + 1, 1, nms)[0, 0]
    ys, xs = torch.nonzero((prob == mx) & (prob > thr), as_tuple=True)
    order = prob[ys, xs].argsort(descending=True)[:max_kpts]
    kpts = torch.stack([xs[order], ys[order]], -1).float()
    d = sample(desc, kpts[None], prob.shape)[0].T
    return kpts.cpu().numpy(), d


def hpatches_mma(net, root, device, thresholds=range(1, 11)):
    errs = {"i": [], "v": []}
    for seq in sorted(os.listdir(root)):
        img1 = cv2.imread(os.path.join(root, seq, "1.ppm"), cv2.IMREAD_GRAYSCALE)
        k1, d1 = extract(net, img1, device)
        for j in range(2, 7):
            imgj = cv2.imread(os.path.join(root, seq, f"{j}.ppm"), cv2.IMREAD_GRAYSCALE)
            H = np.loadtxt(os.path.join(root, seq, f"H_1_{j}"))
            kj, dj = extract(net, imgj, device)
            sim = d1 @ dj.T
            nn12, nn21 = sim.argmax(1), sim.argmax(0)
            mutual = nn21[nn12] == torch.arange(len(nn12), device=device)
            i1 = torch.nonzero(mutual)[:, 0].cpu().numpy()
            i2 = nn12[mutual].cpu().numpy()
            if len(i1) == 0:
                continue
            proj = cv2.perspectiveTransform(k1[i1][None].astype(np.float64), H)[0]
            errs[seq[0]].append(np.linalg.norm(proj - kj[i2], axis=1))
    out = {}
    for key in ("i", "v"):
        e = np.concatenate(errs[key]) if errs[key] else np.zeros(0)
        out[key] = [float((e <= t).mean()) if len(e) else 0.0 for t in thresholds]
    e_all = np.concatenate(errs["i"] + errs["v"])
    out["all"] = [float((e_all <= t).mean()) for t in thresholds]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--init", required=True)
    ap.add_argument("--md_corr", required=True)
    ap.add_argument("--hpatches", required=True)
    ap.add_argument("--out", default="runs/sp_desc_ft")
    ap.add_argument("--batch_size", type=int, default=6)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--workers", type=int, default=6)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    net = SuperPointNet()
    net.load_state_dict(torch.load(args.init, map_location="cpu"))
    freeze_detector(net)
    model = DDP(net.to(device), device_ids=[local_rank])
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=args.lr)

    ds = MDCorrespondences(args.md_corr)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                    pin_memory=True, drop_last=True)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best_loss = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tot = torch.zeros(2, device=device)
        for im0, im1, corr in dl:
            im0, im1, corr = im0.to(device), im1.to(device), corr.to(device)
            _, desc = model(torch.cat([im0, im1]))
            d0, d1 = desc.chunk(2)
            loss = contrastive_loss(d0, d1, corr, im0.shape[-2:])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)
        mean_loss = (tot[0] / tot[1]).item()
        if rank == 0:
            print(f"epoch {epoch}: contrastive loss {mean_loss:.4f}", flush=True)
            torch.save({"model": model.state_dict(), "epoch": epoch}, os.path.join(args.out, "last.pth"))
            if mean_loss < best_loss:
                best_loss = mean_loss
                torch.save({"model": model.state_dict(), "epoch": epoch}, os.path.join(args.out, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()

    if rank == 0:
        test_net = SuperPointNet().to(device).eval()
        test_net.load_state_dict(torch.load(os.path.join(args.out, "best.pth"), map_location=device)["model"])
        res = hpatches_mma(test_net, args.hpatches, device)
        for key in ("i", "v", "all"):
            print(f"HPatches MMA ({key}) @1/3/5/10px: " +
                  " ".join(f"{res[key][t - 1]:.3f}" for t in (1, 3, 5, 10)))
        torch.save(test_net.state_dict(), os.path.join(args.out, "superpoint_ft.pth"))


if __name__ == "__main__":
    main()
