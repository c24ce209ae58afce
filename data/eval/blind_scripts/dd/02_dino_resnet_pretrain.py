"""DINO self-distillation with a ResNet-50 backbone (multi-crop, LARS)."""
import argparse
import json
import math
import os
import random
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import ImageFilter, ImageOps
from torchvision import datasets, models, transforms


def parse_args():
    parser = argparse.ArgumentParser("DINO-ResNet")
    parser.add_argument("--data_path", default="/data/imagenet/train", type=str)
    parser.add_argument("--output_dir", default="./dino_rn50", type=str)
    parser.add_argument("--out_dim", default=60000, type=int)
    parser.add_argument("--use_bn_in_head", default=True, type=bool)
    parser.add_argument("--momentum_teacher", default=0.996, type=float)
    parser.add_argument("--warmup_teacher_temp", default=0.04, type=float)
    parser.add_argument("--teacher_temp", default=0.07, type=float)
    parser.add_argument("--warmup_teacher_temp_epochs", default=50, type=int)
    parser.add_argument("--batch_size_per_gpu", default=51, type=int)
    parser.add_argument("--epochs", default=800, type=int)
    parser.add_argument("--lr", default=0.3, type=float)
    parser.add_argument("--min_lr", default=0.0048, type=float)
    parser.add_argument("--warmup_epochs", default=10, type=int)
    parser.add_argument("--weight_decay", default=1e-6, type=float)
    parser.add_argument("--global_crops_scale", type=float, nargs="+", default=(0.14, 1.0))
    parser.add_argument("--local_crops_number", type=int, default=6)
    parser.add_argument("--local_crops_scale", type=float, nargs="+", default=(0.05, 0.14))
    parser.add_argument("--num_workers", default=10, type=int)
    parser.add_argument("--saveckp_freq", default=20, type=int)
    parser.add_argument("--seed", default=0, type=int)
    return parser.parse_args()


class GaussianBlur:
    def __init__(self, p=0.5, radius_min=0.1, radius_max=2.0):
        self.prob, self.radius_min, self.radius_max = p, radius_min, radius_max

    def __call__(self, img):
        if random.random() > self.prob:
            return img
        return img.filter(ImageFilter.GaussianBlur(radius=random.uniform(self.radius_min, self.radius_max)))


class Solarization:
    def __init__(self, p):
        self.p = p

    def __call__(self, img):
        return ImageOps.solarize(img) if random.random() < self.p else img


