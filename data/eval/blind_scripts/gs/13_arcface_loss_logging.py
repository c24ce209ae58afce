#!/usr/bin/env python3
"""ArcFace R50 / MS1MV3 with partial-FC, extra training diagnostics (feature norm, grad norm, data time).

Usage:
    torchrun --nproc_per_node=8 train_diag.py --cfg configs/ms1mv3_r50.yaml
"""
import argparse
import logging
import os
import pickle
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from backbones import get_model
from dataset import MXFaceDataset
from losses import ArcFace
from partial_fc_v2 import PartialFC_V2

DEFAULT_CFG = {
    "rec": "/train_tmp/ms1m-retinaface-t1",
    "output": "work_dirs/ms1mv3_r50_diag",
    "network": "r50",
    "embedding_size": 512,
    "num_classes": 93431,
    "sample_rate": 1.0,
    "batch_size": 128,
    "lr": 0.1,
    "momentum": 0.9,
    "weight_decay": 5e-4,
    "epochs": 20,
    "warmup_epochs": 0,
    "log_every": 20,
    "val_every": 2000,
    "val_targets": ["lfw", "cfp_fp", "agedb_30"],
    "fp16": True,
}


def load_cfg(path):
    cfg = dict(DEFAULT_CFG)
    if path:
        with open(path) as f:
            cfg.update(yaml.safe_load(f))
    return argparse.Namespace(**cfg)


def read_bin(path):
    with open(path, "rb") as f:
        bins, issame = pickle.load(f, encoding="bytes")
    imgs = np.stack([cv2.imdecode(np.frombuffer(b, np.uint8), cv2.IMREAD_COLOR)[..., ::-1] for b in bins])
    return torch.from_numpy(imgs.transpose(0, 3, 1, 2).copy()), np.asarray(issame, dtype=bool)


@torch.no_grad()
def pair_accuracy(model, imgs, issame, device):
    was_training = model.training
    model.eval()
    out = []
    for i in range(0, len(imgs), 250):
        x = imgs[i:i + 250].to(device).float().sub_(127.5).div_(127.5)
        out.append(F.normalize(model(x) + model(torch.flip(x, [3]))).cpu())
    model.train(was_training)
    emb = torch.cat(out)
    sim = (emb[0::2] * emb[1::2]).sum(-1).numpy()
    thresholds = np.linspace(-1, 1, 801)
    return float(np.max([np.mean((sim > t) == issame) for t in thresholds]))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cfg", default="")
    cfg = load_cfg(parser.parse_args().cfg)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    os.makedirs(cfg.output, exist_ok=True)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    tb = SummaryWriter(os.path.join(cfg.output, "tb")) if rank == 0 else None

    dataset = MXFaceDataset(root_dir=cfg.rec, local_rank=local_rank)
    sampler = DistributedSampler(dataset, shuffle=True, seed=2048)
    loader = DataLoader(dataset, batch_size=cfg.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    backbone = get_model(cfg.network, dropout=0.0, fp16=cfg.fp16, num_features=cfg.embedding_size).to(device)
    backbone = DDP(backbone, device_ids=[local_rank], broadcast_buffers=False, bucket_cap_mb=16)
    pfc = PartialFC_V2(ArcFace(s=64.0, margin=0.5), cfg.embedding_size, cfg.num_classes, cfg.sample_rate, cfg.fp16)
    pfc.train().to(device)

    opt = torch.optim.SGD([{"params": backbone.parameters()}, {"params": pfc.parameters()}],
                          lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    steps_per_epoch = len(loader)
    warmup = steps_per_epoch * cfg.warmup_epochs
    total = steps_per_epoch * cfg.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: (i + 1) / warmup if i < warmup else (1 - (i - warmup) / (total - warmup)) ** 2)
    scaler = torch.cuda.amp.GradScaler(enabled=cfg.fp16, growth_interval=100)

    val_sets = {}
    if rank == 0:
        for name in cfg.val_targets:
            p = os.path.join(cfg.rec, f"{name}.bin")
            if os.path.isfile(p):
                val_sets[name] = read_bin(p)

    step = 0
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        end = time.time()
        for img, label in loader:
            img = img.to(device, non_blocking=True)
            label = label.to(device, non_blocking=True)
            data_time = time.time() - end

            emb = backbone(img)
            loss = pfc(emb, label)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            grad_norm = torch.nn.utils.clip_grad_norm_(backbone.parameters(), 5)
            scaler.step(opt)
            scaler.update()
            sched.step()
            step += 1

            if rank == 0 and step % cfg.log_every == 0:
                # per-GPU diagnostics averaged over the job
                diag = torch.stack([emb.detach().float().norm(dim=1).mean(), grad_norm.float(),
                                    torch.tensor(data_time, device=device)])
                dist.all_reduce(diag)
                diag /= world_size
                feat_norm, gnorm, dtime = diag.tolist()
                logging.info("ep %d it %d/%d loss %.4f lr %.5f |x| %.2f |g| %.2f data %.3fs", epoch, step, total,
                             loss.item(), sched.get_last_lr()[0], feat_norm, gnorm, dtime)
                tb.add_scalar("train/loss", loss.item(), step)
                tb.add_scalar("train/feature_norm", feat_norm, step)
                tb.add_scalar("train/grad_norm", gnorm, step)
                tb.add_scalar("train/data_time", dtime, step)

            if step % cfg.val_every == 0:
                if rank == 0:
                    for name, (imgs, issame) in val_sets.items():
                        acc = pair_accuracy(backbone.module, imgs, issame, device)
                        logging.info("[%s][%d] acc %.4f", name, step, acc)
                        tb.add_scalar(f"val/{name}", acc, step)
                dist.barrier()
            end = time.time()

        torch.save(pfc.state_dict(), os.path.join(cfg.output, f"softmax_fc_gpu_{rank}.pt"))
        if rank == 0:
            torch.save(backbone.module.state_dict(), os.path.join(cfg.output, "model.pt"))
        dist.barrier()

    if tb is not None:
        tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
