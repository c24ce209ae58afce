"""ResNet-50 on FFCV with progressive resizing (160 -> 192 px) and BlurPool-free torchvision model.

torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
    11_ffcv_progressive_resize.py --train /lustre/ffcv/train_500_0.50_90.beton --val /lustre/ffcv/val_500_0.50_90.beton
"""
import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP

from ffcv.fields.basics import IntDecoder
from ffcv.fields.rgb_image import CenterCropRGBImageDecoder, RandomResizedCropRGBImageDecoder
from ffcv.loader import Loader, OrderOption
from ffcv.transforms import NormalizeImage, RandomHorizontalFlip, Squeeze, ToDevice, ToTensor, ToTorchImage

MEAN = np.array([0.485, 0.456, 0.406]) * 255
STD = np.array([0.229, 0.224, 0.225]) * 255


def arguments():
    a = argparse.ArgumentParser()
    a.add_argument("--train", required=True)
    a.add_argument("--val", required=True)
    a.add_argument("--epochs", type=int, default=88)
    a.add_argument("--bs", type=int, default=128)
    a.add_argument("--lr", type=float, default=1.7, help="for a global batch of 1024")
    a.add_argument("--wd", type=float, default=1e-4)
    a.add_argument("--min-res", type=int, default=160)
    a.add_argument("--max-res", type=int, default=192)
    a.add_argument("--end-ramp", type=int, default=76)
    a.add_argument("--val-res", type=int, default=256)
    a.add_argument("--workers", type=int, default=10)
    a.add_argument("--log-every", type=int, default=100)
    a.add_argument("--out", default="/lustre/runs/rn50_ffcv")
    return a.parse_args()


def res_for_epoch(epoch, min_res, max_res, end_ramp, start_ramp=65):
    if epoch <= start_ramp:
        return min_res
    if epoch >= end_ramp:
        return max_res
    r = np.interp([epoch], [start_ramp, end_ramp], [min_res, max_res])[0]
    return int(np.round(r / 32)) * 32


def create_train_loader(path, bs, workers, res, device):
    decoder = RandomResizedCropRGBImageDecoder((res, res))
    pipes = {
        "image": [decoder, RandomHorizontalFlip(), ToTensor(), ToDevice(device, non_blocking=True),
                  ToTorchImage(), NormalizeImage(MEAN, STD, np.float16)],
        "label": [IntDecoder(), ToTensor(), Squeeze(), ToDevice(device, non_blocking=True)],
    }
    loader = Loader(path, batch_size=bs, num_workers=workers, order=OrderOption.RANDOM,
                    os_cache=False, drop_last=True, pipelines=pipes, distributed=True)
    return loader, decoder


def create_val_loader(path, bs, workers, res, device):
    pipes = {
        "image": [CenterCropRGBImageDecoder((res, res), ratio=224 / 256), ToTensor(),
                  ToDevice(device, non_blocking=True), ToTorchImage(), NormalizeImage(MEAN, STD, np.float16)],
        "label": [IntDecoder(), ToTensor(), Squeeze(), ToDevice(device, non_blocking=True)],
    }
    return Loader(path, batch_size=bs, num_workers=workers, order=OrderOption.SEQUENTIAL,
                  drop_last=False, pipelines=pipes, distributed=True)


def step_lr(step, steps_per_epoch, epochs, peak, warm_epochs=5):
    e = step / steps_per_epoch
    if e < warm_epochs:
        return peak * e / warm_epochs
    return peak * max(0.0, (epochs - e) / (epochs - warm_epochs))


def main():
    args = arguments()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    train_loader, decoder = create_train_loader(args.train, args.bs, args.workers, args.min_res, device)
    val_loader = create_val_loader(args.val, 256, args.workers, args.val_res, device)

    model = torchvision.models.resnet50().to(memory_format=torch.channels_last).to(device)
    model = DDP(model, device_ids=[local_rank])
    peak = args.lr * args.bs * world / 1024
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]
    opt = torch.optim.SGD([{"params": decay, "weight_decay": args.wd},
                           {"params": no_decay, "weight_decay": 0.0}], lr=peak, momentum=0.9)
    scaler = torch.cuda.amp.GradScaler()
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)

    out = Path(args.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        logf = open(out / "log.jsonl", "a")

    steps_per_epoch = len(train_loader)
    step = 0
    for epoch in range(args.epochs):
        res = res_for_epoch(epoch, args.min_res, args.max_res, args.end_ramp)
        decoder.output_size = (res, res)
        model.train()
        t0 = time.time()
        for images, target in train_loader:
            lr = step_lr(step, steps_per_epoch, args.epochs, peak)
            for g in opt.param_groups:
                g["lr"] = lr
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda"):
                loss = loss_fn(model(images), target)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            step += 1

            if rank == 0 and step % args.log_every == 0:
                avg = loss.detach().clone()
                dist.all_reduce(avg, op=dist.ReduceOp.AVG)
                print(f"epoch {epoch} step {step} res {res} lr {lr:.3f} loss {avg.item():.4f}", flush=True)

        model.eval()
        stats = torch.zeros(3, device=device)
        with torch.no_grad(), torch.autocast("cuda"):
            for images, target in val_loader:
                logits = model(images)
                stats[0] += (logits.argmax(1) == target).sum()
                stats[1] += (logits.topk(5, 1).indices == target[:, None]).any(1).sum()
                stats[2] += target.numel()
        dist.all_reduce(stats)
        top1, top5 = (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()

        if rank == 0:
            rec = {"epoch": epoch, "res": res, "top1": top1, "top5": top5, "epoch_s": time.time() - t0}
            logf.write(json.dumps(rec) + "\n")
            logf.flush()
            print(rec, flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch,
                        "scaler": scaler.state_dict()}, out / "latest.pt")
        dist.barrier()

    if rank == 0:
        logf.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
