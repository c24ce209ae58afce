"""
nnU-Net style 3d_fullres trainer (plain conv UNet + deep supervision) on preprocessed .npz data.

Preprocessed folder layout (produced by our preprocessing script):
    <preprocessed>/<case>.npz  with keys data (C, Z, Y, X) float32 and seg (1, Z, Y, X) int8
    <preprocessed>/splits_final.json

torchrun --nproc_per_node=4 03_nnunet_style_ds_trainer.py --preprocessed /data/nnUNet_preprocessed/Task017 --fold 0
"""
import argparse
import json
import os
from time import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss


class ConvDropoutNormNonlin(nn.Sequential):
    def __init__(self, cin, cout, stride=1):
        super().__init__(
            nn.Conv3d(cin, cout, 3, stride, 1),
            nn.InstanceNorm3d(cout, eps=1e-5, affine=True),
            nn.LeakyReLU(0.01, inplace=True),
        )


class PlainConvUNet(nn.Module):
    def __init__(self, in_ch, num_classes, features=(32, 64, 128, 256, 320, 320)):
        super().__init__()
        self.do_ds = True
        self.encoders = nn.ModuleList()
        c = in_ch
        for i, f in enumerate(features):
            stride = 1 if i == 0 else 2
            self.encoders.append(nn.Sequential(ConvDropoutNormNonlin(c, f, stride), ConvDropoutNormNonlin(f, f)))
            c = f
        self.ups, self.decoders, self.seg_heads = nn.ModuleList(), nn.ModuleList(), nn.ModuleList()
        for i in range(len(features) - 1, 0, -1):
            self.ups.append(nn.ConvTranspose3d(features[i], features[i - 1], 2, 2, bias=False))
            self.decoders.append(nn.Sequential(ConvDropoutNormNonlin(2 * features[i - 1], features[i - 1]),
                                               ConvDropoutNormNonlin(features[i - 1], features[i - 1])))
            self.seg_heads.append(nn.Conv3d(features[i - 1], num_classes, 1, 1, 0, bias=False))

    def forward(self, x):
        skips = []
        for enc in self.encoders:
            x = enc(x)
            skips.append(x)
        x = skips.pop()
        seg_outputs = []
        for up, dec, head in zip(self.ups, self.decoders, self.seg_heads):
            x = dec(torch.cat([up(x), skips.pop()], dim=1))
            seg_outputs.append(head(x))
        if self.do_ds:
            # highest resolution first
            return tuple(seg_outputs[::-1])
        return seg_outputs[-1]