class DataAugmentationDINO:
    def __init__(self, global_crops_scale, local_crops_scale, local_crops_number):
        flip_and_color = transforms.Compose([
            transforms.RandomHorizontalFlip(p=0.5),
            transforms.RandomApply([transforms.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
            transforms.RandomGrayscale(p=0.2),
        ])
        normalize = transforms.Compose([
            transforms.ToTensor(),
            transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
        ])
        self.global1 = transforms.Compose([
            transforms.RandomResizedCrop(224, scale=global_crops_scale, interpolation=transforms.InterpolationMode.BICUBIC),
            flip_and_color, GaussianBlur(1.0), normalize])
        self.global2 = transforms.Compose([
            transforms.RandomResizedCrop(224, scale=global_crops_scale, interpolation=transforms.InterpolationMode.BICUBIC),
            flip_and_color, GaussianBlur(0.1), Solarization(0.2), normalize])
        self.local_crops_number = local_crops_number
        self.local = transforms.Compose([
            transforms.RandomResizedCrop(96, scale=local_crops_scale, interpolation=transforms.InterpolationMode.BICUBIC),
            flip_and_color, GaussianBlur(p=0.5), normalize])

    def __call__(self, image):
        crops = [self.global1(image), self.global2(image)]
        crops += [self.local(image) for _ in range(self.local_crops_number)]
        return crops


class DINOHead(nn.Module):
    def __init__(self, in_dim, out_dim, use_bn=False, hidden_dim=2048, bottleneck_dim=256):
        super().__init__()
        layers = [nn.Linear(in_dim, hidden_dim)]
        if use_bn:
            layers.append(nn.BatchNorm1d(hidden_dim))
        layers.append(nn.GELU())
        layers.append(nn.Linear(hidden_dim, hidden_dim))
        if use_bn:
            layers.append(nn.BatchNorm1d(hidden_dim))
        layers.append(nn.GELU())
        layers.append(nn.Linear(hidden_dim, bottleneck_dim))
        self.mlp = nn.Sequential(*layers)
        self.last_layer = nn.utils.weight_norm(nn.Linear(bottleneck_dim, out_dim, bias=False))
        self.last_layer.weight_g.data.fill_(1)
        self.last_layer.weight_g.requires_grad = False

    def forward(self, x):
        x = self.mlp(x)
        x = F.normalize(x, dim=-1, p=2)
        return self.last_layer(x)


class MultiCropWrapper(nn.Module):
    def __init__(self, backbone, head):
        super().__init__()
        backbone.fc = nn.Identity()
        self.backbone, self.head = backbone, head

    def forward(self, x):
        if not isinstance(x, list):
            x = [x]
        idx_crops = torch.cumsum(torch.unique_consecutive(
            torch.tensor([inp.shape[-1] for inp in x]), return_counts=True)[1], 0)
        start_idx, output = 0, []
        for end_idx in idx_crops:
            output.append(self.backbone(torch.cat(x[start_idx:end_idx])))
            start_idx = end_idx
        return self.head(torch.cat(output))


class DINOLoss(nn.Module):
    def __init__(self, out_dim, ncrops, warmup_teacher_temp, teacher_temp, warmup_epochs, nepochs,
                 student_temp=0.1, center_momentum=0.9):
        super().__init__()
        self.student_temp, self.center_momentum, self.ncrops = student_temp, center_momentum, ncrops
        self.register_buffer("center", torch.zeros(1, out_dim))
        self.teacher_temp_schedule = np.concatenate((
            np.linspace(warmup_teacher_temp, teacher_temp, warmup_epochs),
            np.ones(nepochs - warmup_epochs) * teacher_temp))

    def forward(self, student_output, teacher_output, epoch):
        student_out = (student_output / self.student_temp).chunk(self.ncrops)
        temp = self.teacher_temp_schedule[epoch]
        teacher_out = F.softmax((teacher_output - self.center) / temp, dim=-1).detach().chunk(2)
        total_loss, n_terms = 0, 0
        for iq, q in enumerate(teacher_out):
            for v in range(len(student_out)):
                if v == iq:
                    continue
                total_loss += torch.sum(-q * F.log_softmax(student_out[v], dim=-1), dim=-1).mean()
                n_terms += 1
        self.update_center(teacher_output)
        return total_loss / n_terms

    @torch.no_grad()
    def update_center(self, teacher_output):
        batch_center = torch.sum(teacher_output, dim=0, keepdim=True)
        dist.all_reduce(batch_center)
        batch_center = batch_center / (len(teacher_output) * dist.get_world_size())
        self.center = self.center * self.center_momentum + batch_center * (1 - self.center_momentum)


class LARS(torch.optim.Optimizer):
    """LARS without adaptation/decay for biases and norm parameters (ndim == 1)."""

    def __init__(self, params, lr=0, weight_decay=0, momentum=0.9, eta=0.001):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, eta=eta))

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                dp = p.grad
                if dp is None:
                    continue
                if p.ndim != 1:
                    dp = dp.add(p, alpha=g["weight_decay"])
                    param_norm, update_norm = torch.norm(p), torch.norm(dp)
                    one = torch.ones_like(param_norm)
                    q = torch.where(param_norm > 0.0,
                                    torch.where(update_norm > 0, (g["eta"] * param_norm / update_norm), one), one)
                    dp = dp.mul(q)
                state = self.state[p]
                if "mu" not in state:
                    state["mu"] = torch.zeros_like(p)
                mu = state["mu"]
                mu.mul_(g["momentum"]).add_(dp)
                p.add_(mu, alpha=-g["lr"])


def cosine_scheduler(base, final, epochs, niter_per_ep, warmup_epochs=0, start_warmup_value=0):
    warmup = np.array([])
    warmup_iters = warmup_epochs * niter_per_ep
    if warmup_epochs > 0:
        warmup = np.linspace(start_warmup_value, base, warmup_iters)
    iters = np.arange(epochs * niter_per_ep - warmup_iters)
    schedule = final + 0.5 * (base - final) * (1 + np.cos(np.pi * iters / len(iters)))
    return np.concatenate((warmup, schedule))


