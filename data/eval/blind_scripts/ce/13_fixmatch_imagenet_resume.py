"""FixMatch on ImageNet with the 10% labelled split (SimCLR subset file), ResNet-50.

Preemptible cluster: the job is restarted with the same command and picks up the last checkpoint.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29400 \
        13_fixmatch_imagenet_resume.py --imagenet /shared/imagenet --subset splits/10percent.txt \
        --out /shared/ckpt/fixmatch_in10 --resume auto
"""
import argparse
import glob
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms
from torchvision.datasets import ImageFolder


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--imagenet", default="/shared/imagenet")
    p.add_argument("--subset", default="splits/10percent.txt")
    p.add_argument("--out", default="/shared/ckpt/fixmatch_in10")
    p.add_argument("--resume", default="auto")
    p.add_argument("--epochs", type=int, default=100, help="epochs over the unlabelled set")
    p.add_argument("--batch-size", type=int, default=32, help="labelled per GPU")
    p.add_argument("--mu", type=int, default=5)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--wd", type=float, default=3e-4)
    p.add_argument("--threshold", type=float, default=0.7)
    p.add_argument("--ema", type=float, default=0.999)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--save-freq", type=int, default=1)
    return p.parse_args()


class PairView(Dataset):
    def __init__(self, folder, weak, strong):
        self.folder, self.weak, self.strong = folder, weak, strong

    def __len__(self):
        return len(self.folder)

    def __getitem__(self, i):
        path, _ = self.folder.samples[i]
        img = self.folder.loader(path)
        return self.weak(img), self.strong(img)


def labelled_subset(folder, subset_file):
    with open(subset_file) as f:
        names = {line.strip() for line in f if line.strip()}
    keep = [i for i, (p, _) in enumerate(folder.samples) if os.path.basename(p) in names]
    return torch.utils.data.Subset(folder, keep)


def find_checkpoint(out, resume):
    if resume != "auto":
        return resume or None
    ckpts = sorted(glob.glob(os.path.join(out, "ckpt_ep*.pth")))
    return ckpts[-1] if ckpts else None


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    weak = transforms.Compose([transforms.RandomResizedCrop(224, scale=(0.2, 1.0)), transforms.RandomHorizontalFlip(),
                               transforms.ToTensor(), norm])
    strong = transforms.Compose([transforms.RandomResizedCrop(224, scale=(0.2, 1.0)), transforms.RandomHorizontalFlip(),
                                 transforms.RandAugment(2, 10), transforms.ToTensor(), norm])
    val_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), norm])

    train_dir = os.path.join(args.imagenet, "train")
    lab_set = labelled_subset(ImageFolder(train_dir, transform=weak), args.subset)
    unl_set = PairView(ImageFolder(train_dir), weak, strong)
    val_set = ImageFolder(os.path.join(args.imagenet, "val"), transform=val_tf)

    lab_sampler = DistributedSampler(lab_set, shuffle=True, drop_last=True)
    unl_sampler = DistributedSampler(unl_set, shuffle=True, drop_last=True)
    lab_loader = DataLoader(lab_set, args.batch_size, sampler=lab_sampler, num_workers=args.workers // 3,
                            pin_memory=True, drop_last=True, persistent_workers=True)
    unl_loader = DataLoader(unl_set, args.batch_size * args.mu, sampler=unl_sampler, num_workers=args.workers,
                            pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, 200, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=args.workers, pin_memory=True)

    model = models.resnet50(num_classes=1000)
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    ema_model = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(args.ema), use_buffers=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.wd, nesterov=True)
    iters_per_epoch = len(unl_loader)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * iters_per_epoch)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch = 0
    ckpt_path = find_checkpoint(args.out, args.resume)
    if ckpt_path is not None:
        ckpt = torch.load(ckpt_path)
        model.load_state_dict(ckpt["model"])
        ema_model.load_state_dict(ckpt["ema"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"]
        if rank == 0:
            print(f"resumed from {ckpt_path} (epoch {start_epoch})", flush=True)
    model = DDP(model, device_ids=[local_rank])

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    lab_epoch = start_epoch
    for epoch in range(start_epoch, args.epochs):
        unl_sampler.set_epoch(epoch)
        lab_sampler.set_epoch(lab_epoch)
        lab_iter = iter(lab_loader)
        model.train()
        t0 = time.time()
        for i, (uw, us) in enumerate(unl_loader):
            try:
                x, y = next(lab_iter)
            except StopIteration:
                lab_epoch += 1
                lab_sampler.set_epoch(lab_epoch)
                lab_iter = iter(lab_loader)
                x, y = next(lab_iter)
            n = x.size(0)
            inputs = torch.cat([x, uw, us]).to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(inputs)
                lx = F.cross_entropy(logits[:n], y)
                lw, ls = logits[n:].chunk(2)
                conf, pl = lw.detach().float().softmax(1).max(1)
                mask = conf.ge(args.threshold).float()
                lu = (F.cross_entropy(ls, pl, reduction="none") * mask).mean()
                loss = lx + lu
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            ema_model.update_parameters(model.module)
            if rank == 0 and i % 100 == 0:
                print(f"ep {epoch} [{i}/{iters_per_epoch}] lx {lx.item():.3f} lu {lu.item():.3f} "
                      f"mask {mask.mean().item():.2f} lr {scheduler.get_last_lr()[0]:.4f} "
                      f"{(time.time() - t0) / (i + 1):.2f}s/it", flush=True)

        ema_model.eval()
        top = torch.zeros(3, device=device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            for xv, yv in val_loader:
                xv, yv = xv.to(device, non_blocking=True), yv.to(device, non_blocking=True)
                out = ema_model(xv)
                top5 = out.topk(5, 1).indices
                top[0] += (top5[:, 0] == yv).sum()
                top[1] += (top5 == yv[:, None]).any(1).sum()
                top[2] += yv.numel()
        dist.all_reduce(top)
        if rank == 0:
            print(f"epoch {epoch} EMA top1 {100 * top[0] / top[2]:.2f} top5 {100 * top[1] / top[2]:.2f}", flush=True)
            if (epoch + 1) % args.save_freq == 0:
                torch.save({"epoch": epoch + 1, "model": model.module.state_dict(), "ema": ema_model.state_dict(),
                            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                            "scaler": scaler.state_dict()},
                           os.path.join(args.out, f"ckpt_ep{epoch + 1:03d}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
