"""TSM-R50 on Kinetics-400, launched with torch.multiprocessing (one process per GPU).

Single node:   python 13_tsm_spawn_train.py --data /data/k400 --gpus 8
Two nodes:     python 13_tsm_spawn_train.py --data /nfs/k400 --gpus 8 --nodes 2 --node-rank {0,1} \
                   --dist-url tcp://10.0.0.11:23456 --ckpt-dir /nfs/ckpt/tsm_k400_spawn
"""
import argparse
import os
import time
from collections import OrderedDict

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from decord import VideoReader, cpu
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--dist-url", default="tcp://127.0.0.1:23456")
    p.add_argument("--segments", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8, help="per process")
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--lr", type=float, default=0.02, help="for 128 clips")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--resume", default="")
    p.add_argument("--ckpt-dir", default="checkpoints/tsm_k400_spawn")
    return p.parse_args()


class TemporalShift(nn.Module):
    def __init__(self, net, n_segment, fold_div=8):
        super().__init__()
        self.net, self.n_segment, self.fold_div = net, n_segment, fold_div

    def forward(self, x):
        nt, c, h, w = x.size()
        x = x.view(nt // self.n_segment, self.n_segment, c, h, w)
        fold = c // self.fold_div
        out = torch.zeros_like(x)
        out[:, :-1, :fold] = x[:, 1:, :fold]
        out[:, 1:, fold:2 * fold] = x[:, :-1, fold:2 * fold]
        out[:, :, 2 * fold:] = x[:, :, 2 * fold:]
        return self.net(out.view(nt, c, h, w))


def tsm_resnet50(num_classes, segments):
    net = torchvision.models.resnet50(weights="IMAGENET1K_V1")
    for stage in (net.layer1, net.layer2, net.layer3, net.layer4):
        for blk in stage:
            blk.conv1 = TemporalShift(blk.conv1, segments)
    net.fc = nn.Sequential(nn.Dropout(0.5), nn.Linear(2048, num_classes))
    return net


class VideoList(Dataset):
    """Readers are opened inside __getitem__, so every DataLoader worker gets its own decord handle."""

    def __init__(self, root, split, segments, train):
        self.root, self.segments, self.train = root, segments, train
        with open(os.path.join(root, f"{split}.txt")) as f:
            self.items = [ln.rsplit(maxsplit=1) for ln in f.read().splitlines() if ln]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        path, label = self.items[idx]
        vr = VideoReader(os.path.join(self.root, path), ctx=cpu(0), num_threads=1)
        n = len(vr)
        seg = n / self.segments
        off = np.random.rand(self.segments) * seg if self.train else np.full(self.segments, seg / 2)
        frames = vr.get_batch(np.minimum((np.arange(self.segments) * seg + off).astype(int), n - 1)).asnumpy()
        x = torch.from_numpy(frames).permute(0, 3, 1, 2).float().div(255)
        x = F.interpolate(x, scale_factor=256 / min(x.shape[-2:]), mode="bilinear", align_corners=False)
        h, w = x.shape[-2:]
        if self.train:
            t, l = np.random.randint(0, h - 223), np.random.randint(0, w - 223)
        else:
            t, l = (h - 224) // 2, (w - 224) // 2
        x = x[..., t:t + 224, l:l + 224]
        if self.train and np.random.rand() < 0.5:
            x = x.flip(-1)
        mean = x.new_tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
        std = x.new_tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
        return (x - mean) / std, int(label)


def strip_module(state_dict):
    # older checkpoints of this project were saved from the DDP wrapper
    return OrderedDict((k[7:] if k.startswith("module.") else k, v) for k, v in state_dict.items())


@torch.no_grad()
def validate(net, loader, gpu, segments):
    net.eval()
    m = torch.zeros(3, device=gpu)
    for x, y in loader:
        b = x.shape[0]
        x, y = x.cuda(gpu, non_blocking=True), y.cuda(gpu, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = net(x.flatten(0, 1)).view(b, segments, -1).mean(1)
        top5 = logits.topk(5, 1).indices
        m += torch.stack([(top5[:, 0] == y).sum(), (top5 == y[:, None]).any(1).sum(), torch.tensor(b, device=gpu)])
    dist.all_reduce(m)
    return (100 * m[0] / m[2]).item(), (100 * m[1] / m[2]).item()


def main_worker(gpu, ngpus_per_node, args):
    rank = args.node_rank * ngpus_per_node + gpu
    world_size = args.nodes * ngpus_per_node
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", init_method=args.dist_url, world_size=world_size, rank=rank)
    torch.backends.cudnn.benchmark = True

    model = tsm_resnet50(400, args.segments)
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(strip_module(ckpt["state_dict"]))
        start_epoch = ckpt["epoch"]
    else:
        ckpt, start_epoch = None, 0
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda(gpu)
    # SyncBN keeps running stats identical on all ranks, no need to re-broadcast buffers every forward
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[gpu], broadcast_buffers=False)

    train_set = VideoList(args.data, "train", args.segments, True)
    val_set = VideoList(args.data, "val", args.segments, False)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world_size)),
                            batch_size=args.batch_size, num_workers=args.workers, pin_memory=True)

    lr = args.lr * args.batch_size * args.accum * world_size / 128
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs)
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
    scaler = torch.cuda.amp.GradScaler()

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        tic = time.time()
        optimizer.zero_grad(set_to_none=True)
        for i, (x, y) in enumerate(loader):
            b = x.shape[0]
            x, y = x.cuda(gpu, non_blocking=True), y.cuda(gpu, non_blocking=True)
            last_micro = (i + 1) % args.accum == 0
            if last_micro:
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = F.cross_entropy(ddp(x.flatten(0, 1)).view(b, args.segments, -1).mean(1), y) / args.accum
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
            else:
                with ddp.no_sync():
                    with torch.autocast("cuda", dtype=torch.float16):
                        loss = F.cross_entropy(ddp(x.flatten(0, 1)).view(b, args.segments, -1).mean(1), y) / args.accum
                    scaler.scale(loss).backward()
            if rank == 0 and i % 100 == 0:
                print(f"[{epoch}][{i}/{len(loader)}] loss {loss.item() * args.accum:.4f} "
                      f"{(time.time() - tic) / (i + 1):.2f}s/it", flush=True)
        scheduler.step()
        top1, top5 = validate(model, val_loader, gpu, args.segments)
        if rank == 0:
            print(f"epoch {epoch}: top1 {top1:.2f} top5 {top5:.2f}", flush=True)
            os.makedirs(args.ckpt_dir, exist_ok=True)
            torch.save({"epoch": epoch + 1, "state_dict": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict()}, os.path.join(args.ckpt_dir, "checkpoint.pth.tar"))
        dist.barrier()

    dist.destroy_process_group()


def main():
    args = parse_args()
    mp.spawn(main_worker, nprocs=args.gpus, args=(args.gpus, args))


if __name__ == "__main__":
    main()
