"""ConvNeXt-T on webdataset shards, composable wds.DataPipeline + kornia on GPU.

    torchrun --nproc_per_node=8 05_wds_pipeline_convnext.py \
        --train-urls '/mnt/shards/train-{0000..1023}.tar' --val-urls '/mnt/shards/val-{0000..0031}.tar'
"""
import argparse
import logging
import math
import os
import random

import kornia.augmentation as K
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision.transforms as T
import webdataset as wds
from torch.nn.parallel import DistributedDataParallel

log = logging.getLogger("train")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-urls", required=True)
    ap.add_argument("--val-urls", required=True)
    ap.add_argument("--num-train-samples", type=int, default=1_281_167)
    ap.add_argument("--model", default="convnext_tiny")
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=128, help="per GPU")
    ap.add_argument("--blr", type=float, default=4e-3, help="lr per 4096 images")
    ap.add_argument("--wd", type=float, default=0.05)
    ap.add_argument("--warmup-epochs", type=int, default=5)
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--shuffle-buffer", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ckpt-dir", default="/nfs/ckpt/convnext_wds")
    return ap.parse_args()


decode_train = T.Compose([T.RandomResizedCrop(224, scale=(0.08, 1.0), antialias=True), T.PILToTensor()])
decode_val = T.Compose([T.Resize(256), T.CenterCrop(224), T.PILToTensor()])


def make_train_pipeline(urls, batch_size, rank, world_size, seed, shuffle_buffer):
    """Training stream; shard order and sample shuffle are seeded per process."""
    rng_seed = seed * 1000 + rank
    pipeline = wds.DataPipeline(
        wds.SimpleShardList(urls, seed=rng_seed),
        wds.split_by_worker,
        wds.tarfile_to_samples(handler=wds.warn_and_continue),
        wds.shuffle(shuffle_buffer, initial=shuffle_buffer // 2, rng=random.Random(rng_seed)),
        wds.decode("pil", handler=wds.warn_and_continue),
        wds.to_tuple("jpg;png;jpeg", "cls"),
        wds.map_tuple(decode_train, int),
        wds.batched(batch_size, partial=False),
    )
    return pipeline


def make_val_pipeline(urls, batch_size):
    return wds.DataPipeline(
        wds.SimpleShardList(urls),
        wds.split_by_node,
        wds.split_by_worker,
        wds.tarfile_to_samples(),
        wds.decode("pil"),
        wds.to_tuple("jpg;png;jpeg", "cls"),
        wds.map_tuple(decode_val, int),
        wds.batched(batch_size, partial=True),
    )


class GPUAugment(nn.Module):
    def __init__(self):
        super().__init__()
        self.aug = K.AugmentationSequential(
            K.RandomHorizontalFlip(),
            K.ColorJitter(0.3, 0.3, 0.3, 0.0, p=0.8),
            K.RandomGaussianBlur((23, 23), (0.1, 2.0), p=0.1),
        )
        self.norm = K.Normalize(mean=torch.tensor([0.485, 0.456, 0.406]),
                                std=torch.tensor([0.229, 0.224, 0.225]))

    @torch.no_grad()
    def forward(self, x, train=True):
        x = x.float().div_(255.0)
        if train:
            x = self.aug(x)
        return self.norm(x)


def lr_schedule(it, total_it, warmup_it, peak):
    if it < warmup_it:
        return peak * it / warmup_it
    progress = (it - warmup_it) / max(1, total_it - warmup_it)
    return 0.5 * peak * (1 + math.cos(math.pi * progress))


def save_checkpoint(path, model, optimizer, scaler, epoch):
    tmp = path + ".partial"
    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(), "epoch": epoch}, tmp)
    os.replace(tmp, path)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")
    torch.manual_seed(args.seed)

    train_ds = make_train_pipeline(args.train_urls, args.batch_size, rank, world_size,
                                   args.seed, args.shuffle_buffer)
    val_ds = make_val_pipeline(args.val_urls, 200)
    train_loader = wds.WebLoader(train_ds, batch_size=None, num_workers=args.workers,
                                 pin_memory=True, persistent_workers=True, prefetch_factor=4)
    val_loader = wds.WebLoader(val_ds, batch_size=None, num_workers=4, pin_memory=True)

    augment = GPUAugment().to(device)
    model = timm.create_model(args.model, num_classes=1000, drop_path_rate=0.1).to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank])

    global_bs = args.batch_size * world_size
    peak_lr = args.blr * global_bs / 4096
    optimizer = torch.optim.AdamW(model.parameters(), lr=peak_lr, weight_decay=args.wd)
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    iters_per_epoch = args.num_train_samples // global_bs
    total_iters = iters_per_epoch * args.epochs
    warmup_iters = iters_per_epoch * args.warmup_epochs

    ckpt_path = os.path.join(args.ckpt_dir, "last.pt")
    start_epoch = 0
    if os.path.isfile(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        scaler.load_state_dict(ck["scaler"])
        start_epoch = ck["epoch"] + 1
        log.info("resuming at epoch %d", start_epoch)

    it = start_epoch * iters_per_epoch
    for epoch in range(start_epoch, args.epochs):
        model.train()
        running = torch.zeros(2, device=device)
        for images, labels in train_loader:
            lr = lr_schedule(it, total_iters, warmup_iters, peak_lr)
            for g in optimizer.param_groups:
                g["lr"] = lr
            images = augment(images.to(device, non_blocking=True), train=True)
            labels = labels.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            running += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            it += 1
            if it % 200 == 0:
                log.info("epoch %d iter %d lr %.2e loss %.4f", epoch, it, lr, loss.item())

        dist.all_reduce(running)
        model.eval()
        correct = torch.zeros(2, device=device)
        with torch.no_grad():
            for images, labels in val_loader:
                images = augment(images.to(device, non_blocking=True), train=False)
                labels = labels.to(device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.float16):
                    pred = model.module(images).argmax(-1)
                correct += torch.stack([(pred == labels).sum(), torch.tensor(labels.numel(), device=device)])
        dist.all_reduce(correct)
        log.info("epoch %d train_loss %.4f val_top1 %.2f", epoch,
                 (running[0] / running[1]).item(), 100 * (correct[0] / correct[1]).item())

        if rank == 0:
            os.makedirs(args.ckpt_dir, exist_ok=True)
            save_checkpoint(ckpt_path, model, optimizer, scaler, epoch)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
