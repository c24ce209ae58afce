"""Quantization-aware fine-tuning of MobileNetV2 on ImageNet (eager mode, torch.ao).

Starts from the fp32 torchvision weights, fuses Conv+BN+ReLU, inserts fake-quant
modules and fine-tunes with DDP. After a few epochs the observers are frozen and
BatchNorm switches to its running statistics, as in the torchvision recipe.

    torchrun --nproc_per_node=8 02_qat_mobilenetv2.py --data /datasets/imagenet
"""
import argparse
import copy
import datetime
import os
import time

import torch
import torch.ao.nn.intrinsic.qat as nniqat
import torch.ao.quantization as tq
import torch.distributed as dist
import torch.nn as nn
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from torchvision.models.quantization import mobilenet_v2


def get_args():
    parser = argparse.ArgumentParser("MobileNetV2 QAT")
    parser.add_argument("--data", required=True)
    parser.add_argument("--output-dir", default="qat_mbv2")
    parser.add_argument("--backend", default="fbgemm", choices=["fbgemm", "x86", "qnnpack"])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per GPU")
    parser.add_argument("--lr", type=float, default=1e-4, help="for a global batch of 256")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--weight-decay", type=float, default=1e-4)
    parser.add_argument("--lr-step-size", type=int, default=30)
    parser.add_argument("--lr-gamma", type=float, default=0.1)
    parser.add_argument("--num-observer-update-epochs", type=int, default=4)
    parser.add_argument("--num-batch-norm-update-epochs", type=int, default=3)
    parser.add_argument("--int8-eval-batches", type=int, default=40)
    parser.add_argument("--workers", type=int, default=10)
    parser.add_argument("--print-freq", type=int, default=100)
    parser.add_argument("--resume", default="")
    return parser.parse_args()


def build_loaders(args, rank, world_size):
    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_set = torchvision.datasets.ImageFolder(
        os.path.join(args.data, "train"),
        transforms.Compose([
            transforms.RandomResizedCrop(224),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            normalize,
        ]),
    )
    val_set = torchvision.datasets.ImageFolder(
        os.path.join(args.data, "val"),
        transforms.Compose([
            transforms.Resize(256),
            transforms.CenterCrop(224),
            transforms.ToTensor(),
            normalize,
        ]),
    )
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    # strided shard without padding: every val image is counted exactly once
    val_shard = Subset(val_set, range(rank, len(val_set), world_size))
    val_loader = DataLoader(val_shard, batch_size=100, shuffle=False,
                            num_workers=args.workers, pin_memory=True)
    return train_loader, train_sampler, val_loader, val_set


def accuracy_counts(output, target, topk=(1, 5)):
    maxk = max(topk)
    _, pred = output.topk(maxk, 1, True, True)
    correct = pred.t().eq(target.view(1, -1))
    return [correct[:k].reshape(-1).float().sum() for k in topk]


@torch.no_grad()
def evaluate(model, loader, device, distributed=True, max_batches=None):
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for i, (images, target) in enumerate(loader):
        if max_batches is not None and i >= max_batches:
            break
        images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
        output = model(images)
        c1, c5 = accuracy_counts(output, target)
        totals += torch.stack([c1.double(), c5.double(), torch.tensor(target.numel(), dtype=torch.float64, device=device)])
    if distributed:
        dist.all_reduce(totals)
    return (100 * totals[0] / totals[2]).item(), (100 * totals[1] / totals[2]).item()


def train_one_epoch(model, criterion, optimizer, loader, device, epoch, print_freq, is_main):
    model.train()
    t0 = time.time()
    for i, (images, target) in enumerate(loader):
        images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
        output = model(images)
        loss = criterion(output, target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if is_main and i % print_freq == 0:
            ips = (i + 1) * images.size(0) / (time.time() - t0)
            print(f"Epoch [{epoch}] [{i}/{len(loader)}] loss {loss.item():.4f} "
                  f"lr {optimizer.param_groups[0]['lr']:.2e} {ips:.0f} img/s per GPU")


def main():
    args = get_args()
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=30))
    device = torch.device("cuda", local_rank)
    is_main = rank == 0
    if is_main:
        os.makedirs(args.output_dir, exist_ok=True)

    torch.backends.quantized.engine = args.backend
    train_loader, train_sampler, val_loader, val_set = build_loaders(args, rank, world_size)

    model = mobilenet_v2(weights="IMAGENET1K_V1", quantize=False)
    model.fuse_model(is_qat=True)
    model.qconfig = tq.get_default_qat_qconfig(args.backend)
    tq.prepare_qat(model, inplace=True)
    model.to(device)

    model = DDP(model, device_ids=[local_rank])
    model_without_ddp = model.module

    criterion = nn.CrossEntropyLoss()
    lr = args.lr * args.batch_size * world_size / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=args.lr_step_size,
                                                   gamma=args.lr_gamma)

    start_epoch = 0
    if args.resume:
        checkpoint = torch.load(args.resume, map_location="cpu")
        model_without_ddp.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        lr_scheduler.load_state_dict(checkpoint["lr_scheduler"])
        start_epoch = checkpoint["epoch"] + 1

    # observers and fake-quant on from the start
    model.apply(tq.enable_observer)
    model.apply(tq.enable_fake_quant)

    start = time.time()
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        train_one_epoch(model, criterion, optimizer, train_loader, device, epoch,
                        args.print_freq, is_main)
        lr_scheduler.step()

        with torch.inference_mode():
            if epoch >= args.num_observer_update_epochs:
                if is_main:
                    print("Disabling observer for subseq epochs, epoch = ", epoch)
                model.apply(tq.disable_observer)
            if epoch >= args.num_batch_norm_update_epochs:
                if is_main:
                    print("Freezing BN for subseq epochs, epoch = ", epoch)
                model.apply(nniqat.freeze_bn_stats)

            top1, top5 = evaluate(model, val_loader, device)
            if is_main:
                print(f"[QAT fake-quant] epoch {epoch}: Acc@1 {top1:.3f} Acc@5 {top5:.3f}")

        if is_main:
            # int8 check on CPU with a copy; the training model keeps its fake-quant modules
            quantized_eval_model = copy.deepcopy(model_without_ddp)
            quantized_eval_model.eval()
            quantized_eval_model.to(torch.device("cpu"))
            tq.convert(quantized_eval_model, inplace=True)
            cpu_loader = DataLoader(Subset(val_set, range(0, len(val_set), 25)), batch_size=32,
                                    num_workers=4)
            q1, q5 = evaluate(quantized_eval_model, cpu_loader, torch.device("cpu"),
                              distributed=False, max_batches=args.int8_eval_batches)
            print(f"[int8 {args.backend}] epoch {epoch}: Acc@1 {q1:.3f} Acc@5 {q5:.3f} (subset)")

            checkpoint = {
                "model": model_without_ddp.state_dict(),
                "eval_model": quantized_eval_model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "lr_scheduler": lr_scheduler.state_dict(),
                "epoch": epoch,
                "args": vars(args),
            }
            torch.save(checkpoint, os.path.join(args.output_dir, f"model_{epoch}.pth"))
            torch.save(checkpoint, os.path.join(args.output_dir, "checkpoint.pth"))
            if epoch == args.epochs - 1:
                scripted = torch.jit.script(quantized_eval_model)
                torch.jit.save(scripted, os.path.join(args.output_dir, "mobilenet_v2_int8.pt"))
        dist.barrier()

    if is_main:
        total = str(datetime.timedelta(seconds=int(time.time() - start)))
        print(f"Training time {total}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
