"""SlowFast R50 8x8 on Kinetics-400 (pytorchvideo model zoo definition), DDP.

After training, the best checkpoint is re-loaded into a fresh model and evaluated
with 10 temporal clips x 3 spatial crops.

    torchrun --nproc_per_node=8 12_slowfast_r50_k400.py --cfg configs/slowfast_r50_k400.yaml
"""
import argparse
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from decord import VideoReader, cpu
from pytorchvideo.models.slowfast import create_slowfast
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler

DEFAULTS = {
    "data": {"root": "/data/k400", "train_list": "train.txt", "val_list": "val.txt",
             "frames": 32, "rate": 2, "alpha": 4, "crop": 224, "num_classes": 400},
    "train": {"batch_size": 8, "epochs": 196, "warmup_epochs": 34, "base_lr": 0.8,
              "ref_batch": 512, "wd": 1e-4, "workers": 8},
    "test": {"clips": 10, "crops": 3},
    "out_dir": "/exp/slowfast_r50",
}


def load_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default="")
    args = ap.parse_args()
    cfg = {k: dict(v) if isinstance(v, dict) else v for k, v in DEFAULTS.items()}
    if args.cfg:
        with open(args.cfg) as f:
            user = yaml.safe_load(f) or {}
        for k, v in user.items():
            if isinstance(v, dict):
                cfg[k].update(v)
            else:
                cfg[k] = v
    return cfg


MEAN = torch.tensor([0.45, 0.45, 0.45]).view(3, 1, 1, 1)
STD = torch.tensor([0.225, 0.225, 0.225]).view(3, 1, 1, 1)


class KineticsSlowFast(Dataset):
    """list file lines: '<relative path> <label>'"""

    def __init__(self, list_file, root, frames, rate, alpha, crop, train, clips=1, crops=1):
        with open(list_file) as f:
            self.items = [(os.path.join(root, p), int(l)) for p, l in (x.split() for x in f if x.strip())]
        self.frames, self.rate, self.alpha, self.crop = frames, rate, alpha, crop
        self.train, self.clips, self.crops = train, clips, crops

    def __len__(self):
        return len(self.items) * self.clips * self.crops

    def __getitem__(self, index):
        vid, view = divmod(index, self.clips * self.crops)
        clip, crop = divmod(view, self.crops)
        path, label = self.items[vid]
        vr = VideoReader(path, ctx=cpu(0), num_threads=1)
        n, span = len(vr), self.frames * self.rate
        if self.train:
            s = random.randint(0, max(0, n - span))
        else:
            s = int(round(max(0, n - span) * clip / max(1, self.clips - 1)))
        ids = np.clip(np.arange(s, s + span, self.rate), 0, n - 1)
        x = torch.from_numpy(vr.get_batch(ids).asnumpy()).permute(0, 3, 1, 2).float() / 255.0
        short = random.randint(256, 320) if self.train else 256
        h, w = x.shape[-2:]
        x = F.interpolate(x, scale_factor=short / min(h, w), mode="bilinear", align_corners=False)
        h, w = x.shape[-2:]
        if self.train:
            i, j = random.randint(0, h - self.crop), random.randint(0, w - self.crop)
        else:
            k = 1 if self.crops == 1 else crop
            i = (h - self.crop) * k // 2 if h > w else (h - self.crop) // 2
            j = (w - self.crop) * k // 2 if w >= h else (w - self.crop) // 2
        x = x[..., i:i + self.crop, j:j + self.crop]
        if self.train and random.random() < 0.5:
            x = x.flip(-1)
        fast = (x.permute(1, 0, 2, 3) - MEAN) / STD
        slow = fast[:, :: self.alpha]
        return [slow, fast], label, vid


class InterleavedShard(Sampler):
    def __init__(self, n, world, rank):
        self.ids = list(range(rank, n, world))

    def __iter__(self):
        return iter(self.ids)

    def __len__(self):
        return len(self.ids)


def build_model(num_classes):
    return create_slowfast(model_num_class=num_classes, model_depth=50, head_activation=None)


