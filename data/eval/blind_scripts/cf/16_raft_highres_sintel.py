"""High-resolution RAFT fine-tuning (full 436x1024 Sintel frames, 24 refinement iterations).

Activation memory of the GRU refinements grows linearly with the number of iterations, so the
recurrent update can be recomputed in the backward pass (--grad_ckpt).

    torchrun --nproc_per_node=4 train_highres.py --restore raft-things.pth --grad_ckpt --iters 24
"""
import argparse
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from core import datasets
from core.corr import CorrBlock
from core.extractor import BasicEncoder
from core.utils.utils import InputPadder, coords_grid


class ConvGRU(nn.Module):
    def __init__(self, hidden_dim=128, input_dim=256):
        super().__init__()
        self.convz = nn.Conv2d(hidden_dim + input_dim, hidden_dim, 3, padding=1)
        self.convr = nn.Conv2d(hidden_dim + input_dim, hidden_dim, 3, padding=1)
        self.convq = nn.Conv2d(hidden_dim + input_dim, hidden_dim, 3, padding=1)

    def forward(self, h, x):
        hx = torch.cat([h, x], dim=1)
        z = torch.sigmoid(self.convz(hx))
        r = torch.sigmoid(self.convr(hx))
        q = torch.tanh(self.convq(torch.cat([r * h, x], dim=1)))
        return (1 - z) * h + z * q


class UpdateBlock(nn.Module):
    def __init__(self, corr_planes, hidden_dim=128):
        super().__init__()
        self.convc1 = nn.Conv2d(corr_planes, 256, 1)
        self.convc2 = nn.Conv2d(256, 192, 3, padding=1)
        self.convf1 = nn.Conv2d(2, 128, 7, padding=3)
        self.convf2 = nn.Conv2d(128, 64, 3, padding=1)
        self.conv = nn.Conv2d(64 + 192, 128 - 2, 3, padding=1)
        self.gru = ConvGRU(hidden_dim, 128 + hidden_dim)
        self.flow_head = nn.Sequential(nn.Conv2d(hidden_dim, 256, 3, padding=1), nn.ReLU(inplace=True),
                                       nn.Conv2d(256, 2, 3, padding=1))
        self.mask = nn.Sequential(nn.Conv2d(hidden_dim, 256, 3, padding=1), nn.ReLU(inplace=True),
                                  nn.Conv2d(256, 64 * 9, 1, padding=0))

    def forward(self, net, inp, corr, flow):
        cor = F.relu(self.convc2(F.relu(self.convc1(corr))))
        flo = F.relu(self.convf2(F.relu(self.convf1(flow))))
        motion = torch.cat([F.relu(self.conv(torch.cat([cor, flo], dim=1))), flow], dim=1)
        net = self.gru(net, torch.cat([inp, motion], dim=1))
        delta_flow = self.flow_head(net)
        mask = 0.25 * self.mask(net)
        return net, mask, delta_flow


