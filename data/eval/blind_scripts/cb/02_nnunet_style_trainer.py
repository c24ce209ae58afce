"""Minimal nnU-Net-like 3d_fullres trainer with DDP.

Data is expected in nnU-Net preprocessed layout: one <case>.npz per case with
'data' (C, X, Y, Z) and 'seg' (1, X, Y, Z), plus <case>.pkl with the sampled
foreground locations ('class_locations').

    torchrun --standalone --nproc_per_node=4 02_nnunet_style_trainer.py \
        --preprocessed /data/nnUNet_preprocessed/Dataset004_Hippocampus --fold 2
"""
import argparse
import json
import os
import pickle
from time import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preprocessed", required=True)
    ap.add_argument("--fold", type=int, default=0)
    ap.add_argument("--output", default="nnunet_results")
    ap.add_argument("--global_batch_size", type=int, default=8)
    ap.add_argument("--patch_size", type=int, nargs=3, default=[40, 56, 40])
    ap.add_argument("--epochs", type=int, default=1000)
    ap.add_argument("--iters_per_epoch", type=int, default=250)
    ap.add_argument("--initial_lr", type=float, default=1e-2)
    ap.add_argument("--oversample_fg", type=float, default=0.33)
    ap.add_argument("--num_classes", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--continue_training", action="store_true")
    return ap.parse_args()


class ConvBlock(nn.Sequential):
    def __init__(self, cin, cout, stride):
        super().__init__(
            nn.Conv3d(cin, cout, 3, stride, 1, bias=True),
            nn.InstanceNorm3d(cout, eps=1e-5, affine=True),
            nn.LeakyReLU(0.01, inplace=True),
            nn.Conv3d(cout, cout, 3, 1, 1, bias=True),
            nn.InstanceNorm3d(cout, eps=1e-5, affine=True),
            nn.LeakyReLU(0.01, inplace=True),
        )


class PlainConvUNet(nn.Module):
    def __init__(self, in_ch, num_classes, features=(32, 64, 128, 256), deep_supervision=True):
        super().__init__()
        self.deep_supervision = deep_supervision
        self.encoder = nn.ModuleList()
        c = in_ch
        for i, f in enumerate(features):
            self.encoder.append(ConvBlock(c, f, 1 if i == 0 else 2))
            c = f
        self.up = nn.ModuleList()
        self.decoder = nn.ModuleList()
        self.seg_layers = nn.ModuleList()
        for f in reversed(features[:-1]):
            self.up.append(nn.ConvTranspose3d(c, f, 2, 2, bias=False))
            self.decoder.append(ConvBlock(2 * f, f, 1))
            self.seg_layers.append(nn.Conv3d(f, num_classes, 1))
            c = f

    def forward(self, x):
        skips = []
        for blk in self.encoder:
            x = blk(x)
            skips.append(x)
        x = skips.pop()
        outs = []
        for up, dec, seg in zip(self.up, self.decoder, self.seg_layers):
            x = dec(torch.cat([up(x), skips.pop()], 1))
            outs.append(seg(x))
        outs = outs[::-1]  # full resolution first
        return outs if self.deep_supervision else outs[0]


class DCandCE(nn.Module):
    def __init__(self, smooth=1e-5):
        super().__init__()
        self.smooth = smooth

    def forward(self, logits, target):
        ce = F.cross_entropy(logits, target[:, 0].long())
        probs = logits.softmax(1)
        oh = torch.zeros_like(probs).scatter_(1, target.long(), 1)
        axes = (0, 2, 3, 4)  # batch dice
        tp = (probs * oh).sum(axes)
        denom = probs.sum(axes) + oh.sum(axes)
        dc = (2 * tp + self.smooth) / (denom + self.smooth)
        return ce - dc[1:].mean()


class DeepSupervisionLoss(nn.Module):
    def __init__(self, loss, n_outputs):
        super().__init__()
        w = np.array([1 / (2 ** i) for i in range(n_outputs)])
        self.weights = (w / w.sum()).tolist()
        self.loss = loss

    def forward(self, outputs, targets):
        return sum(w * self.loss(o, t) for w, o, t in zip(self.weights, outputs, targets))


class RandomPatchDataset(IterableDataset):
    """Infinite stream of batches: each rank (and worker) draws its own random cases, nnU-Net style."""

    def __init__(self, folder, keys, batch_size, patch_size, oversample, seed):
        self.folder, self.keys = folder, keys
        self.bs, self.patch = batch_size, np.array(patch_size)
        self.oversample, self.seed = oversample, seed
        self.rng = None

    def _load(self, key):
        arr = np.load(os.path.join(self.folder, key + ".npz"))
        with open(os.path.join(self.folder, key + ".pkl"), "rb") as f:
            props = pickle.load(f)
        return arr["data"], arr["seg"], props

    def _crop(self, data, seg, props, force_fg):
        shape = np.array(data.shape[1:])
        need = np.maximum(self.patch - shape, 0)
        lb, ub = -need // 2, shape + need // 2 + need % 2 - self.patch
        locs = {k: v for k, v in props["class_locations"].items() if len(v) > 0}
        if force_fg and locs:
            cls = self.rng.choice(list(locs.keys()))
            vox = locs[cls][self.rng.integers(len(locs[cls]))]
            start = [max(lb[d], vox[d + 1] - self.patch[d] // 2) for d in range(3)]
            start = [min(start[d], ub[d]) for d in range(3)]
        else:
            start = [self.rng.integers(lb[d], ub[d] + 1) for d in range(3)]
        end = [s + p for s, p in zip(start, self.patch)]
        sl = tuple(slice(max(0, s), min(e, shape[d])) for d, (s, e) in enumerate(zip(start, end)))
        pad = [(max(0, -s), max(0, e - shape[d])) for d, (s, e) in enumerate(zip(start, end))]
        d = np.pad(data[(slice(None),) + sl], [(0, 0)] + pad)
        s = np.pad(seg[(slice(None),) + sl], [(0, 0)] + pad, constant_values=0)
        return d, s

    def __iter__(self):
        info = get_worker_info()
        wid = info.id if info is not None else 0
        self.rng = np.random.default_rng(self.seed + 97 * wid)
        while True:
            yield self._batch()

    def _batch(self):
        xs, ys = [], []
        for j in range(self.bs):
            key = self.keys[self.rng.integers(len(self.keys))]
            data, seg, props = self._load(key)
            force_fg = j >= round(self.bs * (1 - self.oversample))
            d, s = self._crop(data, seg, props, force_fg)
            for ax in (1, 2, 3):
                if self.rng.random() < 0.5:
                    d, s = np.flip(d, ax), np.flip(s, ax)
            xs.append(np.ascontiguousarray(d))
            ys.append(np.ascontiguousarray(s))
        return torch.from_numpy(np.stack(xs)).float(), torch.from_numpy(np.stack(ys)).float()


def downsample_targets(seg, n):
    return [seg if i == 0 else F.interpolate(seg, scale_factor=0.5 ** i, mode="nearest") for i in range(n)]


def gaussian_map(patch, sigma_scale=1 / 8):
    tmp = np.zeros(patch)
    grids = np.meshgrid(*[np.arange(p) - p // 2 for p in patch], indexing="ij")
    sig = [p * sigma_scale for p in patch]
    tmp = np.exp(-sum(g ** 2 / (2 * s ** 2) for g, s in zip(grids, sig)))
    tmp = tmp / tmp.max()
    tmp[tmp == 0] = tmp[tmp != 0].min()
    return torch.from_numpy(tmp).float()


@torch.no_grad()
def sliding_window(net, data, patch, num_classes, device, step=0.5):
    _, *shape = data.shape
    pad = [max(0, p - s) for p, s in zip(patch, shape)]
    x = F.pad(torch.from_numpy(data), [v for p in reversed(pad) for v in (p // 2, p - p // 2)])
    shp = x.shape[1:]
    steps = [sorted(set(np.linspace(0, s - p, max(1, int(np.ceil((s - p) / (p * step))) + 1)).round().astype(int)))
             for s, p in zip(shp, patch)]
    logits = torch.zeros((num_classes, *shp), device=device)
    counts = torch.zeros(shp, device=device)
    g = gaussian_map(patch).to(device)
    for sx in steps[0]:
        for sy in steps[1]:
            for sz in steps[2]:
                sl = (slice(sx, sx + patch[0]), slice(sy, sy + patch[1]), slice(sz, sz + patch[2]))
                inp = x[(slice(None),) + sl][None].to(device)
                out = net(inp)[0].float().softmax(0)
                logits[(slice(None),) + sl] += out * g
                counts[sl] += g
    probs = logits / counts
    crop = tuple(slice(p // 2, p // 2 + s) for p, s in zip(pad, shape))
    return probs[(slice(None),) + crop].argmax(0).cpu().numpy()


def case_dice(pred, gt, num_classes):
    res = []
    for c in range(1, num_classes):
        p, g = pred == c, gt == c
        if g.sum() == 0 and p.sum() == 0:
            res.append(np.nan)
        else:
            res.append(2 * np.logical_and(p, g).sum() / (p.sum() + g.sum()))
    return res


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")

    assert args.global_batch_size >= world, "need at least one sample per GPU"
    bs = args.global_batch_size // world + (1 if rank < args.global_batch_size % world else 0)

    with open(os.path.join(args.preprocessed, "splits_final.json")) as f:
        split = json.load(f)[args.fold]
    folder = os.path.join(args.preprocessed, "nnUNetPlans_3d_fullres")
    out_dir = os.path.join(args.output, f"fold_{args.fold}")
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)

    train_ds = RandomPatchDataset(folder, split["train"], bs, args.patch_size, args.oversample_fg,
                                  seed=args.seed + 1000 * rank)
    loader = iter(DataLoader(train_ds, batch_size=None, num_workers=args.workers,
                             pin_memory=True, persistent_workers=True))

    torch.manual_seed(args.seed)
    net = PlainConvUNet(1, args.num_classes).to(device)
    opt = torch.optim.SGD(net.parameters(), args.initial_lr, momentum=0.99, nesterov=True, weight_decay=3e-5)
    scaler = torch.cuda.amp.GradScaler()
    n_out = len(net.seg_layers)
    loss_fn = DeepSupervisionLoss(DCandCE(), n_out)

    start_epoch, best_ema, ema = 0, None, None
    ckpt_path = os.path.join(out_dir, "checkpoint_latest.pth")
    if args.continue_training and os.path.isfile(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        net.load_state_dict(ckpt["network_weights"])
        opt.load_state_dict(ckpt["optimizer_state"])
        scaler.load_state_dict(ckpt["grad_scaler_state"])
        start_epoch, best_ema, ema = ckpt["current_epoch"] + 1, ckpt["best_ema"], ckpt["ema"]

    model = DDP(net, device_ids=[local_rank])

    for epoch in range(start_epoch, args.epochs):
        lr = args.initial_lr * (1 - epoch / args.epochs) ** 0.9
        for g in opt.param_groups:
            g["lr"] = lr
        model.train()
        t0, losses = time(), []
        for _ in range(args.iters_per_epoch):
            x, y = next(loader)
            x = x.to(device, non_blocking=True)
            targets = downsample_targets(y.to(device, non_blocking=True), n_out)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = loss_fn(model(x), targets)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 12)
            scaler.step(opt)
            scaler.update()
            losses.append(loss.detach())
        train_loss = torch.stack(losses).mean()
        dist.all_reduce(train_loss)
        train_loss = train_loss.item() / world

        # pseudo dice on the validation cases, whole volumes, split across ranks
        net.eval()
        net.deep_supervision = False
        local = {}
        for key in split["val"][rank::world]:
            arr = np.load(os.path.join(folder, key + ".npz"))
            with torch.autocast("cuda", dtype=torch.float16):
                pred = sliding_window(net, arr["data"], args.patch_size, args.num_classes, device)
            local[key] = case_dice(pred, arr["seg"][0], args.num_classes)
        net.deep_supervision = True
        parts = [None] * world
        dist.all_gather_object(parts, local)

        if rank == 0:
            per_case = {k: v for p in parts for k, v in p.items()}
            mean_fg = float(np.nanmean(np.nanmean(np.array(list(per_case.values())), 0)))
            ema = mean_fg if ema is None else 0.9 * ema + 0.1 * mean_fg
            print(f"epoch {epoch} lr {lr:.5f} train_loss {train_loss:.4f} "
                  f"val_dice {mean_fg:.4f} ema {ema:.4f} ({time() - t0:.0f}s)", flush=True)
            state = {
                "network_weights": net.state_dict(),
                "optimizer_state": opt.state_dict(),
                "grad_scaler_state": scaler.state_dict(),
                "current_epoch": epoch,
                "ema": ema,
                "best_ema": best_ema,
            }
            if best_ema is None or ema > best_ema:
                best_ema = ema
                state["best_ema"] = best_ema
                torch.save(state, os.path.join(out_dir, "checkpoint_best.pth"))
            if (epoch + 1) % 50 == 0 or epoch + 1 == args.epochs:
                torch.save(state, ckpt_path)
        dist.barrier()

    if rank == 0:
        torch.save({"network_weights": net.state_dict()}, os.path.join(out_dir, "checkpoint_final.pth"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
