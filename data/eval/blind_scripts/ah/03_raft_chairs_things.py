"""RAFT-small training on FlyingChairs (stage 1), multi-GPU.

torchrun --nproc_per_node=4 train_raft.py --name raft-chairs --stage chairs \
    --num_steps 100000 --batch_size 6 --lr 4e-4 --image_size 368 496 --wdecay 1e-4
(batch_size is per GPU.)
"""
import argparse
import os
import os.path as osp
import random
from glob import glob

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

MAX_FLOW = 400
SUM_FREQ = 100
VAL_FREQ = 5000


def read_flo(fn):
    with open(fn, "rb") as f:
        magic = np.fromfile(f, np.float32, count=1)
        assert magic == 202021.25, "invalid .flo file"
        w = int(np.fromfile(f, np.int32, count=1))
        h = int(np.fromfile(f, np.int32, count=1))
        return np.fromfile(f, np.float32, count=2 * w * h).reshape(h, w, 2)


class FlyingChairs(Dataset):
    def __init__(self, root, split="training", crop=None):
        images = sorted(glob(osp.join(root, "*.ppm")))
        flows = sorted(glob(osp.join(root, "*.flo")))
        assert len(images) // 2 == len(flows)
        split_list = np.loadtxt(osp.join(osp.dirname(root), "chairs_split.txt"), dtype=np.int32)
        want = 1 if split == "training" else 2
        self.samples = [(images[2 * i], images[2 * i + 1], flows[i])
                        for i in range(len(flows)) if split_list[i] == want]
        self.crop = crop

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        p1, p2, pf = self.samples[idx]
        img1 = np.asarray(Image.open(p1), dtype=np.float32)[..., :3]
        img2 = np.asarray(Image.open(p2), dtype=np.float32)[..., :3]
        flow = read_flo(pf)
        if self.crop is not None:
            ch, cw = self.crop
            if np.random.rand() < 0.5:
                img1, img2 = img1[:, ::-1], img2[:, ::-1]
                flow = flow[:, ::-1] * [-1.0, 1.0]
            if np.random.rand() < 0.1:
                img1, img2 = img1[::-1], img2[::-1]
                flow = flow[::-1] * [1.0, -1.0]
            y0 = np.random.randint(0, img1.shape[0] - ch + 1)
            x0 = np.random.randint(0, img1.shape[1] - cw + 1)
            img1, img2 = img1[y0:y0 + ch, x0:x0 + cw], img2[y0:y0 + ch, x0:x0 + cw]
            flow = flow[y0:y0 + ch, x0:x0 + cw]
        img1 = torch.from_numpy(np.ascontiguousarray(img1)).permute(2, 0, 1)
        img2 = torch.from_numpy(np.ascontiguousarray(img2)).permute(2, 0, 1)
        flow = torch.from_numpy(np.ascontiguousarray(flow, dtype=np.float32)).permute(2, 0, 1)
        valid = ((flow[0].abs() < 1000) & (flow[1].abs() < 1000)).float()
        return img1, img2, flow, valid


class ResBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1)
        self.n1, self.n2 = nn.InstanceNorm2d(cout), nn.InstanceNorm2d(cout)
        self.down = None if stride == 1 and cin == cout else nn.Sequential(nn.Conv2d(cin, cout, 1, stride),
                                                                         nn.InstanceNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.n1(self.c1(x)))
        y = F.relu(self.n2(self.c2(y)))
        return F.relu(y + (x if self.down is None else self.down(x)))


class Encoder(nn.Module):
    def __init__(self, out_dim):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 7, 2, 3), nn.InstanceNorm2d(32), nn.ReLU())
        self.layers = nn.Sequential(ResBlock(32, 32), ResBlock(32, 64, 2), ResBlock(64, 96, 2))
        self.out = nn.Conv2d(96, out_dim, 1)

    def forward(self, x):
        return self.out(self.layers(self.stem(x)))


