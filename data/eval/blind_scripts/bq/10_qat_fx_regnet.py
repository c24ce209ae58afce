"""FX graph mode QAT for RegNetY-800MF (x86 backend), with early stopping on validation top-1.

The model is traced with prepare_qat_fx, fine-tuned with DDP, and the best epoch
is converted with convert_fx and saved as TorchScript for CPU serving.

    torchrun --nproc_per_node=8 10_qat_fx_regnet.py --data /datasets/imagenet --out qat_regnet
"""
import argparse
import copy
import os
import time

import torch
import torch.ao.nn.intrinsic.qat as nniqat
import torch.ao.quantization as tq
import torch.distributed as dist
import torch.nn as nn
import torchvision
import torchvision.transforms as T
from torch.ao.quantization import get_default_qat_qconfig_mapping
from torch.ao.quantization.quantize_fx import convert_fx, prepare_qat_fx
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="qat_regnet")
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--patience", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-4, help="for global batch 512")
    p.add_argument("--observer-epochs", type=int, default=5)
    p.add_argument("--bn-epochs", type=int, default=4)
    p.add_argument("--workers", type=int, default=10)
    return p.parse_args()


def data(args):
    norm = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train = torchvision.datasets.ImageFolder(
        os.path.join(args.data, "train"),
        T.Compose([T.RandomResizedCrop(224, antialias=True), T.RandomHorizontalFlip(), T.ToTensor(), norm]))
    val = torchvision.datasets.ImageFolder(
        os.path.join(args.data, "val"),
        T.Compose([T.Resize(232, antialias=True), T.CenterCrop(224), T.ToTensor(), norm]))
    train_sampler = DistributedSampler(train)
    val_sampler = DistributedSampler(val, shuffle=False)
    train_loader = DataLoader(train, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val, batch_size=200, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)
    return train_loader, train_sampler, val_loader


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    correct = total = 0
    loss_sum = 0.0
    for images, target in loader:
        images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
        out = model(images)
        loss_sum += nn.functional.cross_entropy(out, target, reduction="sum").item()
        correct += (out.argmax(1) == target).sum().item()
        total += target.size(0)
    return 100.0 * correct / total, loss_sum / total


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    train_loader, train_sampler, val_loader = data(args)

    float_model = torchvision.models.regnet_y_800mf(weights="IMAGENET1K_V2")
    float_model.train()
    qconfig_mapping = get_default_qat_qconfig_mapping("x86")
    example_inputs = (torch.randn(1, 3, 224, 224),)
    model = prepare_qat_fx(float_model, qconfig_mapping, example_inputs)
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = args.lr * args.batch_size * world / 512
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=4e-5)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    best_top1, bad_epochs = 0.0, 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        if epoch >= args.observer_epochs:
            model.apply(tq.disable_observer)
        if epoch >= args.bn_epochs:
            model.apply(nniqat.freeze_bn_stats)

        model.train()
        t0 = time.time()
        for i, (images, target) in enumerate(train_loader):
            images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
            loss = criterion(model(images), target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if rank == 0 and i % 200 == 0:
                print(f"epoch {epoch} iter {i}/{len(train_loader)} loss {loss.item():.4f}")
        scheduler.step()

        top1, val_loss = validate(model, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: val top1 {top1:.2f} loss {val_loss:.4f} ({time.time() - t0:.0f}s)")

        if top1 > best_top1:
            best_top1, bad_epochs = top1, 0
            if rank == 0:
                torch.save(model.module.state_dict(), os.path.join(args.out, "best_qat.pth"))
        else:
            bad_epochs += 1
        stop = torch.tensor([1.0 if bad_epochs >= args.patience else 0.0], device=device)
        dist.broadcast(stop, src=0)
        if stop.item() > 0:
            if rank == 0:
                print(f"no improvement for {args.patience} epochs, stopping")
            break

    dist.barrier()
    if rank == 0:
        qat_model = copy.deepcopy(model.module)
        qat_model.load_state_dict(torch.load(os.path.join(args.out, "best_qat.pth"), map_location="cpu"))
        qat_model = qat_model.cpu().eval()
        int8_model = convert_fx(qat_model)
        scripted = torch.jit.script(int8_model)
        torch.jit.save(scripted, os.path.join(args.out, "regnet_y_800mf_int8.pt"))
        print(f"best QAT top1 {best_top1:.2f}; int8 TorchScript saved")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
