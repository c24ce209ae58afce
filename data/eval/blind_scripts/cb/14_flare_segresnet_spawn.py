"""FLARE22 abdominal organ segmentation, SegResNet, spawned DDP workers.

    python 14_flare_segresnet_spawn.py configs/flare_segresnet.yaml fold=1 num_gpus=4
"""
import os
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.networks.nets import SegResNet

NUM_CLASSES = 14


class FlareCases(Dataset):
    """Preprocessed cases: <id>.npz with `img` (1, D, H, W) float16 and `seg` (D, H, W) uint8."""

    def __init__(self, folder, ids, patch, fg_prob=0.33, samples_per_case=8):
        self.folder, self.patch, self.fg_prob = folder, np.asarray(patch), fg_prob
        self.ids = [i for i in ids for _ in range(samples_per_case)]

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, k):
        z = np.load(os.path.join(self.folder, self.ids[k] + ".npz"))
        img, seg = z["img"].astype(np.float32), z["seg"]
        deficit = np.maximum(self.patch - np.asarray(seg.shape), 0)
        if deficit.any():
            img = np.pad(img, [(0, 0)] + [(0, d) for d in deficit])
            seg = np.pad(seg, [(0, d) for d in deficit])
        shape = np.asarray(seg.shape)
        if np.random.rand() < self.fg_prob:
            classes = np.unique(seg)
            classes = classes[classes > 0]
            if len(classes):
                vox = np.argwhere(seg == np.random.choice(classes))
                c = vox[np.random.randint(len(vox))]
                lo = np.clip(c - self.patch // 2, 0, shape - self.patch)
            else:
                lo = np.array([np.random.randint(0, s - p + 1) for s, p in zip(shape, self.patch)])
        else:
            lo = np.array([np.random.randint(0, s - p + 1) for s, p in zip(shape, self.patch)])
        sl = tuple(slice(a, a + p) for a, p in zip(lo, self.patch))
        x = img[(slice(None),) + sl]
        y = seg[sl][None].astype(np.int64)
        if np.random.rand() < 0.2:
            x = x * np.random.uniform(0.75, 1.25)
        return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(y))


def per_class_dice(pred, gt):
    out = torch.full((NUM_CLASSES - 1,), float("nan"))
    for c in range(1, NUM_CLASSES):
        g = gt == c
        if g.any():
            p = pred == c
            out[c - 1] = (2 * (p & g).sum() / (p.sum() + g.sum())).item()
    return out


def main_worker(cfg, rank, world_size):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(cfg.port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size, timeout=timedelta(minutes=60))
    device = torch.device("cuda", rank)
    np.random.seed(cfg.seed + rank)

    splits = OmegaConf.load(cfg.splits)
    train_ids, val_ids = list(splits[cfg.fold].train), list(splits[cfg.fold].val)
    ds = FlareCases(cfg.data, train_ids, cfg.patch, cfg.oversample_fg)
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=cfg.batch_size, sampler=sampler, num_workers=cfg.workers,
                        pin_memory=True, persistent_workers=True,
                        worker_init_fn=lambda w: np.random.seed((cfg.seed + 100 * rank + w) % 2 ** 32))

    net = SegResNet(spatial_dims=3, init_filters=32, in_channels=1, out_channels=NUM_CLASSES,
                    blocks_down=(1, 2, 2, 4), blocks_up=(1, 1, 1), norm="instance").to(device)
    model = DDP(net, device_ids=[rank])
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.99, nesterov=True, weight_decay=3e-5)
    sched = torch.optim.lr_scheduler.PolynomialLR(opt, total_iters=cfg.epochs, power=0.9)
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True, batch=True)
    scaler = torch.cuda.amp.GradScaler()

    out_dir = os.path.join(cfg.out, f"fold{cfg.fold}")
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        OmegaConf.save(cfg, os.path.join(out_dir, "config.yaml"))
    best = -1.0

    for epoch in range(cfg.epochs):
        model.train()
        sampler.set_epoch(epoch)
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 12.0)
            scaler.step(opt)
            scaler.update()
            acc += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch} loss {(acc[0] / acc[1]).item():.4f} lr {sched.get_last_lr()[0]:.5f} "
                  f"({time.time() - t0:.0f}s)", flush=True)

        if (epoch + 1) % cfg.val_every == 0:
            net.eval()
            local = []
            with torch.no_grad():
                for cid in val_ids[rank::world_size]:
                    z = np.load(os.path.join(cfg.data, cid + ".npz"))
                    img = torch.from_numpy(z["img"].astype(np.float32))[None].to(device)
                    with torch.autocast("cuda", dtype=torch.float16):
                        logits = sliding_window_inference(img, cfg.patch, 2, net, overlap=0.5, mode="gaussian")
                    local.append(per_class_dice(logits.argmax(1)[0], torch.from_numpy(z["seg"]).to(device)))
            net.train()
            parts = [None] * world_size
            dist.all_gather_object(parts, local)
            if rank == 0:
                all_cases = torch.stack([d for p in parts for d in p])
                organ = torch.nanmean(all_cases, 0)
                mean = organ.nanmean().item()
                print(f"  val mean dice {mean:.4f} ({all_cases.shape[0]} cases)", flush=True)
                if mean > best:
                    best = mean
                    torch.save(net.state_dict(), os.path.join(out_dir, "best.pt"))
                torch.save({"epoch": epoch, "model": net.state_dict(), "opt": opt.state_dict(),
                            "sched": sched.state_dict(), "best": best}, os.path.join(out_dir, "last.pt"))
            dist.barrier()

    dist.destroy_process_group()


def load_cfg(argv):
    cfg = OmegaConf.merge(
        OmegaConf.create({"fold": 0, "num_gpus": torch.cuda.device_count(), "port": 29611, "seed": 0,
                          "epochs": 1000, "batch_size": 2, "lr": 1e-2, "patch": [96, 160, 160],
                          "oversample_fg": 0.33, "workers": 6, "val_every": 20, "out": "runs/flare"}),
        OmegaConf.load(argv[0]),
        OmegaConf.from_dotlist(argv[1:]),
    )
    return cfg


if __name__ == "__main__":
    cfg = load_cfg(sys.argv[1:])
    world_size = cfg.num_gpus
    mp.spawn(main_worker, args=(cfg, world_size), nprocs=world_size, join=True)
