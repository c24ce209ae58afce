"""EfficientNet-B0 training from MXNet RecordIO shards with a DALI GPU pipeline.

torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $MASTER:29400 \
    06_dali_recordio_effnet.py --rec-dir /datasets/imagenet-rec
"""
import argparse
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from nvidia.dali import fn, pipeline_def, types
from nvidia.dali.plugin.pytorch import DALIClassificationIterator, LastBatchPolicy


class AverageMeter:
    def __init__(self):
        self.reset()

    def reset(self):
        self.sum, self.count = 0.0, 0

    def update(self, val, n=1):
        self.sum += val * n
        self.count += n

    @property
    def avg(self):
        return self.sum / max(1, self.count)


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--rec-dir", required=True)
    p.add_argument("--epochs", type=int, default=350)
    p.add_argument("--batch-size", type=int, default=192)
    p.add_argument("--lr", type=float, default=0.048, help="RMSprop lr per 4096 images")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--num-threads", type=int, default=6)
    p.add_argument("--out", default="/shared/effnet_b0")
    p.add_argument("--log-interval", type=int, default=100)
    return p.parse_args()


@pipeline_def
def rec_pipeline(rec_path, idx_path, shard_id, num_shards, size, training):
    jpegs, labels = fn.readers.mxnet(
        path=[rec_path], index_path=[idx_path],
        shard_id=shard_id, num_shards=num_shards,
        random_shuffle=training, pad_last_batch=True, name="Reader",
    )
    if training:
        images = fn.decoders.image_random_crop(jpegs, device="mixed", output_type=types.RGB,
                                               random_area=[0.08, 1.0], num_attempts=10)
        images = fn.resize(images, resize_x=size, resize_y=size)
        mirror = fn.random.coin_flip(probability=0.5)
    else:
        images = fn.decoders.image(jpegs, device="mixed", output_type=types.RGB)
        images = fn.resize(images, resize_shorter=int(size / 0.875))
        mirror = 0
    images = fn.crop_mirror_normalize(
        images, dtype=types.FLOAT16, output_layout="CHW", crop=(size, size),
        mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375], mirror=mirror,
    )
    return images, labels.gpu()


def dali_loader(rec_dir, split, batch_size, threads, local_rank, rank, world, size, training):
    pipe = rec_pipeline(
        batch_size=batch_size, num_threads=threads, device_id=local_rank, seed=1234 + rank,
        rec_path=os.path.join(rec_dir, f"{split}.rec"), idx_path=os.path.join(rec_dir, f"{split}.idx"),
        shard_id=rank, num_shards=world, size=size, training=training,
        prefetch_queue_depth=3 if training else 2,
    )
    pipe.build()
    return DALIClassificationIterator(
        pipe, reader_name="Reader", auto_reset=True,
        last_batch_policy=LastBatchPolicy.DROP if training else LastBatchPolicy.PARTIAL,
    )


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    train_it = dali_loader(args.rec_dir, "train", args.batch_size, args.num_threads, local_rank,
                           rank, world, args.image_size, True)
    val_it = dali_loader(args.rec_dir, "val", args.batch_size, args.num_threads, local_rank,
                         rank, world, args.image_size, False)

    model = timm.create_model("efficientnet_b0", num_classes=1000, drop_rate=0.2, drop_path_rate=0.2)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda()
    model = DDP(model, device_ids=[local_rank])

    lr = args.lr * args.batch_size * world / 4096
    optimizer = torch.optim.RMSprop(model.parameters(), lr=lr, alpha=0.9, eps=1e-3,
                                    momentum=0.9, weight_decay=1e-5)
    # decay by 0.97 every 2.4 epochs, 3 warmup epochs
    steps_per_epoch = len(train_it)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / (3 * steps_per_epoch)) * 0.97 ** (s / (2.4 * steps_per_epoch)),
    )
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        model.train()
        tic = time.time()
        for i, batch in enumerate(train_it):
            x = batch[0]["data"]
            y = batch[0]["label"].squeeze(-1).long()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if i % args.log_interval == 0:
                l = loss.detach().float()
                dist.all_reduce(l)
                if rank == 0:
                    print(f"[{epoch}:{i}/{steps_per_epoch}] loss {l.item() / world:.4f} "
                          f"lr {scheduler.get_last_lr()[0]:.5f}")

        model.eval()
        top1, top5 = AverageMeter(), AverageMeter()
        with torch.no_grad():
            for batch in val_it:
                x = batch[0]["data"]
                y = batch[0]["label"].squeeze(-1).long()
                with torch.autocast("cuda", dtype=torch.float16):
                    out = model(x)
                _, pred = out.topk(5, 1, True, True)
                hit = pred.eq(y.view(-1, 1))
                top1.update(hit[:, :1].float().sum().item() * 100.0 / y.size(0), y.size(0))
                top5.update(hit.float().sum().item() * 100.0 / y.size(0), y.size(0))

        if rank == 0:
            print(f"epoch {epoch} val top1 {top1.avg:.3f} top5 {top5.avg:.3f} "
                  f"time {time.time() - tic:.0f}s")
            if top1.avg > best:
                best = top1.avg
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pth"))
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "last.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