@torch.no_grad()
def multiview_eval(model, loader, n_videos, n_classes, device):
    model.eval()
    acc = torch.zeros(n_videos, n_classes, device=device)
    lab = torch.full((n_videos,), -1, dtype=torch.long, device=device)
    for inputs, y, vid in loader:
        inputs = [t.to(device, non_blocking=True) for t in inputs]
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(inputs)
        vid = vid.to(device)
        acc.index_add_(0, vid, out.float().softmax(1))
        lab[vid] = y.to(device)
    dist.all_reduce(acc)
    dist.all_reduce(lab, op=dist.ReduceOp.MAX)
    top5 = acc.topk(5, 1).indices
    return (top5[:, 0] == lab).float().mean().item() * 100, (top5 == lab[:, None]).any(1).float().mean().item() * 100


def main():
    cfg = load_cfg()
    d, t = cfg["data"], cfg["train"]
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(rank)
    random.seed(rank)

    mk = lambda lst, train, **kw: KineticsSlowFast(os.path.join(d["root"], lst), d["root"], d["frames"], d["rate"],
                                                   d["alpha"], d["crop"], train, **kw)
    train_ds = mk(d["train_list"], True)
    val_ds = mk(d["val_list"], False)
    test_ds = mk(d["val_list"], False, clips=cfg["test"]["clips"], crops=cfg["test"]["crops"])
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=t["batch_size"], sampler=sampler, num_workers=t["workers"],
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=t["batch_size"], sampler=InterleavedShard(len(val_ds), world, rank),
                        num_workers=t["workers"], pin_memory=True)
    test_dl = DataLoader(test_ds, batch_size=t["batch_size"], sampler=InterleavedShard(len(test_ds), world, rank),
                         num_workers=t["workers"], pin_memory=True)

    model = build_model(d["num_classes"])
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = t["base_lr"] * t["batch_size"] * world / t["ref_batch"]
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=t["wd"], nesterov=True)
    scaler = torch.cuda.amp.GradScaler()
    iters = len(train_dl)
    warm, total = t["warmup_epochs"] * iters, t["epochs"] * iters
    out_dir = cfg["out_dir"]
    os.makedirs(out_dir, exist_ok=True)

    start_epoch, best = 0, -1.0
    last = os.path.join(out_dir, "last.pth")
    if os.path.exists(last):
        ck = torch.load(last, map_location="cpu")
        model.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]

    for epoch in range(start_epoch, t["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        for it, (inputs, y, _) in enumerate(train_dl):
            step = epoch * iters + it
            cur = lr * (0.01 + 0.99 * step / warm) if step < warm else \
                lr * 0.5 * (1 + math.cos(math.pi * (step - warm) / (total - warm)))
            for g in optimizer.param_groups:
                g["lr"] = cur
            inputs = [x.to(device, non_blocking=True) for x in inputs]
            y = y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(inputs), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if rank == 0 and it % 50 == 0:
                print(f"[{epoch}/{t['epochs']}][{it}/{iters}] loss {loss.item():.4f} lr {cur:.4f}", flush=True)

        if (epoch + 1) % 5 == 0 or epoch + 1 == t["epochs"]:
            top1, _ = multiview_eval(model.module, val_dl, len(val_ds.items), d["num_classes"], device)
            if rank == 0:
                print(f"epoch {epoch}: val top1 (1 view) {top1:.2f}", flush=True)
                if top1 > best:
                    best = top1
                    torch.save({"model": model.state_dict(), "epoch": epoch, "top1": top1},
                               os.path.join(out_dir, "best.pth"))
            best = max(best, top1)
        if rank == 0:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch, "best": best}, last)

    dist.barrier()
    test_model = build_model(d["num_classes"])
    state = torch.load(os.path.join(out_dir, "best.pth"), map_location="cpu")
    test_model.load_state_dict(state["model"])
    test_model.to(device)
    top1, top5 = multiview_eval(test_model, test_dl, len(test_ds.items), d["num_classes"], device)
    if rank == 0:
        print(f"best epoch {state['epoch']}: {cfg['test']['clips']}x{cfg['test']['crops']} "
              f"top1 {top1:.2f} top5 {top5:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
