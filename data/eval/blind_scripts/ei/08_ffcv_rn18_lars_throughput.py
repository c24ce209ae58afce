"""Quick-turnaround FFCV ResNet-18 / LARS run used as the scaling canary.

Reports img/s per GPU and total, plus 16-epoch top-1, for 1/2/4/8 GPUs.

    torchrun --nproc_per_node=8 08_ffcv_rn18_lars_throughput.py --cfg rn18_16ep.json
"""
import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP

from ffcv.fields.basics import IntDecoder
from ffcv.fields.rgb_image import CenterCropRGBImageDecoder, RandomResizedCropRGBImageDecoder
from ffcv.loader import Loader, OrderOption
from ffcv.transforms import (NormalizeImage, RandomHorizontalFlip, Squeeze, ToDevice,
                             ToTensor, ToTorchImage)
from timm.optim import Lars

MEAN = np.array([0.485, 0.456, 0.406]) * 255
STD = np.array([0.229, 0.224, 0.225]) * 255

DEFAULT_CFG = {
    "train_path": "/scratch/ffcv/imagenet_train_400_0.10_90.beton",
    "val_path": "/scratch/ffcv/imagenet_val_400_0.10_90.beton",
    "arch": "resnet18",
    "epochs": 16,
    "batch_size": 1024,
    "lr_per_256": 0.4,
    "weight_decay": 5e-5,
    "label_smoothing": 0.1,
    "warmup_epochs": 2,
    "res": 160,
    "val_res": 224,
    "num_workers": 12,
    "log_dir": "/nfs/canary/rn18",
}


def load_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    ap.add_argument("--tag", default="canary")
    a = ap.parse_args()
    cfg = dict(DEFAULT_CFG)
    if a.cfg:
        with open(a.cfg) as f:
            cfg.update(json.load(f))
    cfg["tag"] = a.tag
    return cfg


def make_train_loader(cfg, device):
    image_pipeline = [
        RandomResizedCropRGBImageDecoder((cfg["res"], cfg["res"])),
        RandomHorizontalFlip(),
        ToTensor(),
        ToDevice(device, non_blocking=True),
        ToTorchImage(),
        NormalizeImage(MEAN, STD, np.float16),
    ]
    label_pipeline = [IntDecoder(), ToTensor(), Squeeze(), ToDevice(device, non_blocking=True)]
    return Loader(cfg["train_path"],
                  batch_size=cfg["batch_size"],
                  num_workers=cfg["num_workers"],
                  order=OrderOption.RANDOM,
                  os_cache=True,
                  drop_last=True,
                  pipelines={"image": image_pipeline, "label": label_pipeline})


def make_val_loader(cfg, device):
    image_pipeline = [
        CenterCropRGBImageDecoder((cfg["val_res"], cfg["val_res"]), ratio=224 / 256),
        ToTensor(),
        ToDevice(device, non_blocking=True),
        ToTorchImage(),
        NormalizeImage(MEAN, STD, np.float16),
    ]
    label_pipeline = [IntDecoder(), ToTensor(), Squeeze(), ToDevice(device, non_blocking=True)]
    return Loader(cfg["val_path"],
                  batch_size=512,
                  num_workers=cfg["num_workers"],
                  order=OrderOption.SEQUENTIAL,
                  drop_last=False,
                  distributed=True,
                  pipelines={"image": image_pipeline, "label": label_pipeline})


def schedule(step, total, warmup, peak):
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    agg = torch.zeros(2, device="cuda")
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(x)
        agg[0] += (out.argmax(1) == y).sum()
        agg[1] += y.numel()
    dist.all_reduce(agg)
    return (100 * agg[0] / agg[1]).item()


def main():
    cfg = load_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_loader = make_train_loader(cfg, device)
    val_loader = make_val_loader(cfg, device)

    model = torchvision.models.__dict__[cfg["arch"]](num_classes=1000)
    model = model.to(device).to(memory_format=torch.channels_last)
    model = DDP(model, device_ids=[local_rank])

    global_batch = cfg["batch_size"] * world
    peak_lr = cfg["lr_per_256"] * global_batch / 256
    params_wd = [p for p in model.parameters() if p.ndim > 1]
    params_nowd = [p for p in model.parameters() if p.ndim <= 1]
    optimizer = Lars([{"params": params_wd, "weight_decay": cfg["weight_decay"]},
                      {"params": params_nowd, "weight_decay": 0.0}],
                     lr=peak_lr, momentum=0.9, trust_coeff=0.001)
    scaler = torch.cuda.amp.GradScaler()

    steps_per_epoch = len(train_loader)
    total = cfg["epochs"] * steps_per_epoch
    warmup = cfg["warmup_epochs"] * steps_per_epoch
    if rank == 0:
        os.makedirs(cfg["log_dir"], exist_ok=True)
        print(f"[{cfg['tag']}] world={world} global_batch={global_batch} "
              f"peak_lr={peak_lr:.3f} steps/epoch={steps_per_epoch}", flush=True)

    results = []
    step = 0
    for epoch in range(cfg["epochs"]):
        model.train()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for x, y in train_loader:
            lr = schedule(step, total, warmup, peak_lr)
            for g in optimizer.param_groups:
                g["lr"] = lr
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y, label_smoothing=cfg["label_smoothing"])
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            step += 1
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0

        top1 = evaluate(model, val_loader)
        per_gpu = steps_per_epoch * cfg["batch_size"] / dt
        rec = {"epoch": epoch, "top1": top1, "epoch_s": dt,
               "img_s_per_gpu": per_gpu, "img_s_total": per_gpu * world}
        results.append(rec)
        if rank == 0:
            print(json.dumps(rec), flush=True)

    if rank == 0:
        out = os.path.join(cfg["log_dir"], f"{cfg['tag']}_w{world}.json")
        with open(out, "w") as f:
            json.dump({"cfg": cfg, "world": world, "results": results}, f, indent=2)
        torch.save(model.module.state_dict(), os.path.join(cfg["log_dir"], f"{cfg['tag']}_w{world}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
