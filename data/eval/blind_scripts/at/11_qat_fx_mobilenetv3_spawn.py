"""
FX graph-mode QAT of MobileNetV3-Large for the x86 (qnnpack/x86) backend.
Starts from the FP32 torchvision checkpoint, trains with fake-quant for a few
epochs, then exports the int8 TorchScript model.

usage: python qat_fx_mbv3.py --data /data/imagenet --epochs 8
"""
import argparse
import copy
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.ao.quantization import get_default_qat_qconfig_mapping
from torch.ao.quantization.quantize_fx import convert_fx, prepare_qat_fx
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--backend", default="x86")
    ap.add_argument("--observer-off-epoch", type=int, default=3)
    ap.add_argument("--bn-freeze-epoch", type=int, default=2)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--master-port", default="29612")
    ap.add_argument("--save", default="ckpt/mbv3_qat_fx")
    return ap.parse_args()


def make_loaders(root, batch_size, workers, rank, world):
    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    tr = torchvision.datasets.ImageFolder(
        os.path.join(root, "train"),
        T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), norm]))
    va = torchvision.datasets.ImageFolder(
        os.path.join(root, "val"),
        T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm]))
    tr_s = DistributedSampler(tr, num_replicas=world, rank=rank, shuffle=True)
    va_s = DistributedSampler(va, num_replicas=world, rank=rank, shuffle=False)
    return (DataLoader(tr, batch_size, sampler=tr_s, num_workers=workers, pin_memory=True, drop_last=True),
            DataLoader(va, 128, sampler=va_s, num_workers=workers, pin_memory=True),
            tr_s)


def freeze_bn(m):
    if isinstance(m, torch.ao.nn.intrinsic.qat.ConvBn2d) or isinstance(
            m, (torch.ao.nn.intrinsic.qat.ConvBnReLU2d,)):
        m.freeze_bn_stats()


@torch.no_grad()
def accuracy(model, loader, device):
    model.eval()
    hits = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        hits[0] += (model(x).argmax(1) == y).sum()
        hits[1] += y.numel()
    dist.all_reduce(hits)
    return 100.0 * (hits[0] / hits[1]).item()


def train(rank, world_size, args):
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", args.master_port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)

    train_loader, val_loader, train_sampler = make_loaders(args.data, args.batch_size,
                                                           args.workers, rank, world_size)

    float_model = torchvision.models.mobilenet_v3_large(weights="IMAGENET1K_V1")
    float_model.train()
    qconfig_mapping = get_default_qat_qconfig_mapping(args.backend)
    example_inputs = (torch.randn(1, 3, 224, 224),)
    qat_model = prepare_qat_fx(float_model, qconfig_mapping, example_inputs)
    qat_model.to(device)
    model = DDP(qat_model, device_ids=[rank])

    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    if rank == 0:
        os.makedirs(args.save, exist_ok=True)
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        if epoch == args.bn_freeze_epoch:
            model.apply(freeze_bn)
        if epoch == args.observer_off_epoch:
            model.apply(torch.ao.quantization.disable_observer)
        model.train()
        t0 = time.time()
        for it, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0 and it % 250 == 0:
                print(f"[{epoch}] {it}/{len(train_loader)} loss={loss.item():.4f}", flush=True)
        sched.step()
        acc = accuracy(model, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: fake-quant top1 {acc:.2f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"epoch": epoch, "model": qat_model.state_dict(), "opt": opt.state_dict()},
                       os.path.join(args.save, "qat_last.pth"))

    if rank == 0:
        cpu_model = copy.deepcopy(qat_model).cpu().eval()
        int8 = convert_fx(cpu_model)
        scripted = torch.jit.script(int8)
        scripted.save(os.path.join(args.save, "mbv3_int8.pt"))
        x = torch.randn(1, 3, 224, 224)
        for _ in range(5):
            scripted(x)
        t0 = time.perf_counter()
        for _ in range(50):
            scripted(x)
        print(f"int8 latency: {(time.perf_counter() - t0) / 50 * 1e3:.2f} ms", flush=True)
    dist.barrier()
    dist.destroy_process_group()


args = parse_args()
world_size = torch.cuda.device_count()
print(f"spawning {world_size} QAT workers")
mp.spawn(train, args=(world_size, args), nprocs=world_size, join=True)
