"""ViT-S/16 on ImageNet-1k streamed from webdataset tar shards, torch.compile'd DDP.

Train shards: 1024 tars on shared storage, ~1251 samples each (.jpg + .cls).
Val shards: 64 tars.

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        14_vit_wds_compile.py --config configs/vit_s16_wds.yaml
"""
import argparse
import math
import multiprocessing
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import webdataset as wds
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP

import timm
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import CosineLRScheduler
from timm.utils import ModelEmaV3

DEFAULT_CFG = {
    "train_shards": "/shared/wds/imagenet1k-train-{0000..1023}.tar",
    "val_shards": "/shared/wds/imagenet1k-validation-{00..63}.tar",
    "train_samples": 1281167,
    "val_samples": 50000,
    "model": "vit_small_patch16_224",
    "batch_size": 256,  # per GPU
    "epochs": 300,
    "warmup_epochs": 10,
    "lr": 1e-3,  # global batch 1024
    "weight_decay": 0.05,
    "drop_path": 0.1,
    "clip_grad": 1.0,
    "ema_decay": 0.9998,
    "workers": 8,
    "compile": True,
    "wandb_project": "vit-wds",
    "out": "/shared/runs/vit_s16_wds",
    "seed": 0,
}


class SharedEpoch:
    """Epoch counter visible inside the (persistent) dataloader workers."""

    def __init__(self, epoch=0):
        self.shared = multiprocessing.Value("i", epoch)

    def set_value(self, epoch):
        self.shared.value = epoch

    def get_value(self):
        return self.shared.value


class detshuffle_shards(wds.PipelineStage):
    # same permutation on every rank for a given epoch, so split_by_node stays disjoint
    def __init__(self, seed, epoch):
        self.seed, self.epoch = seed, epoch

    def run(self, src):
        urls = list(src)
        random.Random(self.seed + self.epoch.get_value()).shuffle(urls)
        return iter(urls)


def train_pipeline(cfg, world_size, epoch):
    tf = create_transform(224, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                          interpolation="bicubic", re_prob=0.25)
    global_batch = cfg["batch_size"] * world_size
    num_batches = cfg["train_samples"] // global_batch  # per rank
    per_worker = math.ceil(num_batches / cfg["workers"])
    num_batches = per_worker * cfg["workers"]
    pipe = wds.DataPipeline(
        wds.SimpleShardList(cfg["train_shards"]),
        detshuffle_shards(cfg["seed"], epoch),
        wds.split_by_node,
        wds.split_by_worker,
        wds.tarfile_to_samples(handler=wds.warn_and_continue),
        wds.shuffle(5000, initial=1000),
        wds.decode("pil", handler=wds.warn_and_continue),
        wds.to_tuple("jpg", "cls"),
        wds.map_tuple(tf, int),
        wds.batched(cfg["batch_size"], partial=False),
    ).repeat().with_epoch(per_worker)  # every rank runs exactly num_batches steps
    loader = wds.WebLoader(pipe, batch_size=None, shuffle=False, num_workers=cfg["workers"],
                           persistent_workers=True, pin_memory=True)
    return loader, num_batches


def val_pipeline(cfg):
    tf = create_transform(224, is_training=False, crop_pct=0.9, interpolation="bicubic")
    pipe = wds.DataPipeline(
        wds.SimpleShardList(cfg["val_shards"]),
        wds.split_by_node,
        wds.split_by_worker,
        wds.tarfile_to_samples(),
        wds.decode("pil"),
        wds.to_tuple("jpg", "cls"),
        wds.map_tuple(tf, int),
        wds.batched(250, partial=True),
    )
    return wds.WebLoader(pipe, batch_size=None, num_workers=4)


@torch.no_grad()
def evaluate(model, loader, device):
    # shards are split across ranks, so each rank sees a different number of
    # samples; we only sum counts at the end (no collective inside the loop)
    model.eval()
    acc = torch.zeros(2, device=device, dtype=torch.float64)
    for x, y in loader:
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        acc[0] += (logits.argmax(-1) == y).sum()
        acc[1] += y.numel()
    dist.all_reduce(acc)
    return (100 * acc[0] / acc[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--resume", default=None)
    a = ap.parse_args()
    cfg = dict(DEFAULT_CFG)
    if a.config:
        with open(a.config) as f:
            cfg.update(yaml.safe_load(f) or {})

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg["seed"] + rank)

    run = None
    if rank == 0:
        import wandb
        os.makedirs(cfg["out"], exist_ok=True)
        run = wandb.init(project=cfg["wandb_project"], config=cfg, dir=cfg["out"], resume="allow")

    epoch_counter = SharedEpoch()
    train_loader, steps_per_epoch = train_pipeline(cfg, world, epoch_counter)
    val_loader = val_pipeline(cfg)

    net = timm.create_model(cfg["model"], num_classes=1000, drop_path_rate=cfg["drop_path"]).to(device)
    model = DDP(net, device_ids=[local_rank])
    ema = ModelEmaV3(net, decay=cfg["ema_decay"])  # net already holds rank 0's weights here
    if cfg["compile"]:
        model = torch.compile(model)

    lr = cfg["lr"] * cfg["batch_size"] * world / 1024
    optimizer = create_optimizer_v2(net, opt="adamw", lr=lr, weight_decay=cfg["weight_decay"])
    sched = CosineLRScheduler(optimizer, t_initial=cfg["epochs"] * steps_per_epoch, lr_min=1e-6,
                              warmup_t=cfg["warmup_epochs"] * steps_per_epoch, warmup_lr_init=1e-6,
                              t_in_epochs=False)
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=1000)
    criterion = SoftTargetCrossEntropy()

    start_epoch = 0
    if a.resume:
        ck = torch.load(a.resume, map_location="cpu")
        net.load_state_dict(ck["model"])
        ema.module.load_state_dict(ck["ema"])
        optimizer.load_state_dict(ck["optimizer"])
        start_epoch = ck["epoch"] + 1

    for epoch in range(start_epoch, cfg["epochs"]):
        epoch_counter.set_value(epoch)
        model.train()
        t0 = time.time()
        for step, (x, y) in enumerate(train_loader):
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            x, y = mixup(x, y)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = nn.utils.clip_grad_norm_(net.parameters(), cfg["clip_grad"])
            optimizer.step()
            ema.update(net)
            it = epoch * steps_per_epoch + step + 1
            sched.step_update(num_updates=it)
            if run is not None and step % 50 == 0:
                run.log({"loss": loss.item(), "grad_norm": gnorm.item(),
                         "lr": optimizer.param_groups[0]["lr"],
                         "img_per_s": (step + 1) * cfg["batch_size"] * world / (time.time() - t0)}, step=it)

        acc = evaluate(net, val_loader, device)
        ema_acc = evaluate(ema.module, val_loader, device)
        if rank == 0:
            run.log({"val/acc1": acc, "val/ema_acc1": ema_acc, "epoch": epoch},
                    step=(epoch + 1) * steps_per_epoch)
            print(f"epoch {epoch}: acc1 {acc:.2f} ema {ema_acc:.2f} ({time.time() - t0:.0f}s)")
            torch.save({"model": net.state_dict(), "ema": ema.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "epoch": epoch},
                       os.path.join(cfg["out"], "last.pt"))

    if run is not None:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
