"""Prostate zonal segmentation (MSD Task05: T2 + ADC -> PZ / TZ), residual-encoder U-Net.

    torchrun --nproc_per_node=4 09_prostate_resenc_trainer.py --data /data/prostate_pp --fold 0
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from monai.inferers import sliding_window_inference
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


# ----------------------------------------------------------------------------- network
class ResBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1 = nn.Conv3d(cin, cout, 3, stride, 1, bias=False)
        self.n1 = nn.InstanceNorm3d(cout, affine=True)
        self.c2 = nn.Conv3d(cout, cout, 3, 1, 1, bias=False)
        self.n2 = nn.InstanceNorm3d(cout, affine=True)
        self.skip = (nn.Sequential(nn.Conv3d(cin, cout, 1, stride, bias=False), nn.InstanceNorm3d(cout, affine=True))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x):
        y = F.leaky_relu(self.n1(self.c1(x)), 0.01)
        return F.leaky_relu(self.n2(self.c2(y)) + self.skip(x), 0.01)


class Decoder(nn.Module):
    def __init__(self, chs, strides, num_classes, deep_supervision=True):
        super().__init__()
        self.deep_supervision = deep_supervision
        self.ups, self.blocks, self.seg = nn.ModuleList(), nn.ModuleList(), nn.ModuleList()
        for i in range(len(chs) - 1, 0, -1):
            self.ups.append(nn.ConvTranspose3d(chs[i], chs[i - 1], strides[i], strides[i], bias=False))
            self.blocks.append(ResBlock(2 * chs[i - 1], chs[i - 1], 1))
            self.seg.append(nn.Conv3d(chs[i - 1], num_classes, 1))

    def forward(self, skips):
        x = skips[-1]
        outs = []
        for j, (up, blk, seg) in enumerate(zip(self.ups, self.blocks, self.seg)):
            x = blk(torch.cat([up(x), skips[-(j + 2)]], 1))
            if self.deep_supervision or j == len(self.ups) - 1:
                outs.append(seg(x))
        outs = outs[::-1]
        return outs if self.deep_supervision else outs[0]


class ResEncUNet(nn.Module):
    def __init__(self, in_ch, num_classes, chs=(32, 64, 128, 256, 320), strides=((1, 1, 1), (1, 2, 2), 2, 2, 2)):
        super().__init__()
        enc = []
        for i, c in enumerate(chs):
            enc.append(nn.Sequential(ResBlock(in_ch if i == 0 else chs[i - 1], c, strides[i]), ResBlock(c, c, 1)))
        self.encoder = nn.ModuleList(enc)
        self.decoder = Decoder(chs, strides, num_classes)

    def forward(self, x):
        skips = []
        for stage in self.encoder:
            x = stage(x)
            skips.append(x)
        return self.decoder(skips)


# ----------------------------------------------------------------------------- data
class ProstatePatches(Dataset):
    def __init__(self, folder, cases, patch, oversample=0.33, per_case=10):
        self.folder, self.patch, self.oversample = folder, np.array(patch), oversample
        self.items = [c for c in cases for _ in range(per_case)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        d = np.load(os.path.join(self.folder, self.items[i] + ".npz"))
        img, seg = d["data"], d["seg"]  # (2, Z, Y, X), (1, Z, Y, X)
        need = np.maximum(self.patch - np.array(seg.shape[1:]), 0)
        if need.any():
            pw = [(0, 0)] + [(n // 2, n - n // 2) for n in need]
            img, seg = np.pad(img, pw), np.pad(seg, pw)
        shape = np.array(seg.shape[1:])
        if np.random.rand() < self.oversample and (seg > 0).any():
            fg = np.argwhere(seg[0] > 0)
            ctr = fg[np.random.randint(len(fg))]
            lo = np.clip(ctr - self.patch // 2, 0, shape - self.patch)
        else:
            lo = np.array([np.random.randint(0, s - p + 1) for s, p in zip(shape, self.patch)])
        sl = (slice(None),) + tuple(slice(a, a + p) for a, p in zip(lo, self.patch))
        x, y = img[sl].astype(np.float32), seg[sl].astype(np.int64)
        for ax in (2, 3):
            if np.random.rand() < 0.5:
                x, y = np.flip(x, ax), np.flip(y, ax)
        return torch.from_numpy(x.copy()), torch.from_numpy(y.copy())


def dc_ce(logits, y, n_cls):
    ce = F.cross_entropy(logits, y[:, 0])
    p = logits.float().softmax(1)
    oh = F.one_hot(y[:, 0], n_cls).movedim(-1, 1).float()
    tp = (p * oh).sum((0, 2, 3, 4))
    dc = (2 * tp + 1e-5) / (p.sum((0, 2, 3, 4)) + oh.sum((0, 2, 3, 4)) + 1e-5)
    return ce - dc[1:].mean()


# ----------------------------------------------------------------------------- trainer
class ProstateTrainer:
    num_classes = 3
    patch = (24, 320, 256)

    def __init__(self, args):
        self.args = args
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        with open(os.path.join(args.data, "splits_final.json")) as f:
            self.split = json.load(f)[args.fold]
        self.out = os.path.join(args.out, f"fold_{args.fold}")
        if self.rank == 0:
            os.makedirs(self.out, exist_ok=True)

    def initialize(self):
        net = ResEncUNet(2, self.num_classes).to(self.device)
        self.n_ds = len(net.decoder.seg)
        self.network = DDP(net, device_ids=[self.local_rank])
        self.optimizer = torch.optim.SGD(self.network.parameters(), self.args.lr, momentum=0.99,
                                         nesterov=True, weight_decay=3e-5)
        w = np.array([1 / 2 ** i for i in range(self.n_ds)])
        self.ds_weights = w / w.sum()
        self.grad_scaler = torch.cuda.amp.GradScaler()
        ds = ProstatePatches(self.args.data, self.split["train"], self.patch)
        self.sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
        self.loader = DataLoader(ds, batch_size=self.args.batch_size, sampler=self.sampler,
                                 num_workers=6, pin_memory=True, persistent_workers=True)

    def set_deep_supervision_enabled(self, enabled):
        self.network.decoder.deep_supervision = enabled

    def targets(self, y, outs):
        return [y if o.shape[2:] == y.shape[2:] else
                F.interpolate(y.float(), size=o.shape[2:], mode="nearest").long() for o in outs]

    def train_epoch(self, epoch):
        self.network.train()
        self.sampler.set_epoch(epoch)
        lr = self.args.lr * (1 - epoch / self.args.epochs) ** 0.9
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        acc = torch.zeros(2, device=self.device)
        for x, y in self.loader:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            self.optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                outs = self.network(x)
                loss = sum(w * dc_ce(o, t, self.num_classes)
                           for w, o, t in zip(self.ds_weights, outs, self.targets(y, outs)))
            self.grad_scaler.scale(loss).backward()
            self.grad_scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.network.parameters(), 12)
            self.grad_scaler.step(self.optimizer)
            self.grad_scaler.update()
            acc += torch.stack([loss.detach().float(), torch.ones((), device=self.device)])
        dist.all_reduce(acc)
        return (acc[0] / acc[1]).item(), lr

    @torch.no_grad()
    def validate(self):
        self.set_deep_supervision_enabled(False)
        self.network.eval()
        mine = []
        for case in self.split["val"][self.rank::self.world]:
            d = np.load(os.path.join(self.args.data, case + ".npz"))
            x = torch.from_numpy(d["data"][None].astype(np.float32)).to(self.device)
            gt = torch.from_numpy(d["seg"][0]).to(self.device)
            with torch.autocast("cuda", dtype=torch.float16):
                pred = sliding_window_inference(x, self.patch, 2, self.network, overlap=0.5,
                                                mode="gaussian").argmax(1)[0]
            scores = []
            for c in range(1, self.num_classes):
                p, g = pred == c, gt == c
                s = p.sum() + g.sum()
                scores.append(float("nan") if g.sum() == 0 else (2 * (p & g).sum() / s).item())
            mine.append(scores)
        self.set_deep_supervision_enabled(True)
        allp = [None] * self.world
        dist.all_gather_object(allp, mine)
        arr = np.array([s for part in allp for s in part])
        return np.nanmean(arr, 0)

    def save(self, name, epoch, best):
        if self.rank == 0:
            torch.save({"network_weights": self.network.module.state_dict(),
                        "optimizer_state": self.optimizer.state_dict(),
                        "grad_scaler_state": self.grad_scaler.state_dict(),
                        "current_epoch": epoch, "best": best}, os.path.join(self.out, name))

    def run(self):
        self.initialize()
        best = -1.0
        for epoch in range(self.args.epochs):
            t0 = time.time()
            loss, lr = self.train_epoch(epoch)
            if self.rank == 0:
                print(f"epoch {epoch:4d} lr {lr:.5f} loss {loss:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if (epoch + 1) % self.args.val_every == 0:
                pz, tz = self.validate()
                mean = (pz + tz) / 2
                if self.rank == 0:
                    print(f"           val PZ {pz:.4f} TZ {tz:.4f} mean {mean:.4f}", flush=True)
                if mean > best:
                    best = mean
                    self.save("checkpoint_best.pth", epoch, best)
            if (epoch + 1) % 50 == 0:
                self.save("checkpoint_latest.pth", epoch, best)
        self.save("checkpoint_final.pth", self.args.epochs - 1, best)
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="results/prostate")
    ap.add_argument("--fold", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=1000)
    ap.add_argument("--batch_size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--val_every", type=int, default=25)
    ProstateTrainer(ap.parse_args()).run()
