"""CAPS-style descriptor learning from camera poses only (epipolar + cycle-consistency loss) on MegaDepth.

Scenes are sharded across ranks so that each process only opens its own scene_info files.

    torchrun --nproc_per_node=8 16_caps_epipolar_scene_shards.py --root /data/MegaDepth --scene_list lists/md_train.txt
"""
import argparse
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.tensorboard import SummaryWriter


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--scene_list", required=True)
    p.add_argument("--out", default="runs/caps")
    p.add_argument("--resnet_ckpt", default="weights/resnet50-11ad3fa6.pth")
    p.add_argument("--size", type=int, default=480)
    p.add_argument("--n_query", type=int, default=400)
    p.add_argument("--batch_size", type=int, default=6)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--w_cycle", type=float, default=0.1)
    return p.parse_args()


class ScenePairs(Dataset):
    def __init__(self, root, scene, size, min_overlap=0.2):
        info = np.load(os.path.join(root, "scene_info", f"{scene}.npz"), allow_pickle=True)
        self.root, self.size = root, size
        self.paths, self.K, self.poses = info["image_paths"], info["intrinsics"], info["poses"]
        self.pairs = [p[0] for p in info["pair_infos"] if p[1] > min_overlap]
        self.tf = torchvision.transforms.Compose([
            torchvision.transforms.ColorJitter(0.2, 0.2, 0.2),
            torchvision.transforms.ToTensor(),
            torchvision.transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __len__(self):
        return len(self.pairs)

    def _img(self, i):
        im = Image.open(os.path.join(self.root, self.paths[i])).convert("RGB")
        w, h = im.size
        im = im.resize((self.size, self.size), Image.BILINEAR)
        K = self.K[i].astype(np.float32).copy()
        K[0] *= self.size / w
        K[1] *= self.size / h
        return self.tf(im), torch.from_numpy(K)

    def __getitem__(self, k):
        i, j = self.pairs[k]
        im0, K0 = self._img(i)
        im1, K1 = self._img(j)
        T = torch.from_numpy((self.poses[j] @ np.linalg.inv(self.poses[i])).astype(np.float32))
        return im0, im1, K0, K1, T


def skew(t):
    z = torch.zeros_like(t[:, 0])
    return torch.stack([torch.stack([z, -t[:, 2], t[:, 1]], -1),
                        torch.stack([t[:, 2], z, -t[:, 0]], -1),
                        torch.stack([-t[:, 1], t[:, 0], z], -1)], 1)


def fundamental(K0, K1, T):
    E = skew(T[:, :3, 3]) @ T[:, :3, :3]
    return torch.linalg.inv(K1).transpose(1, 2) @ E @ torch.linalg.inv(K0)


class CAPSNet(nn.Module):
    def __init__(self, dim=128):
        super().__init__()
        r = torchvision.models.resnet50(norm_layer=torchvision.ops.FrozenBatchNorm2d)
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool)
        self.l1, self.l2, self.l3 = r.layer1, r.layer2, r.layer3
        self.coarse = nn.Conv2d(1024, dim, 1)  # 1/16
        self.fine = nn.Conv2d(512 + dim, dim, 3, padding=1)  # 1/8

    def forward(self, x):
        x2 = self.l2(self.l1(self.stem(x)))
        x3 = self.l3(x2)
        c = self.coarse(x3)
        f = self.fine(torch.cat([x2, F.interpolate(c, size=x2.shape[-2:], mode="bilinear", align_corners=False)], 1))
        return F.normalize(c, dim=1), F.normalize(f, dim=1)


def soft_correspond(q_desc, fmap, size, temp=0.02):
    """Expected location (pixels) in fmap's image for each query descriptor, plus spatial std."""
    b, c, h, w = fmap.shape
    prob = ((q_desc @ fmap.flatten(2)) / temp).softmax(-1)
    ys, xs = torch.meshgrid(torch.arange(h, device=fmap.device), torch.arange(w, device=fmap.device), indexing="ij")
    grid = (torch.stack([xs, ys], -1).reshape(-1, 2).float() + 0.5) * (size / w)
    mean = prob @ grid
    var = (prob @ grid ** 2 - mean ** 2).sum(-1).clamp(min=1e-6)
    return mean, var.sqrt()


def sample(fmap, pts, size):
    g = pts / size * 2 - 1
    return F.grid_sample(fmap, g[:, None], align_corners=False)[:, :, 0].transpose(1, 2)


def caps_loss(net_out0, net_out1, K0, K1, T, size, n_query, w_cycle):
    (c0, f0), (c1, f1) = net_out0, net_out1
    b = c0.size(0)
    q = torch.rand(b, n_query, 2, device=c0.device) * (size - 1)
    # coarse: epipolar distance of the expected match, weighted by inverse uncertainty
    p1, std1 = soft_correspond(sample(c0, q, size), c1, size)
    Fm = fundamental(K0, K1, T)
    qh = torch.cat([q, torch.ones_like(q[..., :1])], -1)
    lines = qh @ Fm.transpose(1, 2)
    d_epi = (lines[..., 0] * p1[..., 0] + lines[..., 1] * p1[..., 1] + lines[..., 2]).abs() / \
        lines[..., :2].norm(dim=-1).clamp(min=1e-6)
    w = 1.0 / std1
    l_epi = (w / w.sum(1, keepdim=True) * d_epi.clamp(max=size / 4)).sum(1).mean()
    # cycle: map back into image 0
    q_back, _ = soft_correspond(sample(c1, p1, size), c0, size)
    l_cyc = (q_back - q).norm(dim=-1).clamp(max=size / 4).mean()
    # fine level, same losses in a window-free form
    p1f, std1f = soft_correspond(sample(f0, q, size), f1, size)
    d_epi_f = (lines[..., 0] * p1f[..., 0] + lines[..., 1] * p1f[..., 1] + lines[..., 2]).abs() / \
        lines[..., :2].norm(dim=-1).clamp(min=1e-6)
    wf = 1.0 / std1f
    l_epi_f = (wf / wf.sum(1, keepdim=True) * d_epi_f.clamp(max=size / 8)).sum(1).mean()
    return l_epi + l_epi_f + w_cycle * l_cyc, d_epi_f.median()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    random.seed(rank)

    with open(args.scene_list) as f:
        scenes = sorted(l.strip() for l in f if l.strip())
    my_scenes = scenes[rank::world]
    ds = ConcatDataset([ScenePairs(args.root, s, args.size) for s in my_scenes])
    dl = DataLoader(ds, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                    pin_memory=True, drop_last=True)
    print(f"[rank {rank}] {len(my_scenes)} scenes, {len(ds)} pairs, {len(dl)} batches/epoch", flush=True)

    net = CAPSNet()
    if args.resnet_ckpt and os.path.exists(args.resnet_ckpt):
        sd = torch.load(args.resnet_ckpt, map_location="cpu")
        own = {"conv1": net.stem[0], "bn1": net.stem[1], "layer1": net.l1, "layer2": net.l2, "layer3": net.l3}
        for prefix, mod in own.items():
            mod.load_state_dict({k[len(prefix) + 1:]: v for k, v in sd.items() if k.startswith(prefix + ".")},
                                strict=False)
    model = DDP(net.to(dev), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    writer = SummaryWriter(args.out) if rank == 0 else None

    step = 0
    for epoch in range(args.epochs):
        model.train()
        for im0, im1, K0, K1, T in dl:
            im0, im1 = im0.to(dev, non_blocking=True), im1.to(dev, non_blocking=True)
            K0, K1, T = K0.to(dev), K1.to(dev), T.to(dev)
            c, f = model(torch.cat([im0, im1]))
            b = im0.size(0)
            loss, med = caps_loss((c[:b], f[:b]), (c[b:], f[b:]), K0, K1, T, args.size, args.n_query, args.w_cycle)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step % 100 == 0:
                stats = torch.stack([loss.detach(), med.detach()])
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                if rank == 0:
                    writer.add_scalar("train/loss", stats[0].item(), step)
                    writer.add_scalar("train/median_epi_px", stats[1].item(), step)
            step += 1
        sched.step()
        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(args.out, f"caps_{epoch}.pth"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
