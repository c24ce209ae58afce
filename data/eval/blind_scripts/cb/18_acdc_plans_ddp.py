"""ACDC cardiac cine-MRI (RV, MYO, LV) 3d_fullres training driven by an nnU-Net plans file.

The batch size in the plans is the global batch size; it is split over the GPUs.

    torchrun --nproc_per_node=4 18_acdc_plans_ddp.py \
        --plans /data/nnUNet_preprocessed/Dataset027_ACDC/nnUNetPlans.json \
        --data /data/nnUNet_preprocessed/Dataset027_ACDC/nnUNetPlans_3d_fullres --fold 0
"""
import argparse
import json
import os
import pickle
import time

import blosc2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from monai.inferers import sliding_window_inference
from monai.networks.nets import DynUNet


def load_case(folder, key):
    dparams = {"nthreads": 1}
    data = blosc2.open(urlpath=os.path.join(folder, key + ".b2nd"), mode="r", dparams=dparams)[:]
    seg = blosc2.open(urlpath=os.path.join(folder, key + "_seg.b2nd"), mode="r", dparams=dparams)[:]
    with open(os.path.join(folder, key + ".pkl"), "rb") as f:
        props = pickle.load(f)
    return data, seg, props


class ACDCPatches(Dataset):
    def __init__(self, folder, keys, patch, oversample, per_case=50):
        self.folder, self.keys, self.patch, self.oversample = folder, keys, np.array(patch), oversample
        self.n = len(keys) * per_case

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        data, seg, props = load_case(self.folder, self.keys[i % len(self.keys)])
        shape = np.array(data.shape[1:])
        need = np.maximum(self.patch - shape, 0)
        lb, ub = -(need // 2), shape + need // 2 + need % 2 - self.patch
        locs = [v for v in props["class_locations"].values() if len(v)]
        if locs and np.random.rand() < self.oversample:
            cl = locs[np.random.randint(len(locs))]
            v = cl[np.random.randint(len(cl))][1:]
            start = np.clip(v - self.patch // 2, lb, ub)
        else:
            start = np.array([np.random.randint(l, u + 1) for l, u in zip(lb, ub)])
        end = start + self.patch
        vs = tuple(slice(max(0, s), min(e, sh)) for s, e, sh in zip(start, end, shape))
        pad = [(0, 0)] + [(max(0, -s), max(0, e - sh)) for s, e, sh in zip(start, end, shape)]
        x = np.pad(data[(slice(None),) + vs], pad).astype(np.float32)
        y = np.pad(seg[(slice(None),) + vs], pad, constant_values=0).astype(np.int64)
        y[y < 0] = 0
        for ax in (2, 3):
            if np.random.rand() < 0.5:
                x, y = np.flip(x, ax), np.flip(y, ax)
        return torch.from_numpy(x.copy()), torch.from_numpy(y.copy())


def dice_ce(logits, y, n):
    ce = F.cross_entropy(logits, y[:, 0])
    p = logits.float().softmax(1)
    oh = F.one_hot(y[:, 0], n).permute(0, 4, 1, 2, 3).float()
    ax = (0, 2, 3, 4)
    dc = (2 * (p * oh).sum(ax) + 1e-5) / (p.sum(ax) + oh.sum(ax) + 1e-5)
    return ce - dc[1:].mean()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--plans", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--fold", type=int, default=0)
    ap.add_argument("--configuration", default="3d_fullres")
    ap.add_argument("--epochs", type=int, default=1000)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--out", default="results/acdc")
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    with open(args.plans) as f:
        plans = json.load(f)
    conf = plans["configurations"][args.configuration]
    patch = conf["patch_size"]
    kernels = conf["architecture"]["arch_kwargs"]["kernel_sizes"]
    strides = conf["architecture"]["arch_kwargs"]["strides"]
    features = conf["architecture"]["arch_kwargs"]["features_per_stage"]
    global_bs = conf["batch_size"]
    batch_size = global_bs // world
    oversample = 0.33

    with open(os.path.join(os.path.dirname(args.plans), "splits_final.json")) as f:
        split = json.load(f)[args.fold]
    ds = ACDCPatches(args.data, split["train"], patch, oversample)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=batch_size, sampler=sampler, num_workers=6, pin_memory=True,
                        persistent_workers=True)

    n_cls = 4
    net = DynUNet(3, 1, n_cls, kernel_size=kernels, strides=strides, upsample_kernel_size=strides[1:],
                  filters=features, norm_name="instance", deep_supervision=True,
                  deep_supr_num=len(strides) - 2).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.99, nesterov=True, weight_decay=3e-5)
    scaler = torch.cuda.amp.GradScaler()
    n_out = len(strides) - 1
    w = np.array([1 / 2 ** i for i in range(n_out)])
    ds_w = (w / w.sum()).tolist()

    out_dir = os.path.join(args.out, f"fold_{args.fold}")
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        print(f"patch {patch}, global batch {global_bs}, {world} GPUs", flush=True)
    best = -1.0

    for epoch in range(args.epochs):
        lr = args.lr * (1 - epoch / args.epochs) ** 0.9
        for g in opt.param_groups:
            g["lr"] = lr
        model.train()
        sampler.set_epoch(epoch)
        t0, acc = time.time(), torch.zeros(2, device=device)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                out = model(x)
                loss = sum(wi * dice_ce(out[:, i], y, n_cls) for i, wi in enumerate(ds_w))
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 12)
            scaler.step(opt)
            scaler.update()
            acc += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch} lr {lr:.5f} loss {(acc[0] / acc[1]).item():.4f} ({time.time() - t0:.0f}s)",
                  flush=True)

        if (epoch + 1) % 50 == 0 or epoch + 1 == args.epochs:
            net.eval()
            mine = []
            with torch.no_grad():
                for key in split["val"][rank::world]:
                    data, seg, _ = load_case(args.data, key)
                    xx = torch.from_numpy(data.astype(np.float32))[None].to(device)
                    with torch.autocast("cuda", dtype=torch.float16):
                        pred = sliding_window_inference(xx, patch, 4, net, overlap=0.5, mode="gaussian").argmax(1)[0]
                    gt = torch.from_numpy(seg[0].astype(np.int64)).to(device)
                    mine.append([(2 * ((pred == c) & (gt == c)).sum() / ((pred == c).sum() + (gt == c).sum()).clamp(min=1)).item()
                                 for c in (1, 2, 3)])
            net.train()
            allv = [None] * world
            dist.all_gather_object(allv, mine)
            if rank == 0:
                arr = np.array([m for part in allv for m in part])
                rv, myo, lv = arr.mean(0)
                mean = float(arr.mean())
                print(f"  val RV {rv:.4f} MYO {myo:.4f} LV {lv:.4f} mean {mean:.4f}", flush=True)
                ck = {"network_weights": net.state_dict(), "optimizer_state": opt.state_dict(),
                      "grad_scaler_state": scaler.state_dict(), "current_epoch": epoch}
                torch.save(ck, os.path.join(out_dir, "checkpoint_latest.pth"))
                if mean > best:
                    best = mean
                    torch.save(ck, os.path.join(out_dir, "checkpoint_best.pth"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
