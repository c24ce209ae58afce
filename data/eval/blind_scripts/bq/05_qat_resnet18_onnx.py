"""QAT fine-tuning of ResNet-18 and export of the fake-quantized model to ONNX (QDQ)
for TensorRT int8 deployment.

    torchrun --standalone --nproc_per_node=4 05_qat_resnet18_onnx.py \
        --data /data/imagenet --ckpt-dir /data/ckpt/qat_r18 --epochs 8
"""
import argparse
import os
import time

import torch
import torch.ao.nn.intrinsic.qat as nniqat
import torch.ao.quantization as tq
import torch.distributed as dist
import torch.nn as nn
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.quantization import resnet18 as q_resnet18


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--lr", type=float, default=4e-4)
    p.add_argument("--freeze-observer-epoch", type=int, default=4)
    p.add_argument("--freeze-bn-epoch", type=int, default=3)
    p.add_argument("--opset", type=int, default=13)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


def qat_qconfig():
    # per-channel symmetric weights, per-tensor symmetric activations (TensorRT friendly)
    act = tq.FakeQuantize.with_args(
        observer=tq.MovingAverageMinMaxObserver, quant_min=-128, quant_max=127,
        dtype=torch.qint8, qscheme=torch.per_tensor_symmetric, reduce_range=False)
    wt = tq.FakeQuantize.with_args(
        observer=tq.MovingAveragePerChannelMinMaxObserver, quant_min=-128, quant_max=127,
        dtype=torch.qint8, qscheme=torch.per_channel_symmetric, reduce_range=False, ch_axis=0)
    return tq.QConfig(activation=act, weight=wt)


def build_qat_model(pretrained=True):
    model = q_resnet18(weights="IMAGENET1K_V1" if pretrained else None, quantize=False)
    model.train()
    model.fuse_model(is_qat=True)
    model.qconfig = qat_qconfig()
    tq.prepare_qat(model, inplace=True)
    return model


def loaders(args, rank, world):
    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    tr = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), T.Compose(
        [T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), norm]))
    va = torchvision.datasets.ImageFolder(os.path.join(args.data, "val"), T.Compose(
        [T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm]))
    sampler = DistributedSampler(tr)
    tr_dl = DataLoader(tr, args.batch_size, sampler=sampler, num_workers=args.workers,
                       pin_memory=True, drop_last=True)
    va_dl = DataLoader(Subset(va, range(rank, len(va), world)), 200, num_workers=args.workers,
                       pin_memory=True)
    return tr_dl, sampler, va_dl


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    correct = torch.zeros((), device=device)
    seen = torch.zeros((), device=device)
    for images, labels in loader:
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        correct += (model(images).argmax(1) == labels).sum()
        seen += labels.numel()
    dist.all_reduce(correct)
    dist.all_reduce(seen)
    return (100.0 * correct / seen).item()


def export_onnx(ckpt_path, out_path, opset):
    model = build_qat_model(pretrained=False)
    state = torch.load(ckpt_path, map_location="cpu")
    model.load_state_dict(state["model"])
    model.apply(tq.disable_observer)
    model.eval()
    dummy = torch.randn(1, 3, 224, 224)
    torch.onnx.export(
        model, dummy, out_path, opset_version=opset,
        input_names=["input"], output_names=["logits"],
        dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
        do_constant_folding=True,
    )
    print(f"exported {out_path}")


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    tr_dl, sampler, va_dl = loaders(args, rank, world)
    model = build_qat_model().to(device)
    model = DDP(model, device_ids=[local_rank])

    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * world, momentum=0.9, weight_decay=1e-5)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(tr_dl))

    last = os.path.join(args.ckpt_dir, "last.pt")
    best = os.path.join(args.ckpt_dir, "best.pt")
    start_epoch, best_acc = 0, 0.0
    if os.path.isfile(last):
        state = torch.load(last, map_location="cpu")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch, best_acc = state["epoch"] + 1, state["best_acc"]
        if rank == 0:
            print(f"resumed from epoch {state['epoch']}")

    for epoch in range(start_epoch, args.epochs):
        if epoch >= args.freeze_observer_epoch:
            model.apply(tq.disable_observer)
        if epoch >= args.freeze_bn_epoch:
            model.apply(nniqat.freeze_bn_stats)

        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for it, (images, labels) in enumerate(tr_dl):
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            loss = criterion(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if rank == 0 and it % 100 == 0:
                print(f"[{epoch}:{it}/{len(tr_dl)}] loss={loss.item():.4f} ({time.time() - tic:.0f}s)")

        acc = validate(model, va_dl, device)
        if rank == 0:
            print(f"epoch {epoch}: fake-quant top-1 {acc:.2f}")
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch,
                     "best_acc": max(acc, best_acc)}
            torch.save(state, last)
            if acc > best_acc:
                torch.save(state, best)
        best_acc = max(acc, best_acc)
        dist.barrier()

    if rank == 0:
        export_onnx(best, os.path.join(args.ckpt_dir, "resnet18_qat_qdq.onnx"), args.opset)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
