"""
EfficientNetV2-M for shelf-product recognition (48k SKUs), trained from webdataset shards
on the shared NFS (tars written by the labeling export, ~1,800 shards x ~9k samples).

Kubeflow PyTorchJob (2 replicas x 8 A100-40G), pod command:

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \
        --rdzv_endpoint=$MASTER_ADDR:$MASTER_PORT --rdzv_id=$PET_RDZV_ID \
        train_effnet_wds.py --train-shards '/nfs/shelf/wds/train-{0000..1799}.tar' \
        --val-shards '/nfs/shelf/wds/val-{000..047}.tar' --epoch-samples 16000000 \
        --out /nfs/exp/effv2m_shelf_v6

Batch statistics matter here (small per-GPU batch at 480px), hence SyncBatchNorm.
"""
import argparse
import math
import os
import time

import mlflow
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import webdataset as wds
from torch.nn.parallel import DistributedDataParallel as DDP
from torchvision import transforms as T

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-shards", required=True)
    p.add_argument("--val-shards", required=True)
    p.add_argument("--epoch-samples", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--num-classes", type=int, default=48213)
    p.add_argument("--img-size", type=int, default=480)
    p.add_argument("--batch-size", type=int, default=24, help="per GPU")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--lr", type=float, default=0.1, help="SGD lr for batch 1024")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--compile", action="store_true")
    return p.parse_args()


def train_loader(a, world):
    tf = T.Compose([T.RandomResizedCrop(a.img_size, scale=(0.35, 1.0)), T.RandomHorizontalFlip(),
                    T.ColorJitter(0.3, 0.3, 0.3), T.ToTensor(), T.Normalize(MEAN, STD)])
    # resampled shards: every rank/worker draws its own random shard stream, so no node split is needed,
    # and with_epoch gives every rank exactly the same number of batches
    ds = (wds.WebDataset(a.train_shards, resampled=True, handler=wds.warn_and_continue)
          .shuffle(4000)
          .decode("pil", handler=wds.warn_and_continue)
          .to_tuple("jpg", "cls")
          .map_tuple(tf, int)
          .batched(a.batch_size, partial=False))
    n_batches = a.epoch_samples // (a.batch_size * world)
    loader = wds.WebLoader(ds, batch_size=None, num_workers=a.workers, pin_memory=True,
                           persistent_workers=True).with_epoch(n_batches)
    return loader, n_batches


def val_loader(a):
    tf = T.Compose([T.Resize(int(a.img_size / 0.95)), T.CenterCrop(a.img_size), T.ToTensor(), T.Normalize(MEAN, STD)])
    ds = (wds.WebDataset(a.val_shards, nodesplitter=wds.split_by_node, shardshuffle=False)
          .decode("pil").to_tuple("jpg", "cls").map_tuple(tf, int).batched(64, partial=True))
    return wds.WebLoader(ds, batch_size=None, num_workers=2)


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    s = torch.zeros(2, device=device)
    for x, y in loader:
        x = x.to(device, non_blocking=True).to(memory_format=torch.channels_last)
        y = y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = net(x).argmax(1)
        s[0] += (pred == y).sum()
        s[1] += y.numel()
    dist.all_reduce(s)
    net.train()
    return (s[0] / s[1]).item()


def main():
    a = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    net = timm.create_model("tf_efficientnetv2_m.in21k", pretrained=True, num_classes=a.num_classes,
                            drop_rate=0.3, drop_path_rate=0.2)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    net = net.to(device).to(memory_format=torch.channels_last)

    lr = a.lr * a.batch_size * world / 1024
    decay = [p for n, p in net.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in net.named_parameters() if p.ndim <= 1]
    opt = torch.optim.SGD([{"params": decay, "weight_decay": 2e-5}, {"params": no_decay, "weight_decay": 0.0}],
                          lr=lr, momentum=0.9, nesterov=True)

    start_epoch = 0
    ck_path = os.path.join(a.out, "last.pt")
    if os.path.exists(ck_path):
        ck = torch.load(ck_path, map_location="cpu")
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start_epoch = ck["epoch"] + 1

    ddp = DDP(net, device_ids=[local_rank])
    model = torch.compile(ddp) if a.compile else ddp

    loader, steps_per_epoch = train_loader(a, world)
    vloader = val_loader(a)
    total = a.epochs * steps_per_epoch
    warmup = 2 * steps_per_epoch

    if rank == 0:
        os.makedirs(a.out, exist_ok=True)
        mlflow.set_experiment("shelf-recognition")
        mlflow.start_run(run_name=os.path.basename(a.out))
        mlflow.log_params({"lr": lr, "world": world, "batch": a.batch_size, "img": a.img_size})

    step = start_epoch * steps_per_epoch
    for epoch in range(start_epoch, a.epochs):
        model.train()
        t0 = time.time()
        for x, y in loader:
            x = x.to(device, non_blocking=True).to(memory_format=torch.channels_last)
            y = y.to(device, non_blocking=True)
            cur = lr * step / warmup if step < warmup else 0.5 * lr * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))
            for g in opt.param_groups:
                g["lr"] = cur
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step % 200 == 0:
                l = loss.detach().float()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    mlflow.log_metrics({"train_loss": l.item(), "lr": cur,
                                        "img_s": 200 * a.batch_size * world / (time.time() - t0)}, step=step)
                    t0 = time.time()

        acc = evaluate(ddp.module, vloader, device)
        if rank == 0:
            mlflow.log_metric("val_top1", acc, step=step)
            torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       ck_path + ".tmp")
            os.replace(ck_path + ".tmp", ck_path)
        dist.barrier()

    if rank == 0:
        mlflow.end_run()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