class RAFT(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.hidden_dim = self.context_dim = 128
        self.corr_levels, self.corr_radius = 4, 4
        self.grad_ckpt = args.grad_ckpt
        self.fnet = BasicEncoder(output_dim=256, norm_fn="instance", dropout=0.0)
        self.cnet = BasicEncoder(output_dim=256, norm_fn="group", dropout=0.0)
        self.update_block = UpdateBlock(self.corr_levels * (2 * self.corr_radius + 1) ** 2, self.hidden_dim)

    @staticmethod
    def upsample_flow(flow, mask):
        N, _, H, W = flow.shape
        mask = torch.softmax(mask.view(N, 1, 9, 8, 8, H, W), dim=2)
        up_flow = F.unfold(8 * flow, [3, 3], padding=1).view(N, 2, 9, 1, 1, H, W)
        up_flow = torch.sum(mask * up_flow, dim=2).permute(0, 1, 4, 2, 5, 3)
        return up_flow.reshape(N, 2, 8 * H, 8 * W)

    def forward(self, image1, image2, iters=12, test_mode=False):
        image1 = 2 * (image1 / 255.0) - 1.0
        image2 = 2 * (image2 / 255.0) - 1.0
        fmap1, fmap2 = self.fnet([image1, image2])
        corr_fn = CorrBlock(fmap1.float(), fmap2.float(), num_levels=self.corr_levels, radius=self.corr_radius)
        net, inp = torch.split(self.cnet(image1), [self.hidden_dim, self.context_dim], dim=1)
        net, inp = torch.tanh(net), torch.relu(inp)

        N, _, H, W = image1.shape
        coords0 = coords_grid(N, H // 8, W // 8, device=image1.device)
        coords1 = coords_grid(N, H // 8, W // 8, device=image1.device)
        predictions = []
        for _ in range(iters):
            coords1 = coords1.detach()
            corr = corr_fn(coords1)
            flow = coords1 - coords0
            if self.grad_ckpt and self.training:
                net, up_mask, delta_flow = checkpoint(self.update_block, net, inp, corr, flow)
            else:
                net, up_mask, delta_flow = self.update_block(net, inp, corr, flow)
            coords1 = coords1 + delta_flow
            predictions.append(self.upsample_flow(coords1 - coords0, up_mask))
        if test_mode:
            return coords1 - coords0, predictions[-1]
        return predictions


def sequence_loss(preds, gt, valid, gamma=0.85, max_flow=400):
    valid = (valid >= 0.5) & (gt.norm(dim=1) < max_flow)
    n = len(preds)
    return sum(gamma ** (n - i - 1) * (valid[:, None] * (p - gt).abs()).mean() for i, p in enumerate(preds))


@torch.no_grad()
def validate(model, device, rank, world):
    model.eval()
    out = {}
    for dstype in ("clean", "final"):
        ds = datasets.MpiSintel(split="training", dstype=dstype)
        s = torch.zeros(2, device=device, dtype=torch.float64)
        for i in range(rank, len(ds), world):
            im1, im2, gt, _ = ds[i]
            im1, im2 = im1[None].to(device), im2[None].to(device)
            padder = InputPadder(im1.shape)
            im1, im2 = padder.pad(im1, im2)
            _, flow = model(im1, im2, iters=32, test_mode=True)
            epe = (padder.unpad(flow[0]) - gt.to(device)).norm(dim=0)
            s += torch.stack([epe.sum().double(), torch.tensor(epe.numel(), device=device, dtype=torch.float64)])
        dist.all_reduce(s)
        out[dstype] = (s[0] / s[1]).item()
    model.train()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--restore", required=True, help="weights of this model after the things stage")
    ap.add_argument("--grad_ckpt", action="store_true")
    ap.add_argument("--iters", type=int, default=24)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--steps", type=int, default=60000)
    ap.add_argument("--batch_per_gpu", type=int, default=2)
    ap.add_argument("--out", default="checkpoints/highres")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    model = RAFT(args)
    sd = torch.load(args.restore, map_location="cpu")
    model.load_state_dict({k.replace("module.", ""): v for k, v in sd.items()})
    model = DDP(model.to(device), device_ids=[local_rank])

    aug = {"crop_size": [432, 1016], "min_scale": 0.0, "max_scale": 0.2, "do_flip": True}
    train_set = 10 * datasets.MpiSintel(aug, split="training", dstype="clean") + \
        10 * datasets.MpiSintel(aug, split="training", dstype="final")
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_per_gpu, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5, eps=1e-8)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, args.steps + 100, pct_start=0.05,
                                                    cycle_momentum=False, anneal_strategy="linear")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    step, epoch = 0, 0
    running = torch.zeros(1, device=device)
    while step < args.steps:
        sampler.set_epoch(epoch)
        for im1, im2, flow, valid in loader:
            im1, im2 = im1.to(device, non_blocking=True), im2.to(device, non_blocking=True)
            flow, valid = flow.to(device, non_blocking=True), valid.to(device, non_blocking=True)
            preds = model(im1, im2, iters=args.iters)
            loss = sequence_loss(preds, flow, valid)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            running += loss.detach()
            step += 1
            if step % 100 == 0:
                dist.all_reduce(running)
                if rank == 0:
                    print(f"step {step} loss {running.item() / (100 * world):.4f}", flush=True)
                running.zero_()
            if step % 5000 == 0:
                res = validate(model.module, device, rank, world)
                if rank == 0:
                    print("sintel (train split):", res, flush=True)
                    torch.save(model.module.state_dict(), os.path.join(args.out, f"{step}.pth"))
            if step >= args.steps:
                break
        epoch += 1

    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(args.out, "final.pth"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
