"""ImageNet distillation: ResNet-152 (torchvision V2 weights, 82.3%) -> MobileNetV3-Large.

Function-matching style KD: student and teacher see the same augmented batch, loss is
KL(teacher || student) at temperature T plus a small CE term. Tracked in Weights & Biases.

    torchrun --nproc_per_node=8 19_kd_mobilenetv3.py --data /mnt/imagenet --out /mnt/ckpt/mbv3_kd \
        --wandb-project compression --run-name mbv3l_kd_r152
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
import torchvision.transforms.v2 as T
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--wandb-project", default="compression")
    ap.add_argument("--run-name", default=None)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=128, help="per GPU")
    ap.add_argument("--lr", type=float, default=0.064, help="RMSprop lr for global batch 1024")
    ap.add_argument("--wd", type=float, default=1e-5)
    ap.add_argument("--T", type=float, default=1.0)
    ap.add_argument("--ce-weight", type=float, default=0.1)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--log-every", type=int, default=50)
    return ap.parse_args()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(x)
        s[0] += (out.argmax(1) == y).sum()
        s[1] += (out.topk(5, 1).indices == y[:, None]).any(1).sum()
        s[2] += y.numel()
    dist.all_reduce(s)
    return (100 * s[0] / s[2]).item(), (100 * s[1] / s[2]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args))

    train_tf = T.Compose([T.RandomResizedCrop(224, antialias=True), T.RandomHorizontalFlip(),
                          T.AutoAugment(T.AutoAugmentPolicy.IMAGENET), T.PILToTensor(),
                          T.ToDtype(torch.float32, scale=True),
                          T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    val_tf = T.Compose([T.Resize(256, antialias=True), T.CenterCrop(224), T.PILToTensor(),
                        T.ToDtype(torch.float32, scale=True),
                        T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    train_set = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = torchvision.datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=250,
                            num_workers=args.workers, pin_memory=True)

    teacher = torchvision.models.resnet152(weights="IMAGENET1K_V2").to(device).eval()
    teacher.requires_grad_(False)
    student = torchvision.models.mobilenet_v3_large(weights=None, dropout=0.2).to(device)
    student = DDP(student, device_ids=[local_rank])

    lr = args.lr * args.batch_size * world / 1024
    optimizer = torch.optim.RMSprop(student.parameters(), lr=lr, alpha=0.9, eps=0.0316, momentum=0.9,
                                    weight_decay=args.wd)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.973)
    scaler = torch.cuda.amp.GradScaler()
    ema = torch.optim.swa_utils.AveragedModel(
        student.module, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9999), use_buffers=True)

    start_epoch = 0
    ckpt_path = os.path.join(args.out, "last.pth")
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        student.module.load_state_dict(ck["student"])
        ema.load_state_dict(ck["ema"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        scaler.load_state_dict(ck["scaler"])
        start_epoch = ck["epoch"] + 1

    t_top1, _ = evaluate(teacher, val_loader, device)
    if is_main:
        os.makedirs(args.out, exist_ok=True)
        print(f"teacher top1 {t_top1:.2f}; student lr {lr:.4f} at global batch {args.batch_size * world}")
    wandb.log({"teacher/top1": t_top1}, step=start_epoch * len(train_loader))

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        student.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_loader):
            step = epoch * len(train_loader) + i
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                with torch.no_grad():
                    t_logits = teacher(x)
                s_logits = student(x)
            s_logits, t_logits = s_logits.float(), t_logits.float()
            kd = F.kl_div(F.log_softmax(s_logits / args.T, 1), F.log_softmax(t_logits / args.T, 1),
                          reduction="batchmean", log_target=True) * args.T ** 2
            ce = F.cross_entropy(s_logits, y)
            loss = kd + args.ce_weight * ce
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            ema.update_parameters(student.module)
            if i % args.log_every == 0:
                wandb.log({"train/loss": loss.item(), "train/kd": kd.item(), "train/ce": ce.item(),
                           "lr": optimizer.param_groups[0]["lr"]}, step=step)
        scheduler.step()

        top1, top5 = evaluate(student, val_loader, device)
        ema_top1, _ = evaluate(ema.module, val_loader, device)
        wandb.log({"val/top1": top1, "val/top5": top5, "val/ema_top1": ema_top1,
                   "epoch_time": time.time() - t0}, step=(epoch + 1) * len(train_loader))
        if is_main:
            print(f"epoch {epoch}: top1 {top1:.2f} top5 {top5:.2f} ema {ema_top1:.2f}")
            torch.save({"student": student.module.state_dict(), "ema": ema.state_dict(),
                        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch}, ckpt_path)

    if is_main:
        torch.save(ema.module.state_dict(), os.path.join(args.out, "mbv3l_kd_ema.pth"))
    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