class CorrBlock:
    def __init__(self, f1, f2, levels=4, radius=3):
        B, C, H, W = f1.shape
        corr = torch.einsum("bchw,bcij->bhwij", f1, f2) / C ** 0.5
        corr = corr.reshape(B * H * W, 1, H, W)
        self.pyr = [corr]
        for _ in range(levels - 1):
            corr = F.avg_pool2d(corr, 2, 2)
            self.pyr.append(corr)
        self.r = radius

    def __call__(self, coords):
        B, _, H, W = coords.shape
        coords = coords.permute(0, 2, 3, 1).reshape(B * H * W, 1, 1, 2)
        d = torch.linspace(-self.r, self.r, 2 * self.r + 1, device=coords.device)
        delta = torch.stack(torch.meshgrid(d, d, indexing="ij"), -1).view(1, 2 * self.r + 1, 2 * self.r + 1, 2)
        out = []
        for i, corr in enumerate(self.pyr):
            c = coords / 2 ** i + delta.flip(-1)
            h, w = corr.shape[-2:]
            grid = torch.stack([2 * c[..., 0] / (w - 1) - 1, 2 * c[..., 1] / (h - 1) - 1], -1)
            out.append(F.grid_sample(corr, grid, align_corners=True).view(B, H, W, -1))
        return torch.cat(out, -1).permute(0, 3, 1, 2).contiguous().float()


class UpdateBlock(nn.Module):
    def __init__(self, corr_ch, hdim=96, cdim=64):
        super().__init__()
        self.enc_c = nn.Conv2d(corr_ch, 96, 1)
        self.enc_f = nn.Sequential(nn.Conv2d(2, 64, 7, 1, 3), nn.ReLU(), nn.Conv2d(64, 32, 3, 1, 1))
        self.enc = nn.Conv2d(96 + 32, 80, 3, 1, 1)
        inp = 80 + 2 + cdim
        self.convz = nn.Conv2d(hdim + inp, hdim, 3, 1, 1)
        self.convr = nn.Conv2d(hdim + inp, hdim, 3, 1, 1)
        self.convq = nn.Conv2d(hdim + inp, hdim, 3, 1, 1)
        self.flow_head = nn.Sequential(nn.Conv2d(hdim, 128, 3, 1, 1), nn.ReLU(), nn.Conv2d(128, 2, 3, 1, 1))

    def forward(self, net, ctx, corr, flow):
        m = F.relu(self.enc(torch.cat([F.relu(self.enc_c(corr)), F.relu(self.enc_f(flow))], 1)))
        x = torch.cat([ctx, m, flow], 1)
        hx = torch.cat([net, x], 1)
        z, r = torch.sigmoid(self.convz(hx)), torch.sigmoid(self.convr(hx))
        q = torch.tanh(self.convq(torch.cat([r * net, x], 1)))
        net = (1 - z) * net + z * q
        return net, self.flow_head(net)


class RAFTSmall(nn.Module):
    def __init__(self, iters=12):
        super().__init__()
        self.fnet = Encoder(128)
        self.cnet = Encoder(96 + 64)
        self.update = UpdateBlock(4 * 49)
        self.iters = iters

    def forward(self, img1, img2, iters=None):
        iters = iters or self.iters
        img1 = 2 * (img1 / 255.0) - 1
        img2 = 2 * (img2 / 255.0) - 1
        f1, f2 = self.fnet(torch.cat([img1, img2], 0)).float().chunk(2, 0)
        corr_fn = CorrBlock(f1, f2)
        c = self.cnet(img1)
        net, ctx = torch.tanh(c[:, :96]), F.relu(c[:, 96:])
        B, _, H, W = f1.shape
        ys, xs = torch.meshgrid(torch.arange(H, device=img1.device), torch.arange(W, device=img1.device),
                                indexing="ij")
        coords0 = torch.stack([xs, ys], 0).float()[None].repeat(B, 1, 1, 1)
        coords1 = coords0.clone()
        preds = []
        for _ in range(iters):
            coords1 = coords1.detach()
            corr = corr_fn(coords1)
            net, delta = self.update(net, ctx, corr, coords1 - coords0)
            coords1 = coords1 + delta
            preds.append(8 * F.interpolate(coords1 - coords0, scale_factor=8, mode="bilinear", align_corners=True))
        return preds


