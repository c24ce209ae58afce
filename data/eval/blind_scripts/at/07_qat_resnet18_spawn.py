"""
Quantization-aware training (eager mode, fbgemm) of a quantizable ResNet-18,
started from FP32 ImageNet weights. Observers are frozen after a few epochs and
BatchNorm statistics a bit later; the int8 model is converted on CPU and its
accuracy / latency are reported after every epoch.

    python qat_r18.py --data /data/imagenet --gpus 8
"""
import argparse
import copy
import os
import time

import torch
import torch.ao.quantization as tq
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.quantization import resnet18 as q_resnet18


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--freeze-observer-epoch", type=int, default=4)
    p.add_argument("--freeze-bn-epoch", type=int, default=3)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--eval-cpu-images", type=int, default=5000)
    p.add_argument("--port", type=str, default="29533")
    p.add_argument("--out", default="checkpoints/qat_r18")
    return p.parse_args()


def datasets(root):
    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train = torchvision.datasets.ImageFolder(
        os.path.join(root, "train"),
        T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), norm]))
    val = torchvision.datasets.ImageFolder(
        os.path.join(root, "val"), T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm]))
    return train, val


@torch.no_grad()
def eval_gpu(model, loader, device):
    model.eval()
    c = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        c[0] += (model(x).argmax(1) == y).sum()
        c[1] += y.numel()
    dist.all_reduce(c)
    return (100 * c[0] / c[1]).item()


@torch.no_grad()
def eval_int8_cpu(qat_module, val_set, n_images):
    int8 = copy.deepcopy(qat_module).cpu().eval()
    int8 = tq.convert(int8, inplace=False)
    loader = DataLoader(Subset(val_set, range(0, len(val_set), max(1, len(val_set) // n_images))),
                        batch_size=50, num_workers=4)
    correct = total = 0
    t0 = time.perf_counter()
    for x, y in loader:
        correct += (int8(x).argmax(1) == y).sum().item()
        total += y.numel()
    ms_per_img = (time.perf_counter() - t0) / total * 1e3
    return 100.0 * correct / total, ms_per_img, int8


def worker(rank, world_size, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = args.port
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)

    train_set, val_set = datasets(args.data)
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    val_sampler = DistributedSampler(val_set, num_replicas=world_size, rank=rank, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=128, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    torch.backends.quantized.engine = "fbgemm"
    model = q_resnet18(weights="IMAGENET1K_V1", quantize=False)
    model.fuse_model(is_qat=True)
    model.qconfig = tq.get_default_qat_qconfig("fbgemm")
    tq.prepare_qat(model, inplace=True)
    model.to(device)
    model = DDP(model, device_ids=[rank])

    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.1)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        if epoch >= args.freeze_observer_epoch:
            model.apply(tq.disable_observer)
        if epoch >= args.freeze_bn_epoch:
            model.apply(torch.ao.nn.intrinsic.qat.freeze_bn_stats)

        model.train()
        seen = torch.zeros(2, device=device)
        t0 = time.time()
        for i, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            out = model(x)
            loss = F.cross_entropy(out, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            seen[0] += loss.detach() * y.numel()
            seen[1] += y.numel()
            if rank == 0 and i % 500 == 0:
                print(f"epoch {epoch} iter {i}/{len(train_loader)} loss {loss.item():.4f}", flush=True)
        scheduler.step()
        dist.all_reduce(seen)

        fq_acc = eval_gpu(model, val_loader, device)
        if rank == 0:
            int8_acc, ms, int8_model = eval_int8_cpu(model.module, val_set, args.eval_cpu_images)
            print(f"epoch {epoch}: train loss {(seen[0] / seen[1]).item():.4f} | fake-quant top1 {fq_acc:.2f} "
                  f"| int8 cpu top1 {int8_acc:.2f} ({ms:.2f} ms/img) | {time.time() - t0:.0f}s", flush=True)
            torch.save({"epoch": epoch, "qat_state": model.module.state_dict(),
                        "optimizer": optimizer.state_dict()}, os.path.join(args.out, "qat_last.pth"))
            torch.jit.save(torch.jit.script(int8_model), os.path.join(args.out, f"int8_ep{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


def main():
    args = parse_args()
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
