# Quantization-aware training of MobileNetV2 with logit distillation from a float
# ResNet-50 teacher. Produces a TorchScript int8 model (fbgemm / qnnpack) for the
# edge runtime.
#
#   torchrun --nproc_per_node=4 02_qat_mobilenet_kd.py --data /data/imagenet \
#       --float-ckpt weights/mbv2_float.pth --teacher-ckpt weights/r50.pth
import argparse
import copy
import datetime
import os

import torch
import torch.ao.quantization as tq
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from torchvision.models import resnet50
from torchvision.models.quantization import mobilenet_v2 as q_mobilenet_v2


def get_args():
    parser = argparse.ArgumentParser("QAT + KD")
    parser.add_argument("--data", required=True)
    parser.add_argument("--float-ckpt", required=True)
    parser.add_argument("--teacher-ckpt", required=True)
    parser.add_argument("--backend", default="qnnpack", choices=["fbgemm", "qnnpack"])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--accum-steps", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--T", type=float, default=2.0)
    parser.add_argument("--kd-weight", type=float, default=0.7)
    parser.add_argument("--num-observer-update-epochs", type=int, default=4)
    parser.add_argument("--num-batch-norm-update-epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=10)
    parser.add_argument("--output-dir", default="out/qat_mbv2")
    parser.add_argument("--resume", default="")
    parser.add_argument("--int8-eval-batches", type=int, default=20)
    return parser.parse_args()


def build_loaders(args, rank, world_size):
    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        normalize,
    ])
    val_tf = transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), normalize,
    ])
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    train_sampler = DistributedSampler(train_set)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    # each rank gets a disjoint, unpadded slice of the validation set
    val_shard = Subset(val_set, range(rank, len(val_set), world_size))
    val_loader = DataLoader(val_shard, batch_size=128, num_workers=args.workers, pin_memory=True)
    return train_loader, train_sampler, val_loader


@torch.no_grad()
def evaluate(model, loader, device, max_batches=None):
    model.eval()
    correct = torch.zeros((), device=device)
    seen = torch.zeros((), device=device)
    for i, (x, y) in enumerate(loader):
        if max_batches is not None and i >= max_batches:
            break
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        pred = model(x).argmax(dim=1)
        correct += (pred == y).sum()
        seen += y.numel()
    return correct, seen


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", timeout=datetime.timedelta(minutes=60))
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    is_main = rank == 0

    torch.backends.quantized.engine = args.backend
    train_loader, train_sampler, val_loader = build_loaders(args, rank, world_size)

    # frozen float teacher, one copy per GPU, never wrapped in DDP
    teacher = resnet50()
    teacher.load_state_dict(torch.load(args.teacher_ckpt, map_location="cpu"))
    teacher = teacher.to(device).eval()
    teacher.requires_grad_(False)

    # student: float weights -> fuse -> fake-quant modules
    student = q_mobilenet_v2(weights=None, quantize=False)
    student.load_state_dict(torch.load(args.float_ckpt, map_location="cpu"))
    student.fuse_model(is_qat=True)
    student.qconfig = tq.get_default_qat_qconfig(args.backend)
    student.train()
    tq.prepare_qat(student, inplace=True)
    student.to(device)

    # observers / fake-quant buffers are broadcast from rank 0 on every forward
    student = DDP(student, device_ids=[local_rank])
    student_without_ddp = student.module

    optimizer = torch.optim.SGD(student.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-5)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.1)
    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        student_without_ddp.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["lr_scheduler"])
        start_epoch = ckpt["epoch"] + 1

    if is_main:
        os.makedirs(args.output_dir, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        student.train()
        if epoch >= args.num_observer_update_epochs:
            student_without_ddp.apply(tq.disable_observer)
        if epoch >= args.num_batch_norm_update_epochs:
            student_without_ddp.apply(torch.nn.intrinsic.qat.freeze_bn_stats)

        optimizer.zero_grad(set_to_none=True)
        running = torch.zeros(2, device=device)
        for it, (images, target) in enumerate(train_loader):
            images = images.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            with torch.no_grad():
                t_logits = teacher(images)

            sync_now = (it + 1) % args.accum_steps == 0
            ctx = student.no_sync() if not sync_now else torch.enable_grad()
            with ctx:
                s_logits = student(images)
                kd = F.kl_div(F.log_softmax(s_logits / args.T, dim=1),
                              F.softmax(t_logits / args.T, dim=1),
                              reduction="batchmean") * args.T ** 2
                ce = F.cross_entropy(s_logits, target)
                loss = args.kd_weight * kd + (1 - args.kd_weight) * ce
                (loss / args.accum_steps).backward()
            if sync_now:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            running[0] += loss.detach()
            running[1] += 1
            if is_main and it % 100 == 0:
                print(f"[{epoch}][{it}/{len(train_loader)}] loss={loss.item():.4f} "
                      f"kd={kd.item():.4f} ce={ce.item():.4f}", flush=True)
        scheduler.step()
        dist.all_reduce(running)

        # fake-quant accuracy of the QAT graph, on every rank's shard
        correct, seen = evaluate(student_without_ddp, val_loader, device)
        stats = torch.stack([correct, seen])
        dist.all_reduce(stats)
        acc = (stats[0] / stats[1]).item() * 100
        if is_main:
            print(f"epoch {epoch}: train loss {(running[0] / running[1]).item():.4f} "
                  f"QAT top1 {acc:.2f}", flush=True)
            torch.save({
                "model": student_without_ddp.state_dict(),
                "optimizer": optimizer.state_dict(),
                "lr_scheduler": scheduler.state_dict(),
                "epoch": epoch,
            }, os.path.join(args.output_dir, "checkpoint.pth"))

            # int8 conversion is CPU-only and touches no process group
            q_model = copy.deepcopy(student_without_ddp).cpu().eval()
            q_model = tq.convert(q_model, inplace=False)
            c8, n8 = evaluate(q_model, val_loader, torch.device("cpu"), args.int8_eval_batches)
            print(f"epoch {epoch}: int8 top1 (first {args.int8_eval_batches} batches) "
                  f"{(c8 / n8).item() * 100:.2f}", flush=True)
            scripted = torch.jit.script(q_model)
            torch.jit.save(scripted, os.path.join(args.output_dir, f"mbv2_int8_ep{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
