"""
Iteration-based 3D trainer in the nnU-Net style: 250 iterations per "epoch", random patches
with 1/3 foreground oversampling drawn from the preprocessed cases, poly LR, deep supervision.
Full-volume validation (Dice + HD95) is done by rank 0 after every `val_every` epochs.

torchrun --nnodes=1 --nproc_per_node=4 07_nnunet_iter_trainer_hd95.py \
    --preprocessed /data/preprocessed/Dataset027_ACDC --plans plans_3d_fullres.json --fold 2
"""
import argparse
import datetime
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.metrics import compute_dice, compute_hausdorff_distance
from monai.networks.nets import DynUNet


class RandomPatchStream(IterableDataset):
    """Endless stream of batches. Every (rank, worker) has its own RNG, so ranks see different patches."""

    def __init__(self, folder, cases, patch, batch_size, seed, oversample=0.33):
        self.folder, self.cases, self.patch = folder, cases, np.asarray(patch)
        self.batch_size, self.seed, self.oversample = batch_size, seed, oversample
        self._props = {}

    def _load(self, case):
        arr = np.load(os.path.join(self.folder, case + ".npy"), mmap_mode="r")
        return arr[:-1], arr[-1:]

    def _sample(self, rng, force_fg):
        case = self.cases[rng.integers(len(self.cases))]
        img, seg = self._load(case)
        shape = np.asarray(img.shape[1:])
        need = np.maximum(self.patch - shape, 0)
        lo_max = np.maximum(shape - self.patch, 0)
        if force_fg:
            fg = np.argwhere(seg[0] > 0)
            if len(fg):
                c = fg[rng.integers(len(fg))]
                lo = np.clip(c - self.patch // 2, 0, lo_max)
            else:
                lo = np.array([rng.integers(m + 1) for m in lo_max])
        else:
            lo = np.array([rng.integers(m + 1) for m in lo_max])
        sl = (slice(None),) + tuple(slice(a, a + p) for a, p in zip(lo, self.patch))
        x, y = np.asarray(img[sl], dtype=np.float32), np.asarray(seg[sl], dtype=np.int64)
        if need.any():
            pads = [(0, 0)] + [(n // 2, n - n // 2) for n in need]
            x, y = np.pad(x, pads), np.pad(y, pads)
        for ax in range(1, 4):
            if rng.random() < 0.5:
                x, y = np.flip(x, ax), np.flip(y, ax)
        return np.ascontiguousarray(x), np.ascontiguousarray(y)

    def __iter__(self):
        wi = get_worker_info()
        rng = np.random.default_rng(self.seed + 1000 * (wi.id if wi else 0))
        while True:
            xs, ys = [], []
            for b in range(self.batch_size):
                force_fg = b >= round(self.batch_size * (1 - self.oversample))
                x, y = self._sample(rng, force_fg)
                xs.append(x)
                ys.append(y)
            yield torch.from_numpy(np.stack(xs)), torch.from_numpy(np.stack(ys))


def ds_loss(outputs, target, base_loss, weights):
    # DynUNet stacks [full res, ds1, ds2, ...] along dim 1, all upsampled to full resolution
    loss = 0.0
    for i, w in enumerate(weights):
        loss = loss + w * base_loss(outputs[:, i], target)
    return loss


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--preprocessed", required=True)
    p.add_argument("--plans", default="plans_3d_fullres.json")
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--out", default="./results/acdc_3d")
    p.add_argument("--epochs", type=int, default=1000)
    p.add_argument("--iters", type=int, default=250)
    p.add_argument("--global_batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--val_every", type=int, default=50)
    p.add_argument("--patience", type=int, default=200)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # full-volume validation on rank 0 can take a long time; the others wait in the barrier
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    assert args.global_batch % world == 0, "global batch must be divisible by the number of GPUs"
    bs = args.global_batch // world

    with open(os.path.join(args.preprocessed, args.plans)) as f:
        plans = json.load(f)
    with open(os.path.join(args.preprocessed, "splits_final.json")) as f:
        split = json.load(f)[args.fold]
    patch, n_cls = plans["patch_size"], plans["num_classes"]
    out_dir = os.path.join(args.out, f"fold_{args.fold}")
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)

    stream = RandomPatchStream(os.path.join(args.preprocessed, "data"), split["train"], patch, bs,
                               seed=args.seed + 7919 * rank)
    loader = DataLoader(stream, batch_size=None, num_workers=6, pin_memory=True, prefetch_factor=4,
                        persistent_workers=True)
    it = iter(loader)

    torch.manual_seed(args.seed)
    net = DynUNet(3, plans["in_channels"], n_cls, plans["kernels"], plans["strides"], plans["strides"][1:],
                  norm_name=("instance", {"affine": True}), deep_supervision=True,
                  deep_supr_num=plans.get("deep_supr_num", 2), res_block=False).to(device)
    n_out = 1 + net.deep_supr_num
    w = np.array([1 / 2 ** i for i in range(n_out)])
    ds_weights = (w / w.sum()).tolist()

    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.99, nesterov=True, weight_decay=3e-5)
    scaler = torch.cuda.amp.GradScaler()
    start, best, since_best = 0, -1.0, 0
    ckpt_path = os.path.join(out_dir, "checkpoint_latest.pth")
    if args.resume and os.path.isfile(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        net.load_state_dict(ck["network"])
        optimizer.load_state_dict(ck["optimizer"])
        scaler.load_state_dict(ck["grad_scaler"])
        start, best, since_best = ck["epoch"] + 1, ck["best"], ck["since_best"]
    model = DDP(net, device_ids=[local_rank])
    base_loss = DiceCELoss(to_onehot_y=True, softmax=True, include_background=False, batch=True, smooth_nr=1e-5)

    for epoch in range(start, args.epochs):
        lr = args.lr * (1 - epoch / args.epochs) ** 0.9
        for g in optimizer.param_groups:
            g["lr"] = lr
        model.train()
        t0, losses = time.time(), torch.zeros(args.iters, device=device)
        for i in range(args.iters):
            x, y = next(it)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = ds_loss(model(x), y, base_loss, ds_weights)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 12)
            scaler.step(optimizer)
            scaler.update()
            losses[i] = loss.detach()
        dist.all_reduce(losses, op=dist.ReduceOp.AVG)
        if rank == 0:
            print(f"epoch {epoch} train_loss {losses.mean().item():.4f} lr {lr:.5f} {time.time() - t0:.1f}s",
                  flush=True)

        stop = torch.zeros(1, device=device)
        if (epoch + 1) % args.val_every == 0:
            if rank == 0:
                net.eval()
                dices, hds = [], []
                with torch.no_grad():
                    for case in split["val"]:
                        arr = np.load(os.path.join(args.preprocessed, "data", case + ".npy"))
                        img = torch.from_numpy(arr[None, :-1].astype(np.float32)).to(device)
                        seg = torch.from_numpy(arr[None, -1:].astype(np.int64)).to(device)
                        with torch.autocast("cuda", dtype=torch.float16):
                            logits = sliding_window_inference(img, patch, 4, net, overlap=0.5, mode="gaussian")
                        pred = F.one_hot(logits.argmax(1), n_cls).permute(0, 4, 1, 2, 3)
                        gt = F.one_hot(seg[:, 0], n_cls).permute(0, 4, 1, 2, 3)
                        dices.append(compute_dice(pred, gt, include_background=False).cpu())
                        hds.append(compute_hausdorff_distance(pred, gt, include_background=False,
                                                              percentile=95, spacing=plans["spacing"]).cpu())
                dice = torch.nanmean(torch.cat(dices), 0)
                hd95 = torch.nanmean(torch.cat(hds), 0)
                mean_dice = dice.mean().item()
                print(f"  val dice {dice.numpy().round(4)} hd95 {hd95.numpy().round(2)}", flush=True)
                if mean_dice > best:
                    best, since_best = mean_dice, 0
                    torch.save({"network": net.state_dict(), "epoch": epoch, "dice": mean_dice},
                               os.path.join(out_dir, "checkpoint_best.pth"))
                else:
                    since_best += args.val_every
                torch.save({"network": net.state_dict(), "optimizer": optimizer.state_dict(),
                            "grad_scaler": scaler.state_dict(), "epoch": epoch, "best": best,
                            "since_best": since_best}, ckpt_path)
                if since_best >= args.patience:
                    stop.fill_(1)
            dist.barrier()
        dist.broadcast(stop, src=0)
        if stop.item() > 0:
            if rank == 0:
                print(f"early stop at epoch {epoch}, best dice {best:.4f}")
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
