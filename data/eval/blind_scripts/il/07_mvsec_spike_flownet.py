"""Spike-FlowNet style hybrid SNN-ANN optical flow on MVSEC (supervised, dt=1).

Spiking encoder integrates the event voxel bins over time; the accumulated
encoder spikes feed an ANN decoder that predicts flow at four scales.

Data is the preprocessed MVSEC layout produced by tools/prep_mvsec.py:
    <root>/<sequence>/<idx:06d>.npz with 'voxel' [B,2,260,346] and 'flow' [2,260,346]

torchrun --nproc_per_node=4 07_mvsec_spike_flownet.py --root /data/mvsec_prep
"""
import argparse
import glob
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

TRAIN_SEQS = ["outdoor_day2"]
TEST_SEQS = ["indoor_flying1", "indoor_flying2", "indoor_flying3"]
CROP = (256, 256)


class MVSECFlow(Dataset):
    def __init__(self, root, seqs, train):
        self.files = sorted(f for s in seqs for f in glob.glob(os.path.join(root, s, "*.npz")))
        self.train = train

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = np.load(self.files[i])
        vox = torch.from_numpy(d["voxel"]).float()   # [B, 2, 260, 346]
        flow = torch.from_numpy(d["flow"]).float()   # [2, 260, 346]
        H, W = flow.shape[-2:]
        if self.train:
            y0 = np.random.randint(0, H - CROP[0] + 1)
            x0 = np.random.randint(0, W - CROP[1] + 1)
        else:
            y0, x0 = 2, 45  # central crop used in the EV-FlowNet evaluation
        vox = vox[..., y0:y0 + CROP[0], x0:x0 + CROP[1]]
        flow = flow[:, y0:y0 + CROP[0], x0:x0 + CROP[1]]
        if self.train and np.random.rand() < 0.5:
            vox = torch.flip(vox, dims=[-1])
            flow = torch.flip(flow, dims=[-1])
            flow[0] = -flow[0]
        return vox, flow


class SpikeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mem, th):
        ctx.save_for_backward(mem)
        ctx.th = th
        return (mem > th).float()

    @staticmethod
    def backward(ctx, g):
        (mem,) = ctx.saved_tensors
        # rectangular surrogate around the threshold
        return g * ((mem - ctx.th).abs() < 0.5).float(), None


class SpikingEncoder(nn.Module):
    def __init__(self, chans=(2, 64, 128, 256, 512), leak=0.9, th=0.75):
        super().__init__()
        self.convs = nn.ModuleList(
            nn.Conv2d(a, b, 3, stride=2, padding=1, bias=False) for a, b in zip(chans[:-1], chans[1:]))
        self.leak, self.th = leak, th

    def forward(self, vox):
        # vox [N, B, 2, H, W]; returns per-layer spike counts summed over bins
        mems = [None] * len(self.convs)
        acc = [None] * len(self.convs)
        for t in range(vox.size(1)):
            x = vox[:, t]
            for i, conv in enumerate(self.convs):
                cur = conv(x)
                mems[i] = cur if mems[i] is None else self.leak * mems[i] + cur
                s = SpikeFn.apply(mems[i], self.th)
                mems[i] = mems[i] - s * self.th  # soft reset
                acc[i] = s if acc[i] is None else acc[i] + s
                x = s
        return acc


def deconv(cin, cout):
    return nn.Sequential(nn.ConvTranspose2d(cin, cout, 4, stride=2, padding=1), nn.LeakyReLU(0.1, inplace=True))


class SpikeFlowNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = SpikingEncoder()
        self.res = nn.Sequential(
            nn.Conv2d(512, 512, 3, padding=1), nn.LeakyReLU(0.1, inplace=True),
            nn.Conv2d(512, 512, 3, padding=1), nn.LeakyReLU(0.1, inplace=True))
        self.up4 = deconv(512, 256)
        self.up3 = deconv(256 + 256, 128)
        self.up2 = deconv(128 + 128, 64)
        self.up1 = deconv(64 + 64, 32)
        self.pred4 = nn.Conv2d(256, 2, 3, padding=1)
        self.pred3 = nn.Conv2d(128, 2, 3, padding=1)
        self.pred2 = nn.Conv2d(64, 2, 3, padding=1)
        self.pred1 = nn.Conv2d(32, 2, 3, padding=1)

    def forward(self, vox):
        e1, e2, e3, e4 = self.encoder(vox)
        x = self.res(e4) + e4
        d4 = self.up4(x)
        d3 = self.up3(torch.cat([d4, e3], 1))
        d2 = self.up2(torch.cat([d3, e2], 1))
        d1 = self.up1(torch.cat([d2, e1], 1))
        # coarse -> fine
        return self.pred4(d4), self.pred3(d3), self.pred2(d2), self.pred1(d1)


def charbonnier(pred, gt, valid, eps=1e-3, q=0.45):
    pred = F.interpolate(pred, size=gt.shape[-2:], mode="bilinear", align_corners=False)
    err = ((pred - gt) ** 2 + eps ** 2) ** q
    return (err.sum(1) * valid).sum() / valid.sum().clamp(min=1)


def valid_mask(flow, vox):
    has_events = vox.abs().sum(dim=(1, 2)) > 0
    has_gt = (flow.abs().sum(1) > 0) & torch.isfinite(flow).all(1)
    return (has_events & has_gt).float()


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    tot = torch.zeros(3, device=device)  # sum AEE, #pixels, #outliers(>3px)
    for vox, flow in loader:
        vox, flow = vox.to(device), flow.to(device)
        pred = F.interpolate(net(vox)[-1], size=flow.shape[-2:], mode="bilinear", align_corners=False)
        mask = valid_mask(flow, vox).bool()
        epe = torch.norm(pred - flow, dim=1)[mask]
        tot += torch.stack([epe.sum(), torch.tensor(float(epe.numel()), device=device), (epe > 3).sum().float()])
    dist.all_reduce(tot)
    return (tot[0] / tot[1]).item(), (tot[2] / tot[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", default="runs/spike_flownet")
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--multiscale-weights", default="1.0",
                    help="comma separated loss weights, finest scale first")
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_set = MVSECFlow(args.root, TRAIN_SEQS, train=True)
    test_set = MVSECFlow(args.root, TEST_SEQS, train=False)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    test_loader = DataLoader(torch.utils.data.Subset(test_set, range(rank, len(test_set), world)),
                             batch_size=args.batch_size, num_workers=args.workers, pin_memory=True)

    model = DDP(SpikeFlowNet().to(device), device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999), weight_decay=4e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[40, 60, 80], gamma=0.7)
    weights = [float(w) for w in args.multiscale_weights.split(",")]

    writer = SummaryWriter(args.out) if rank == 0 else None
    global_step, best_aee = 0, float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for vox, flow in train_loader:
            vox = vox.to(device, non_blocking=True)
            flow = flow.to(device, non_blocking=True)
            mask = valid_mask(flow, vox)
            preds = model(vox)
            loss = sum(w * charbonnier(p, flow, mask) for w, p in zip(weights, reversed(preds)))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if rank == 0 and global_step % 100 == 0:
                writer.add_scalar("train/loss_rank0", loss.item(), global_step)
            global_step += 1
        scheduler.step()

        aee, outliers = evaluate(model.module, test_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: AEE {aee:.3f}  %Out {100 * outliers:.2f}", flush=True)
            writer.add_scalar("test/AEE", aee, epoch)
            writer.add_scalar("test/outliers", outliers, epoch)
            ckpt = {"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save(ckpt, os.path.join(args.out, "last.pth"))
            if aee < best_aee:
                best_aee = aee
                torch.save(ckpt, os.path.join(args.out, "best.pth"))

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
