"""
Distill the cloud scene classifier (EfficientNet-B4) into the on-camera
MobileNetV3-Small using mostly *unlabeled* fleet images.

Each step mixes:
  * a labeled batch   -> CE + KD
  * an unlabeled batch -> KD only on samples where the teacher is confident
    (max softmax >= --conf-thresh), to keep teacher noise out of the student.

    torchrun --nproc_per_node=8 10_unlabeled_conf_kd.py --labeled /data/scenes/labeled \
        --unlabeled /data/scenes/fleet_unlabeled --teacher weights/effb4_scenes.pth
"""
import argparse
import glob
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from torchvision.models import efficientnet_b4, mobilenet_v3_small


class UnlabeledFolder(Dataset):
    EXTS = (".jpg", ".jpeg", ".png")

    def __init__(self, root, transform):
        self.files = sorted(f for f in glob.glob(os.path.join(root, "**", "*"), recursive=True)
                            if f.lower().endswith(self.EXTS))
        self.transform = transform

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        return self.transform(Image.open(self.files[i]).convert("RGB"))


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--labeled", required=True)
    p.add_argument("--unlabeled", required=True)
    p.add_argument("--teacher", required=True)
    p.add_argument("--num-classes", type=int, default=24)
    p.add_argument("--steps", type=int, default=60000)
    p.add_argument("--bs-labeled", type=int, default=64)
    p.add_argument("--bs-unlabeled", type=int, default=192)
    p.add_argument("--lr", type=float, default=0.08)
    p.add_argument("--T", type=float, default=2.0)
    p.add_argument("--conf-thresh", type=float, default=0.7)
    p.add_argument("--unlabeled-weight", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=2000)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--out", default="exp/conf_kd_mnv3s")
    return p.parse_args()


def forever(loader, sampler):
    ep = 0
    while True:
        sampler.set_epoch(ep)
        yield from loader
        ep += 1


def soft_kl(s, t, T):
    return F.kl_div(F.log_softmax(s / T, 1), F.softmax(t / T, 1), reduction="batchmean") * T * T


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    c = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        c[0] += (model(x).argmax(1) == y).sum()
        c[1] += y.numel()
    dist.all_reduce(c)
    model.train()
    return (c[0] / c[1]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([transforms.RandomResizedCrop(224, scale=(0.35, 1)),
                                   transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), norm])
    test_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224),
                                  transforms.ToTensor(), norm])

    lab_ds = datasets.ImageFolder(os.path.join(args.labeled, "train"), train_tf)
    unl_ds = UnlabeledFolder(args.unlabeled, train_tf)
    val_ds = datasets.ImageFolder(os.path.join(args.labeled, "val"), test_tf)
    lab_sampler = DistributedSampler(lab_ds, shuffle=True, drop_last=True)
    unl_sampler = DistributedSampler(unl_ds, shuffle=True, drop_last=True)
    lab_loader = DataLoader(lab_ds, batch_size=args.bs_labeled, sampler=lab_sampler,
                            num_workers=args.workers // 2, pin_memory=True, drop_last=True)
    unl_loader = DataLoader(unl_ds, batch_size=args.bs_unlabeled, sampler=unl_sampler,
                            num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)),
                            batch_size=256, num_workers=4)

    teacher = efficientnet_b4(num_classes=args.num_classes)
    teacher.load_state_dict(torch.load(args.teacher, map_location="cpu"))
    teacher = teacher.to(dev).eval()
    teacher.requires_grad_(False)

    student = mobilenet_v3_small(weights="IMAGENET1K_V1")
    student.classifier[3] = torch.nn.Linear(student.classifier[3].in_features, args.num_classes)
    student = DDP(student.to(dev), device_ids=[local_rank])

    lr = args.lr * (args.bs_labeled + args.bs_unlabeled) * world / 512
    optim = torch.optim.SGD(student.parameters(), lr=lr, momentum=0.9, weight_decay=1e-5, nesterov=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(optim, max_lr=lr, total_steps=args.steps, pct_start=0.03)

    lab_iter = forever(lab_loader, lab_sampler)
    unl_iter = forever(unl_loader, unl_sampler)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best, tic = 0.0, time.time()
    kept_frac = torch.zeros(2, device=dev)
    student.train()
    for step in range(1, args.steps + 1):
        xl, yl = next(lab_iter)
        xu = next(unl_iter)
        xl, yl, xu = xl.to(dev, non_blocking=True), yl.to(dev, non_blocking=True), xu.to(dev, non_blocking=True)

        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            tl = teacher(xl).float()
            tu = teacher(xu).float()
        conf = tu.softmax(1).max(1).values
        keep = conf >= args.conf_thresh
        kept_frac += torch.stack([keep.sum().float(), torch.tensor(float(keep.numel()), device=dev)])
        if keep.sum() == 0:
            continue

        x = torch.cat([xl, xu[keep]])
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = student(x).float()
        sl, su = logits[: xl.size(0)], logits[xl.size(0):]
        loss_l = 0.5 * F.cross_entropy(sl, yl) + 0.5 * soft_kl(sl, tl, args.T)
        loss_u = soft_kl(su, tu[keep], args.T)
        loss = loss_l + args.unlabeled_weight * loss_u

        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        sched.step()

        if step % 100 == 0 and rank == 0:
            print(f"step {step} loss_l {loss_l.item():.4f} loss_u {loss_u.item():.4f} "
                  f"kept {keep.float().mean().item():.2f} {time.time() - tic:.0f}s", flush=True)

        if step % args.eval_every == 0:
            acc = evaluate(student.module, val_loader, dev)
            dist.all_reduce(kept_frac)
            if rank == 0:
                print(f"[eval] step {step} acc {acc * 100:.2f} "
                      f"teacher-confident fraction {(kept_frac[0] / kept_frac[1]).item():.3f}", flush=True)
                torch.save({"step": step, "model": student.module.state_dict(),
                            "optim": optim.state_dict(), "sched": sched.state_dict()},
                           os.path.join(args.out, "last.pt"))
                if acc > best:
                    best = acc
                    torch.save(student.module.state_dict(), os.path.join(args.out, "best.pt"))
            kept_frac.zero_()
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
