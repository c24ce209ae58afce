"""High-resolution RAFT fine-tuning on Spring (1920x1080 crops) with activation
checkpointing in the recurrent refinement so 16 GRU iterations fit in memory.

    torchrun --nproc_per_node=8 07_raft_highres_spring.py --spring_root /data/spring \
        --init checkpoints/raft-things.pth
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from data.spring import SpringFlowDataset  # returns img1, img2, flow, valid (CHW float tensors)


# ----------------------------------------------------------------------------- model
class ResidualBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1)
        self.norm1 = nn.InstanceNorm2d(cout)
        self.norm2 = nn.InstanceNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride), nn.InstanceNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.norm1(self.conv1(x)))
        y = F.relu(self.norm2(self.conv2(y)))
        return F.relu((x if self.down is None else self.down(x)) + y)


class Encoder(nn.Module):
    def __init__(self, out_dim):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3), nn.InstanceNorm2d(64), nn.ReLU(inplace=True))
        self.layer1 = nn.Sequential(ResidualBlock(64, 64), ResidualBlock(64, 64))
        self.layer2 = nn.Sequential(ResidualBlock(64, 96, 2), ResidualBlock(96, 96))
        self.layer3 = nn.Sequential(ResidualBlock(96, 128, 2), ResidualBlock(128, 128))
        self.out = nn.Conv2d(128, out_dim, 1)

    def forward(self, x):
        return self.out(self.layer3(self.layer2(self.layer1(self.stem(x)))))


class CorrPyramid:
    def __init__(self, f1, f2, levels=4, radius=4):
        b, c, h, w = f1.shape
        corr = torch.einsum("bchw,bcuv->bhwuv", f1, f2) / math.sqrt(c)
        corr = corr.reshape(b * h * w, 1, h, w)
        self.radius = radius
        self.pyramid = [corr]
        for _ in range(levels - 1):
            corr = F.avg_pool2d(corr, 2, 2)
            self.pyramid.append(corr)

    def __call__(self, coords):
        r = self.radius
        b, _, h, w = coords.shape
        coords = coords.permute(0, 2, 3, 1)
        d = torch.linspace(-r, r, 2 * r + 1, device=coords.device)
        delta = torch.stack(torch.meshgrid(d, d, indexing="ij"), dim=-1).view(1, 2 * r + 1, 2 * r + 1, 2)
        out = []
        for i, corr in enumerate(self.pyramid):
            centroid = coords.reshape(b * h * w, 1, 1, 2) / 2 ** i
            grid = centroid + delta.flip(-1)
            H, W = corr.shape[-2:]
            gx = 2 * grid[..., 0] / (W - 1) - 1
            gy = 2 * grid[..., 1] / (H - 1) - 1
            sampled = F.grid_sample(corr, torch.stack([gx, gy], -1), align_corners=True)
            out.append(sampled.view(b, h, w, -1))
        return torch.cat(out, -1).permute(0, 3, 1, 2).contiguous()


class SepConvGRU(nn.Module):
    def __init__(self, hidden=128, inp=256):
        super().__init__()
        self.convz = nn.Conv2d(hidden + inp, hidden, 3, padding=1)
        self.convr = nn.Conv2d(hidden + inp, hidden, 3, padding=1)
        self.convq = nn.Conv2d(hidden + inp, hidden, 3, padding=1)

    def forward(self, h, x):
        hx = torch.cat([h, x], 1)
        z, r = torch.sigmoid(self.convz(hx)), torch.sigmoid(self.convr(hx))
        q = torch.tanh(self.convq(torch.cat([r * h, x], 1)))
        return (1 - z) * h + z * q


class UpdateBlock(nn.Module):
    def __init__(self, corr_ch, hidden=128, ctx=128):
        super().__init__()
        self.enc_corr = nn.Sequential(nn.Conv2d(corr_ch, 192, 1), nn.ReLU(inplace=True))
        self.enc_flow = nn.Sequential(nn.Conv2d(2, 64, 7, padding=3), nn.ReLU(inplace=True))
        self.enc_out = nn.Conv2d(192 + 64, 126, 3, padding=1)
        self.gru = SepConvGRU(hidden, ctx + 128)
        self.flow_head = nn.Sequential(nn.Conv2d(hidden, 256, 3, padding=1), nn.ReLU(inplace=True),
                                       nn.Conv2d(256, 2, 3, padding=1))
        self.mask = nn.Sequential(nn.Conv2d(hidden, 256, 3, padding=1), nn.ReLU(inplace=True),
                                  nn.Conv2d(256, 64 * 9, 1))

    def forward(self, net, inp, corr, flow):
        motion = F.relu(self.enc_out(torch.cat([self.enc_corr(corr), self.enc_flow(flow)], 1)))
        net = self.gru(net, torch.cat([inp, motion, flow], 1))
        return net, 0.25 * self.mask(net), self.flow_head(net)


class RAFT(nn.Module):
    def __init__(self, levels=4, radius=4):
        super().__init__()
        self.levels, self.radius = levels, radius
        self.fnet = Encoder(256)
        self.cnet = Encoder(256)
        self.update = UpdateBlock(levels * (2 * radius + 1) ** 2)

    @staticmethod
    def upsample(flow, mask):
        b, _, h, w = flow.shape
        mask = torch.softmax(mask.view(b, 1, 9, 8, 8, h, w), dim=2)
        up = F.unfold(8 * flow, [3, 3], padding=1).view(b, 2, 9, 1, 1, h, w)
        up = torch.sum(mask * up, dim=2).permute(0, 1, 4, 2, 5, 3)
        return up.reshape(b, 2, 8 * h, 8 * w)

    def forward(self, img1, img2, iters=12, use_ckpt=False):
        img1 = 2 * (img1 / 255.0) - 1
        img2 = 2 * (img2 / 255.0) - 1
        f1, f2 = self.fnet(torch.cat([img1, img2], 0)).chunk(2, 0)
        corr_fn = CorrPyramid(f1.float(), f2.float(), self.levels, self.radius)
        net, inp = self.cnet(img1).split([128, 128], 1)
        net, inp = torch.tanh(net), F.relu(inp)
        b, _, h, w = f1.shape
        ys, xs = torch.meshgrid(torch.arange(h, device=img1.device), torch.arange(w, device=img1.device), indexing="ij")
        coords0 = torch.stack([xs, ys], 0).float()[None].repeat(b, 1, 1, 1)
        coords1 = coords0.clone()
        preds = []
        for _ in range(iters):
            coords1 = coords1.detach()
            corr = corr_fn(coords1)
            flow = coords1 - coords0
            if use_ckpt and self.training:
                net, up_mask, delta = checkpoint(self.update, net, inp, corr, flow)
            else:
                net, up_mask, delta = self.update(net, inp, corr, flow)
            coords1 = coords1 + delta
            preds.append(self.upsample(coords1 - coords0, up_mask))
        return preds


# ----------------------------------------------------------------------------- training
def sequence_loss(preds, gt, valid, gamma=0.85, max_flow=400.0):
    mag = gt.pow(2).sum(1).sqrt()
    valid = ((valid >= 0.5) & (mag < max_flow)).unsqueeze(1)
    n = len(preds)
    loss = sum(gamma ** (n - i - 1) * ((p - gt).abs() * valid).mean() for i, p in enumerate(preds))
    epe = (preds[-1] - gt).pow(2).sum(1).sqrt()[valid[:, 0]]
    return loss, epe


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spring_root", required=True)
    ap.add_argument("--init", default=None, help="state_dict from our things-stage run")
    ap.add_argument("--out", default="ckpt_spring")
    ap.add_argument("--steps", type=int, default=60000)
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--iters", type=int, default=16)
    ap.add_argument("--crop", type=int, nargs=2, default=[1080, 1920])
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    model = RAFT().to(dev)
    if args.init:
        sd = torch.load(args.init, map_location="cpu")
        model.load_state_dict({k.removeprefix("module."): v for k, v in sd.items()})
    model = DDP(model, device_ids=[local_rank])

    ds = SpringFlowDataset(args.spring_root, split="train", crop=tuple(args.crop))
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=6, pin_memory=True, drop_last=True)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5, eps=1e-8)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, args.steps + 100, pct_start=0.05,
                                                cycle_momentum=False, anneal_strategy="linear")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    step, epoch = 0, 0
    tic = time.time()
    meter = torch.zeros(3, device=dev)
    model.train()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for img1, img2, flow, valid in dl:
            img1, img2, flow, valid = (t.to(dev, non_blocking=True) for t in (img1, img2, flow, valid))
            preds = model(img1, img2, iters=args.iters, use_ckpt=True)
            loss, epe = sequence_loss(preds, flow, valid)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            meter += torch.stack([loss.detach(), epe.sum().detach(), torch.tensor(float(epe.numel()), device=dev)])
            if step % 100 == 0:
                dist.all_reduce(meter)
                if rank == 0:
                    print(f"step {step} loss {meter[0].item() / (100 * world):.3f} "
                          f"epe {meter[1].item() / meter[2].clamp(min=1).item():.3f} "
                          f"{(time.time() - tic) / 100:.2f}s/it", flush=True)
                meter.zero_()
                tic = time.time()
            if step % 5000 == 0 and rank == 0:
                torch.save(model.module.state_dict(), os.path.join(args.out, f"raft_spring_{step}.pth"))
            if step >= args.steps:
                break
        epoch += 1

    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(args.out, "raft_spring_final.pth"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
