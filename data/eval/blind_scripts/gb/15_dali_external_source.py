"""DALI parallel external_source pipeline (each rank reads its own slice of a file list) + DDP.

The file list is a text file "relative/path.jpg label" per line.

torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 \
    15_dali_external_source.py --list /shared/food101/train.txt \
    --val-list /shared/food101/test.txt --root /shared/food101/images
"""
import argparse
import os
import shutil
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from nvidia.dali import fn, pipeline_def, types
from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy


class ShardedFileSource:
    """Per-sample callback for fn.external_source(parallel=True).

    All ranks use the same seed, so they draw the same permutation each epoch and
    each one reads a disjoint window of it.
    """

    def __init__(self, list_file, root, batch_size, shard_id, num_shards, seed=0):
        with open(list_file) as f:
            self.items = [line.split() for line in f if line.strip()]
        self.root = root
        self.shard_size = len(self.items) // num_shards
        self.shard_offset = self.shard_size * shard_id
        self.full_iterations = self.shard_size // batch_size
        self.seed = seed
        self.perm = None
        self.last_seen_epoch = None

    def __call__(self, sample_info):
        if sample_info.iteration >= self.full_iterations:
            raise StopIteration()
        if self.last_seen_epoch != sample_info.epoch_idx:
            self.last_seen_epoch = sample_info.epoch_idx
            rng = np.random.default_rng(seed=self.seed + sample_info.epoch_idx)
            self.perm = rng.permutation(len(self.items))
        rel, label = self.items[self.perm[sample_info.idx_in_epoch + self.shard_offset]]
        with open(os.path.join(self.root, rel), "rb") as f:
            encoded = np.frombuffer(f.read(), dtype=np.uint8)
        return encoded, np.array([int(label)], dtype=np.int32)


@pipeline_def(py_num_workers=6, py_start_method="spawn")
def train_pipe(source, size):
    jpegs, labels = fn.external_source(source=source, num_outputs=2, batch=False, parallel=True,
                                       dtype=[types.UINT8, types.INT32])
    images = fn.decoders.image_random_crop(jpegs, device="mixed", output_type=types.RGB,
                                           random_area=[0.1, 1.0])
    images = fn.resize(images, resize_x=size, resize_y=size)
    images = fn.color_twist(images, brightness=fn.random.uniform(range=[0.7, 1.3]),
                            contrast=fn.random.uniform(range=[0.7, 1.3]),
                            saturation=fn.random.uniform(range=[0.7, 1.3]))
    images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW",
                                      mean=[127.5] * 3, std=[127.5] * 3,
                                      mirror=fn.random.coin_flip())
    return images, labels.gpu()


@pipeline_def
def val_pipe(list_file, root, size, shard_id, num_shards):
    jpegs, labels = fn.readers.file(file_root=root, file_list=list_file, shard_id=shard_id,
                                    num_shards=num_shards, random_shuffle=False, pad_last_batch=True,
                                    name="ValReader")
    images = fn.decoders.image(jpegs, device="mixed", output_type=types.RGB)
    images = fn.resize(images, resize_shorter=int(size * 256 / 224))
    images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW", crop=(size, size),
                                      mean=[127.5] * 3, std=[127.5] * 3)
    return images, labels.gpu()


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--list", required=True)
    p.add_argument("--val-list", required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--model", default="convnext_small.fb_in22k")
    p.add_argument("--num-classes", type=int, default=101)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-4, help="per 256")
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--out", default="/shared/food101/runs/convnext_s")
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


def save_checkpoint(state, is_best, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "checkpoint.pth")
    torch.save(state, path)
    if is_best:
        shutil.copyfile(path, os.path.join(out_dir, "model_best.pth"))


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    source = ShardedFileSource(args.list, args.root, args.batch_size, shard_id=rank, num_shards=world, seed=17)
    pipe = train_pipe(source=source, size=args.size, batch_size=args.batch_size, num_threads=4,
                      device_id=local_rank, seed=1000 + rank, prefetch_queue_depth=4)
    pipe.start_py_workers()
    pipe.build()
    loader = DALIGenericIterator(pipe, ["images", "labels"], last_batch_policy=LastBatchPolicy.DROP,
                                 auto_reset=True)
    vpipe = val_pipe(list_file=args.val_list, root=args.root, size=args.size, shard_id=rank, num_shards=world,
                     batch_size=128, num_threads=4, device_id=local_rank)
    vpipe.build()
    val_loader = DALIGenericIterator(vpipe, ["images", "labels"], reader_name="ValReader",
                                     last_batch_policy=LastBatchPolicy.PARTIAL, auto_reset=True)

    model = timm.create_model(args.model, pretrained=True, num_classes=args.num_classes).cuda()
    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 256
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * source.full_iterations)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    start_epoch, best_acc = 0, 0.0
    ckpt_path = os.path.join(args.out, "checkpoint.pth")
    if args.resume and os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=f"cuda:{local_rank}")
        model.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        start_epoch, best_acc = ck["epoch"] + 1, ck["best_acc"]

    for epoch in range(start_epoch, args.epochs):
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device="cuda")
        for i, data in enumerate(loader):
            images = data[0]["images"]
            labels = data[0]["labels"].view(-1).long()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            loss_sum[0] += loss.detach().float()
            loss_sum[1] += 1
        dist.all_reduce(loss_sum)
        epoch_loss = (loss_sum[0] / loss_sum[1]).item()

        model.eval()
        hits = torch.zeros(2, device="cuda")
        with torch.no_grad():
            for data in val_loader:
                images = data[0]["images"]
                labels = data[0]["labels"].view(-1).long()
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    pred = model(images).argmax(1)
                hits[0] += (pred == labels).sum()
                hits[1] += labels.numel()
        dist.all_reduce(hits)
        acc = (hits[0] / hits[1]).item() * 100
        is_best = acc > best_acc
        best_acc = max(best_acc, acc)
        if rank == 0:
            print(f"epoch {epoch} loss {epoch_loss:.4f} val top1 {acc:.2f} "
                  f"lr {scheduler.get_last_lr()[0]:.2e} time {time.time() - t0:.0f}s", flush=True)

        save_checkpoint({
            "epoch": epoch,
            "model": model.module.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "best_acc": best_acc,
        }, is_best, args.out)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
