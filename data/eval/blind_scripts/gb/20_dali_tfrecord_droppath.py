"""ConvNeXt / ViT training from ImageNet TFRecords with a DALI GPU pipeline.

Stochastic depth is ramped up linearly over training (from 0 to --drop-path).

torchrun --nproc_per_node=8 20_dali_tfrecord_droppath.py --tfrecord-dir /data/imagenet-tfrecord \
    --index-dir /data/imagenet-tfrecord-idx --arch convnext_tiny
"""
import argparse
import glob
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from timm.layers import DropPath
from torch.nn.parallel import DistributedDataParallel as DDP

import nvidia.dali.tfrecord as tfrec
from nvidia.dali import fn, pipeline_def, types
from nvidia.dali.plugin.pytorch import DALIClassificationIterator, LastBatchPolicy


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--tfrecord-dir", required=True)
    p.add_argument("--index-dir", required=True)
    p.add_argument("--arch", default="convnext_tiny")
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3, help="per 1024 images")
    p.add_argument("--drop-path", type=float, default=0.1)
    p.add_argument("--threads", type=int, default=6)
    p.add_argument("--save-dir", default="/mnt/shared/dali_tfrec_runs")
    return p.parse_args()


@pipeline_def
def tfrecord_pipe(records, indexes, shard_id, num_shards, is_train):
    inputs = fn.readers.tfrecord(
        path=records, index_path=indexes,
        features={
            "image/encoded": tfrec.FixedLenFeature((), tfrec.string, ""),
            "image/class/label": tfrec.FixedLenFeature([1], tfrec.int64, -1),
        },
        shard_id=shard_id, num_shards=num_shards, random_shuffle=is_train,
        initial_fill=10000, pad_last_batch=True, name="Reader",
    )
    jpegs = inputs["image/encoded"]
    # TF ImageNet records use labels 1..1000
    labels = inputs["image/class/label"] - 1
    if is_train:
        images = fn.decoders.image_random_crop(jpegs, device="mixed", output_type=types.RGB,
                                               random_area=[0.08, 1.0], random_aspect_ratio=[0.75, 1.33])
        images = fn.resize(images, resize_x=224, resize_y=224)
        mirror = fn.random.coin_flip(probability=0.5)
    else:
        images = fn.decoders.image(jpegs, device="mixed", output_type=types.RGB)
        images = fn.resize(images, resize_shorter=256)
        mirror = False
    images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW", crop=(224, 224),
                                      mean=[0.485 * 255, 0.456 * 255, 0.406 * 255],
                                      std=[0.229 * 255, 0.224 * 255, 0.225 * 255], mirror=mirror)
    return images, labels.gpu()


class Classifier(nn.Module):
    def __init__(self, arch, num_classes=1000):
        super().__init__()
        self.net = timm.create_model(arch, num_classes=num_classes, drop_path_rate=0.0)
        # replace the Identity placeholders timm uses when drop_path_rate=0
        self.drop_paths = []
        for module in self.net.modules():
            for name, child in module.named_children():
                if name.startswith("drop_path"):
                    dp = DropPath(0.0)
                    setattr(module, name, dp)
                    self.drop_paths.append(dp)

    def set_drop_path(self, rate):
        n = len(self.drop_paths)
        for i, dp in enumerate(self.drop_paths):
            dp.drop_prob = rate * i / max(1, n - 1)

    def forward(self, x):
        return self.net(x)


def make_loader(args, split, rank, world, local_rank, is_train):
    records = sorted(glob.glob(os.path.join(args.tfrecord_dir, f"{split}-*")))
    indexes = [os.path.join(args.index_dir, os.path.basename(r) + ".idx") for r in records]
    pipe = tfrecord_pipe(records=records, indexes=indexes, shard_id=rank, num_shards=world, is_train=is_train,
                         batch_size=args.batch_size, num_threads=args.threads, device_id=local_rank,
                         seed=2024 + rank)
    pipe.build()
    return DALIClassificationIterator(pipe, reader_name="Reader", auto_reset=True,
                                      last_batch_policy=LastBatchPolicy.DROP if is_train else LastBatchPolicy.PARTIAL)


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    train_loader = make_loader(args, "train", rank, world, local_rank, True)
    val_loader = make_loader(args, "validation", rank, world, local_rank, False)

    model = Classifier(args.arch).cuda()
    model = DDP(model, device_ids=[local_rank])

    lr = args.lr * args.batch_size * world / 1024
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    steps = len(train_loader)
    scheduler = torch.optim.lr_scheduler.SequentialLR(
        optimizer,
        [torch.optim.lr_scheduler.LinearLR(optimizer, 0.01, 1.0, total_iters=5 * steps),
         torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=(args.epochs - 5) * steps)],
        milestones=[5 * steps],
    )
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    for epoch in range(args.epochs):
        model.set_drop_path(args.drop_path * epoch / max(1, args.epochs - 1))
        model.train()
        t0 = time.time()
        for i, data in enumerate(train_loader):
            x = data[0]["data"]
            y = data[0]["label"].view(-1).long()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if i % 100 == 0:
                avg = loss.detach().clone()
                dist.all_reduce(avg, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} iter {i}/{steps} loss {avg.item():.4f} "
                          f"lr {scheduler.get_last_lr()[0]:.2e}", flush=True)

        model.eval()
        stats = torch.zeros(2, device="cuda")
        with torch.no_grad():
            for data in val_loader:
                x = data[0]["data"]
                y = data[0]["label"].view(-1).long()
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    stats[0] += (model(x).argmax(1) == y).sum()
                stats[1] += y.numel()
        dist.all_reduce(stats)
        if rank == 0:
            print(f"epoch {epoch} top1 {100 * stats[0].item() / stats[1].item():.2f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
                       os.path.join(args.save_dir, f"{args.arch}_last.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