def main():
    args = parse_args()
    gpu = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    torch.backends.cudnn.benchmark = True

    transform = DataAugmentationDINO(args.global_crops_scale, args.local_crops_scale, args.local_crops_number)
    dataset = datasets.ImageFolder(args.data_path, transform=transform)
    sampler = torch.utils.data.DistributedSampler(dataset, shuffle=True)
    data_loader = torch.utils.data.DataLoader(dataset, sampler=sampler, batch_size=args.batch_size_per_gpu,
                                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    if rank == 0:
        print(f"Data loaded: there are {len(dataset)} images.")

    student = MultiCropWrapper(models.resnet50(), DINOHead(2048, args.out_dim, use_bn=args.use_bn_in_head))
    teacher = MultiCropWrapper(models.resnet50(), DINOHead(2048, args.out_dim, use_bn=args.use_bn_in_head))
    student, teacher = student.cuda(), teacher.cuda()
    student = nn.parallel.DistributedDataParallel(student, device_ids=[gpu])
    teacher_without_ddp = teacher
    teacher_without_ddp.load_state_dict(student.module.state_dict())
    for p in teacher.parameters():
        p.requires_grad = False

    dino_loss = DINOLoss(args.out_dim, args.local_crops_number + 2, args.warmup_teacher_temp, args.teacher_temp,
                         args.warmup_teacher_temp_epochs, args.epochs).cuda()

    regularized, not_regularized = [], []
    for name, param in student.module.named_parameters():
        if not param.requires_grad:
            continue
        (not_regularized if name.endswith(".bias") or param.ndim == 1 else regularized).append(param)
    optimizer = LARS([{"params": regularized}, {"params": not_regularized, "weight_decay": 0.0}])

    niter = len(data_loader)
    lr_schedule = cosine_scheduler(args.lr * (args.batch_size_per_gpu * world_size) / 256.0, args.min_lr,
                                   args.epochs, niter, warmup_epochs=args.warmup_epochs)
    wd_schedule = cosine_scheduler(args.weight_decay, args.weight_decay, args.epochs, niter)
    momentum_schedule = cosine_scheduler(args.momentum_teacher, 1, args.epochs, niter)

    start_epoch = 0
    ckpt_path = os.path.join(args.output_dir, "checkpoint.pth")
    if os.path.isfile(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        student.module.load_state_dict(ckpt["student"])
        teacher_without_ddp.load_state_dict(ckpt["teacher"])
        optimizer.load_state_dict(ckpt["optimizer"])
        dino_loss.load_state_dict(ckpt["dino_loss"])
        start_epoch = ckpt["epoch"]

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
    start_time = time.time()
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        student.train()
        loss_sum = torch.zeros(2, device="cuda")
        for it, (images, _) in enumerate(data_loader):
            it_global = niter * epoch + it
            for i, pg in enumerate(optimizer.param_groups):
                pg["lr"] = lr_schedule[it_global]
                if i == 0:
                    pg["weight_decay"] = wd_schedule[it_global]
            images = [im.cuda(non_blocking=True) for im in images]

            teacher_output = teacher(images[:2])
            student_output = student(images)
            loss = dino_loss(student_output, teacher_output, epoch)
            if not math.isfinite(loss.item()):
                print(f"Loss is {loss.item()}, stopping training")
                sys.exit(1)

            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

            with torch.no_grad():
                m = momentum_schedule[it_global]
                for ps, pt in zip(student.module.parameters(), teacher_without_ddp.parameters()):
                    pt.data.mul_(m).add_((1 - m) * ps.detach().data)
            loss_sum[0] += loss.detach()
            loss_sum[1] += 1
            if rank == 0 and it % 50 == 0:
                print(f"ep {epoch} it {it}/{niter} loss {loss.item():.4f} lr {lr_schedule[it_global]:.5f}")

        dist.all_reduce(loss_sum)
        if rank == 0:
            stats = {"epoch": epoch, "loss": (loss_sum[0] / loss_sum[1]).item(),
                     "time": time.time() - start_time}
            print(json.dumps(stats))
            with open(os.path.join(args.output_dir, "log.txt"), "a") as f:
                f.write(json.dumps(stats) + "\n")
            save_dict = {"student": student.module.state_dict(), "teacher": teacher_without_ddp.state_dict(),
                         "optimizer": optimizer.state_dict(), "epoch": epoch + 1,
                         "dino_loss": dino_loss.state_dict(), "args": vars(args)}
            torch.save(save_dict, ckpt_path)
            if args.saveckp_freq and epoch % args.saveckp_freq == 0:
                torch.save(save_dict, os.path.join(args.output_dir, f"checkpoint{epoch:04}.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