def sequence_loss(preds, gt, valid, gamma=0.8):
    mag = gt.pow(2).sum(1).sqrt()
    valid = (valid >= 0.5) & (mag < MAX_FLOW)
    n = len(preds)
    loss = 0.0
    for i, p in enumerate(preds):
        loss = loss + gamma ** (n - i - 1) * (valid[:, None] * (p - gt).abs()).mean()
    epe = (preds[-1] - gt).pow(2).sum(1).sqrt()[valid]
    return loss, {"epe": epe.mean().item(), "1px": (epe < 1).float().mean().item()}


@torch.no_grad()
def validate_chairs(model, root, rank, world, device):
    model.eval()
    ds = FlyingChairs(root, split="validation")
    epe_sum = torch.zeros(2, device=device, dtype=torch.float64)
    for i in range(rank, len(ds), world):
        img1, img2, flow, _ = ds[i]
        preds = model(img1[None].to(device), img2[None].to(device), iters=24)
        epe = (preds[-1][0].cpu() - flow).pow(2).sum(0).sqrt()
        epe_sum[0] += epe.sum().item()
        epe_sum[1] += epe.numel()
    dist.all_reduce(epe_sum)
    model.train()
    return (epe_sum[0] / epe_sum[1]).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", default="raft-chairs")
    parser.add_argument("--stage", default="chairs")
    parser.add_argument("--data", default="datasets/FlyingChairs_release/data")
    parser.add_argument("--num_steps", type=int, default=100000)
    parser.add_argument("--batch_size", type=int, default=6)
    parser.add_argument("--lr", type=float, default=4e-4)
    parser.add_argument("--wdecay", type=float, default=1e-4)
    parser.add_argument("--image_size", type=int, nargs=2, default=[368, 496])
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--mixed_precision", action="store_true")
    parser.add_argument("--restore_ckpt", default=None)
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)
    np.random.seed(1234 + rank)
    random.seed(1234 + rank)

    model = RAFTSmall(args.iters).to(device)
    if args.restore_ckpt is not None:
        model.load_state_dict(torch.load(args.restore_ckpt, map_location="cpu"), strict=False)
    model = DistributedDataParallel(model, device_ids=[local_rank])
    model.train()

    train_set = FlyingChairs(args.data, "training", crop=tuple(args.image_size))
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    # the reference lr was tuned for 2 GPUs x 5 images
    lr = args.lr * args.batch_size * world / 10
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.wdecay, eps=1e-8)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, lr, args.num_steps + 100, pct_start=0.05,
                                                    cycle_momentum=False, anneal_strategy="linear")
    scaler = torch.cuda.amp.GradScaler(enabled=args.mixed_precision)

    os.makedirs("checkpoints", exist_ok=True)
    total_steps = 0
    running = {}
    keep_training = True
    while keep_training:
        for img1, img2, flow, valid in loader:
            img1, img2 = img1.to(device, non_blocking=True), img2.to(device, non_blocking=True)
            flow, valid = flow.to(device, non_blocking=True), valid.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", enabled=args.mixed_precision):
                preds = model(img1, img2)
            loss, metrics = sequence_loss(preds, flow, valid)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            scaler.step(optimizer)
            scheduler.step()
            scaler.update()

            for k, v in metrics.items():
                running[k] = running.get(k, 0.0) + v
            total_steps += 1
            if total_steps % SUM_FREQ == 0:
                if rank == 0:
                    msg = ", ".join(f"{k} {v / SUM_FREQ:.4f}" for k, v in running.items())
                    print(f"[{total_steps:6d}, lr {scheduler.get_last_lr()[0]:.2e}] {msg}", flush=True)
                running = {}

            if total_steps % VAL_FREQ == VAL_FREQ - 1:
                epe = validate_chairs(model.module, args.data, rank, world, device)
                if rank == 0:
                    print(f"chairs val EPE: {epe:.3f}", flush=True)
                    torch.save(model.module.state_dict(), f"checkpoints/{total_steps + 1}_{args.name}.pth")

            if total_steps > args.num_steps:
                keep_training = False
                break

    if rank == 0:
        torch.save(model.module.state_dict(), f"checkpoints/{args.name}.pth")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