class NpzPatchDataset(Dataset):
    """One random patch per case per epoch, with foreground oversampling as in nnU-Net."""

    def __init__(self, folder, cases, patch_size, oversample_fg=0.33):
        self.folder, self.cases = folder, cases
        self.patch_size = np.array(patch_size)
        self.oversample_fg = oversample_fg

    def __len__(self):
        return len(self.cases)

    def __getitem__(self, idx):
        d = np.load(os.path.join(self.folder, self.cases[idx] + ".npz"))
        data, seg = d["data"], d["seg"]
        shape = np.array(data.shape[1:])
        pad = np.maximum(self.patch_size - shape, 0)
        if pad.any():
            pw = [(0, 0)] + [(p // 2, p - p // 2) for p in pad]
            data = np.pad(data, pw, mode="constant")
            seg = np.pad(seg, pw, mode="constant", constant_values=-1)
            shape = np.array(data.shape[1:])
        fg = np.argwhere(seg[0] > 0)
        if len(fg) and np.random.rand() < self.oversample_fg:
            center = fg[np.random.randint(len(fg))]
            lb = np.clip(center - self.patch_size // 2, 0, shape - self.patch_size)
        else:
            lb = np.array([np.random.randint(0, s - p + 1) for s, p in zip(shape, self.patch_size)])
        sl = tuple(slice(l, l + p) for l, p in zip(lb, self.patch_size))
        x = data[(slice(None),) + sl]
        y = seg[(slice(None),) + sl].astype(np.int64)
        y[y < 0] = 0
        for ax in (1, 2, 3):
            if np.random.rand() < 0.5:
                x, y = np.flip(x, ax), np.flip(y, ax)
        return torch.from_numpy(x.copy()), torch.from_numpy(y.copy())


def seed_worker(worker_id):
    np.random.seed(torch.initial_seed() % 2 ** 32)


class DSLoss(nn.Module):
    def __init__(self, n_outputs):
        super().__init__()
        w = np.array([1 / (2 ** i) for i in range(n_outputs)])
        self.weights = (w / w.sum()).tolist()
        self.loss = DiceCELoss(to_onehot_y=True, softmax=True, include_background=False, batch=True)

    def forward(self, outputs, target):
        total = 0.0
        for w, out in zip(self.weights, outputs):
            t = target if out.shape[2:] == target.shape[2:] else F.interpolate(
                target.float(), size=out.shape[2:], mode="nearest").long()
            total = total + w * self.loss(out, t)
        return total


class Trainer:
    def __init__(self, args):
        self.args = args
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        self.out = os.path.join(args.output, f"fold_{args.fold}")
        os.makedirs(self.out, exist_ok=True)

        with open(os.path.join(args.preprocessed, "splits_final.json")) as f:
            split = json.load(f)[args.fold]
        with open(os.path.join(args.preprocessed, "plans.json")) as f:
            plans = json.load(f)
        self.patch_size = plans["patch_size"]
        self.num_classes = plans["num_classes"]
        self.val_cases = split["val"]

        self.train_ds = NpzPatchDataset(args.preprocessed, split["train"], self.patch_size)
        self.sampler = DistributedSampler(self.train_ds, shuffle=True, drop_last=True)
        self.loader = DataLoader(self.train_ds, batch_size=args.batch_size, sampler=self.sampler,
                                 num_workers=6, pin_memory=True, worker_init_fn=seed_worker,
                                 persistent_workers=True)

        net = PlainConvUNet(plans["num_modalities"], self.num_classes).to(self.device)
        self.network = DDP(net, device_ids=[self.local_rank])
        self.loss = DSLoss(len(net.seg_heads))
        self.optimizer = torch.optim.SGD(self.network.parameters(), args.initial_lr, momentum=0.99,
                                         nesterov=True, weight_decay=3e-5)
        self.scaler = torch.cuda.amp.GradScaler()
        self.best_ema = None

    def poly_lr(self, epoch):
        return self.args.initial_lr * (1 - epoch / self.args.max_epochs) ** 0.9

    def train_epoch(self, epoch):
        self.network.train()
        self.sampler.set_epoch(epoch)
        for g in self.optimizer.param_groups:
            g["lr"] = self.poly_lr(epoch)
        losses = []
        for _ in range(self.args.repeats_per_epoch):
            for x, y in self.loader:
                x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
                self.optimizer.zero_grad(set_to_none=True)
                with torch.autocast("cuda", dtype=torch.float16):
                    out = self.network(x)
                    l = self.loss(out, y)
                self.scaler.scale(l).backward()
                self.scaler.unscale_(self.optimizer)
                torch.nn.utils.clip_grad_norm_(self.network.parameters(), 12)
                self.scaler.step(self.optimizer)
                self.scaler.update()
                losses.append(l.detach())
        mean_loss = torch.stack(losses).mean()
        dist.all_reduce(mean_loss)
        return mean_loss.item() / self.world

    @torch.no_grad()
    def validate(self):
        self.network.eval()
        self.network.do_ds = False
        tp = torch.zeros(self.num_classes - 1, device=self.device)
        fp, fn = torch.zeros_like(tp), torch.zeros_like(tp)
        for case in self.val_cases[self.rank::self.world]:
            d = np.load(os.path.join(self.args.preprocessed, case + ".npz"))
            x = torch.from_numpy(d["data"])[None].to(self.device)
            y = torch.from_numpy(d["seg"].astype(np.int64)).to(self.device)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = sliding_window_inference(x, self.patch_size, 2, self.network, overlap=0.5, mode="gaussian")
            pred = torch.softmax(logits.float(), 1).argmax(1)
            for c in range(1, self.num_classes):
                p, t = pred == c, y[0] == c
                tp[c - 1] += (p & t).sum()
                fp[c - 1] += (p & ~t).sum()
                fn[c - 1] += (~p & t).sum()
        for t in (tp, fp, fn):
            dist.all_reduce(t)
        self.network.do_ds = True
        dice = (2 * tp / (2 * tp + fp + fn).clamp(min=1)).cpu().numpy()
        return float(dice.mean()), dice

    def save(self, name, epoch):
        if self.rank == 0:
            torch.save({"epoch": epoch, "state_dict": self.network.module.state_dict(),
                        "optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict(),
                        "best_ema": self.best_ema}, os.path.join(self.out, name))

    def run(self):
        ema = None
        for epoch in range(self.args.max_epochs):
            t0 = time()
            train_loss = self.train_epoch(epoch)
            dice, per_class = self.validate()
            ema = dice if ema is None else 0.9 * ema + 0.1 * dice
            if self.rank == 0:
                print(f"epoch {epoch:4d} loss {train_loss:.4f} pseudo dice {np.round(per_class, 4)} "
                      f"ema {ema:.4f} lr {self.poly_lr(epoch):.5f} {time() - t0:.0f}s", flush=True)
            if self.best_ema is None or ema > self.best_ema:
                self.best_ema = ema
                self.save("checkpoint_best.pth", epoch)
            if (epoch + 1) % 50 == 0:
                self.save("checkpoint_latest.pth", epoch)
        self.save("checkpoint_final.pth", self.args.max_epochs - 1)
        dist.barrier()
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preprocessed", required=True)
    p.add_argument("--output", default="./nnunet_results/3d_fullres")
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--max_epochs", type=int, default=1000)
    p.add_argument("--batch_size", type=int, default=2, help="per GPU")
    p.add_argument("--repeats_per_epoch", type=int, default=4)
    p.add_argument("--initial_lr", type=float, default=1e-2)
    Trainer(p.parse_args()).run()


if __name__ == "__main__":
    main()
