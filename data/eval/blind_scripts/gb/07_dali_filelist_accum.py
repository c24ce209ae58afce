"""RegNetY training from a DALI file-list reader, with gradient accumulation.

Global batch = batch_size * accum_steps * world_size. The validation pass runs on
rank 0 only, over the whole val list, while the other ranks wait at the barrier.

torchrun --standalone --nproc_per_node=4 07_dali_filelist_accum.py --cfg cfg/regnety_016.json
"""
import argparse
import contextlib
import json
import math
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from nvidia.dali import fn, pipeline_def, types
from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

DEFAULT_CFG = {
    "root": "/data/imagenet",
    "train_list": "/data/imagenet/train_list.txt",
    "val_list": "/data/imagenet/val_list.txt",
    "arch": "regnety_016",
    "epochs": 100,
    "batch_size": 128,
    "accum_steps": 2,
    "lr_per_256": 0.1,
    "weight_decay": 5e-5,
    "warmup_epochs": 5,
    "dali_threads": 4,
    "out_dir": "/checkpoints/regnety_016",
}


@pipeline_def(enable_conditionals=False)
def file_list_pipe(root, file_list, shard_id, num_shards, train, crop=224):
    enc, label = fn.readers.file(file_root=root, file_list=file_list, shard_id=shard_id,
                                 num_shards=num_shards, random_shuffle=train,
                                 initial_fill=4096, pad_last_batch=True, name="Reader")
    if train:
        img = fn.decoders.image_random_crop(enc, device="mixed", output_type=types.RGB,
                                            random_area=[0.08, 1.0])
        img = fn.resize(img, resize_x=crop, resize_y=crop)
        flip = fn.random.coin_flip()
    else:
        img = fn.decoders.image(enc, device="mixed", output_type=types.RGB)
        img = fn.resize(img, resize_shorter=256)
        flip = 0
    img = fn.crop_mirror_normalize(img, dtype=types.FLOAT, output_layout="CHW", crop=(crop, crop),
                                   mean=[124.0, 116.0, 104.0], std=[58.0, 57.0, 57.5], mirror=flip)
    return img, fn.cast(label, dtype=types.INT64).gpu()


def build_iter(cfg, file_list, local_rank, shard_id, num_shards, train):
    pipe = file_list_pipe(batch_size=cfg["batch_size"], num_threads=cfg["dali_threads"],
                          device_id=local_rank, seed=42 + shard_id, root=cfg["root"],
                          file_list=file_list, shard_id=shard_id, num_shards=num_shards, train=train)
    pipe.build()
    policy = LastBatchPolicy.DROP if train else LastBatchPolicy.PARTIAL
    return DALIGenericIterator([pipe], ["data", "label"], reader_name="Reader",
                               last_batch_policy=policy, auto_reset=True)


@torch.no_grad()
def evaluate_full(net, loader):
    net.eval()
    correct = total = 0
    for batch in loader:
        x, y = batch[0]["data"], batch[0]["label"].view(-1)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = net(x).argmax(1)
        correct += (pred == y).sum().item()
        total += y.numel()
    return 100.0 * correct / total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default="")
    cli = ap.parse_args()
    cfg = dict(DEFAULT_CFG)
    if cli.cfg:
        with open(cli.cfg) as f:
            cfg.update(json.load(f))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    train_iter = build_iter(cfg, cfg["train_list"], local_rank, rank, world, train=True)
    # whole validation list, evaluated by rank 0 alone
    val_iter = build_iter(cfg, cfg["val_list"], local_rank, 0, 1, train=False) if rank == 0 else None

    model = timm.create_model(cfg["arch"], num_classes=1000).cuda()
    model = DDP(model, device_ids=[local_rank])

    accum = cfg["accum_steps"]
    global_batch = cfg["batch_size"] * accum * world
    peak_lr = cfg["lr_per_256"] * global_batch / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=peak_lr, momentum=0.9,
                                weight_decay=cfg["weight_decay"], nesterov=True)
    updates_per_epoch = len(train_iter) // accum
    total_updates = updates_per_epoch * cfg["epochs"]
    warmup = updates_per_epoch * cfg["warmup_epochs"]

    def lr_lambda(u):
        if u < warmup:
            return (u + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (u - warmup) / (total_updates - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    criterion = nn.CrossEntropyLoss()

    ckpt_file = os.path.join(cfg["out_dir"], "ckpt.pt")
    start_epoch, best = 0, 0.0
    if os.path.exists(ckpt_file):
        ck = torch.load(ckpt_file, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optim"])
        scheduler.load_state_dict(ck["sched"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]

    for epoch in range(start_epoch, cfg["epochs"]):
        model.train()
        t0 = time.time()
        optimizer.zero_grad(set_to_none=True)
        for i, batch in enumerate(train_iter):
            x, y = batch[0]["data"], batch[0]["label"].view(-1)
            boundary = (i + 1) % accum == 0
            # skip the gradient all-reduce on the intermediate micro-batches
            ctx = contextlib.nullcontext() if boundary else model.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = criterion(model(x), y) / accum
                loss.backward()
            if boundary:
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            if rank == 0 and i % 200 == 0:
                print(f"epoch {epoch} it {i} loss(rank0) {loss.item() * accum:.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.4f}", flush=True)

        if rank == 0:
            acc = evaluate_full(model.module, val_iter)
            best = max(best, acc)
            print(f"epoch {epoch} top1 {acc:.2f} best {best:.2f} ({time.time() - t0:.0f}s)", flush=True)
            os.makedirs(cfg["out_dir"], exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optim": optimizer.state_dict(),
                        "sched": scheduler.state_dict(), "epoch": epoch, "best": best},
                       ckpt_file + ".tmp")
            os.replace(ckpt_file + ".tmp", ckpt_file)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
