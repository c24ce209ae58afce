# DINO pre-training, ViT-S/16, 2x224 global + 10x96 local crops, AdamW, fp16.
import argparse
import datetime
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import ImageFilter
from torchvision import datasets, transforms as T


def get_args_parser():
    p = argparse.ArgumentParser("DINO", add_help=False)
    p.add_argument("--arch", default="vit_small_patch16_224", type=str)
    p.add_argument("--out_dim", default=65536, type=int)
    p.add_argument("--norm_last_layer", default=False, type=lambda s: s.lower() in ("1", "true", "yes"))
    p.add_argument("--momentum_teacher", default=0.996, type=float)
    p.add_argument("--warmup_teacher_temp", default=0.04, type=float)
    p.add_argument("--teacher_temp", default=0.07, type=float)
    p.add_argument("--warmup_teacher_temp_epochs", default=30, type=int)
    p.add_argument("--use_fp16", default=True, type=lambda s: s.lower() in ("1", "true", "yes"))
    p.add_argument("--weight_decay", type=float, default=0.04)
    p.add_argument("--weight_decay_end", type=float, default=0.4)
    p.add_argument("--clip_grad", type=float, default=3.0)
    p.add_argument("--batch_size_per_gpu", default=64, type=int)
    p.add_argument("--epochs", default=300, type=int)
    p.add_argument("--freeze_last_layer", default=1, type=int)
    p.add_argument("--lr", default=0.0005, type=float, help="lr at batch size 256")
    p.add_argument("--warmup_epochs", default=10, type=int)
    p.add_argument("--min_lr", type=float, default=1e-5)
    p.add_argument("--drop_path_rate", type=float, default=0.1)
    p.add_argument("--global_crops_scale", type=float, nargs="+", default=(0.25, 1.0))
    p.add_argument("--local_crops_number", type=int, default=10)
    p.add_argument("--local_crops_scale", type=float, nargs="+", default=(0.05, 0.25))
    p.add_argument("--data_path", default="/path/to/imagenet/train/", type=str)
    p.add_argument("--output_dir", default=".", type=str)
    p.add_argument("--saveckp_freq", default=20, type=int)
    p.add_argument("--seed", default=0, type=int)
    p.add_argument("--num_workers", default=10, type=int)
    return p


class GaussianBlur:
    def __init__(self, p):
        self.p = p

    def __call__(self, img):
        if random.random() <= self.p:
            return img.filter(ImageFilter.GaussianBlur(radius=random.uniform(0.1, 2.0)))
        return img


class MultiCropAug:
    def __init__(self, gscale, lscale, n_local):
        color = T.Compose([T.RandomHorizontalFlip(), T.RandomApply([T.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
                           T.RandomGrayscale(p=0.2)])
        norm = T.Compose([T.ToTensor(), T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
        self.g1 = T.Compose([T.RandomResizedCrop(224, scale=gscale, interpolation=T.InterpolationMode.BICUBIC),
                             color, GaussianBlur(1.0), norm])
        self.g2 = T.Compose([T.RandomResizedCrop(224, scale=gscale, interpolation=T.InterpolationMode.BICUBIC),
                             color, GaussianBlur(0.1), T.RandomSolarize(128, p=0.2), norm])
        self.loc = T.Compose([T.RandomResizedCrop(96, scale=lscale, interpolation=T.InterpolationMode.BICUBIC),
                              color, GaussianBlur(0.5), norm])
        self.n_local = n_local

    def __call__(self, img):
        return [self.g1(img), self.g2(img)] + [self.loc(img) for _ in range(self.n_local)]


class DINOHead(nn.Module):
    def __init__(self, in_dim, out_dim, norm_last_layer=True, hidden_dim=2048, bottleneck_dim=256):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(in_dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, hidden_dim),
                                 nn.GELU(), nn.Linear(hidden_dim, bottleneck_dim))
        self.apply(self._init_weights)
        self.last_layer = nn.utils.weight_norm(nn.Linear(bottleneck_dim, out_dim, bias=False))
        self.last_layer.weight_g.data.fill_(1)
        if norm_last_layer:
            self.last_layer.weight_g.requires_grad = False

    def _init_weights(self, m):
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=.02)
            if m.bias is not None:
                nn.init.constant_(m.bias, 0)

    def forward(self, x):
        x = F.normalize(self.mlp(x), dim=-1, p=2)
        return self.last_layer(x)


class MultiCropWrapper(nn.Module):
    """Runs the backbone once per crop resolution, then the head once on everything."""

    def __init__(self, backbone, head):
        super().__init__()
        self.backbone, self.head = backbone, head

    def forward(self, x):
        if not isinstance(x, list):
            x = [x]
        idx_crops = torch.cumsum(torch.unique_consecutive(torch.tensor([inp.shape[-1] for inp in x]),
                                                          return_counts=True)[1], 0)
        start_idx, output = 0, torch.empty(0).to(x[0].device)
        for end_idx in idx_crops:
            _out = self.backbone(torch.cat(x[start_idx:end_idx]))
            output = torch.cat((output, _out))
            start_idx = end_idx
        return self.head(output)


class DINOLoss(nn.Module):
    def __init__(self, out_dim, ncrops, warmup_teacher_temp, teacher_temp, warmup_teacher_temp_epochs, nepochs,
                 student_temp=0.1, center_momentum=0.9):
        super().__init__()
        self.student_temp = student_temp
        self.center_momentum = center_momentum
        self.ncrops = ncrops
        self.register_buffer("center", torch.zeros(1, out_dim))
        self.teacher_temp_schedule = np.concatenate((
            np.linspace(warmup_teacher_temp, teacher_temp, warmup_teacher_temp_epochs),
            np.ones(nepochs - warmup_teacher_temp_epochs) * teacher_temp))

    def forward(self, student_output, teacher_output, epoch):
        student_out = (student_output / self.student_temp).chunk(self.ncrops)
        temp = self.teacher_temp_schedule[epoch]
        teacher_out = F.softmax((teacher_output - self.center) / temp, dim=-1).detach().chunk(2)
        total_loss, n_loss_terms = 0, 0
        for iq, q in enumerate(teacher_out):
            for v in range(len(student_out)):
                if v == iq:
                    continue
                total_loss += torch.sum(-q * F.log_softmax(student_out[v], dim=-1), dim=-1).mean()
                n_loss_terms += 1
        self.update_center(teacher_output)
        return total_loss / n_loss_terms

    @torch.no_grad()
    def update_center(self, teacher_output):
        batch_center = torch.sum(teacher_output, dim=0, keepdim=True)
        dist.all_reduce(batch_center)
        batch_center = batch_center / (len(teacher_output) * dist.get_world_size())
        self.center = self.center * self.center_momentum + batch_center * (1 - self.center_momentum)


def cosine_scheduler(base_value, final_value, epochs, niter_per_ep, warmup_epochs=0):
    warmup_schedule = np.array([])
    warmup_iters = warmup_epochs * niter_per_ep
    if warmup_epochs > 0:
        warmup_schedule = np.linspace(0, base_value, warmup_iters)
    iters = np.arange(epochs * niter_per_ep - warmup_iters)
    schedule = final_value + 0.5 * (base_value - final_value) * (1 + np.cos(np.pi * iters / len(iters)))
    return np.concatenate((warmup_schedule, schedule))


def get_params_groups(model):
    regularized, not_regularized = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if name.endswith(".bias") or len(param.shape) == 1:
            not_regularized.append(param)
        else:
            regularized.append(param)
    return [{"params": regularized}, {"params": not_regularized, "weight_decay": 0.}]


def cancel_gradients_last_layer(epoch, model, freeze_last_layer):
    if epoch >= freeze_last_layer:
        return
    for n, p in model.named_parameters():
        if "last_layer" in n:
            p.grad = None


def train_dino(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    random.seed(args.seed)
    torch.backends.cudnn.benchmark = True
    if rank == 0:
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        print("\n".join(f"{k}: {v}" for k, v in sorted(vars(args).items())))

    dataset = datasets.ImageFolder(args.data_path, transform=MultiCropAug(
        args.global_crops_scale, args.local_crops_scale, args.local_crops_number))
    sampler = torch.utils.data.DistributedSampler(dataset, shuffle=True)
    data_loader = torch.utils.data.DataLoader(dataset, sampler=sampler, batch_size=args.batch_size_per_gpu,
                                              num_workers=args.num_workers, pin_memory=True, drop_last=True)

    # dynamic_img_size lets the same ViT take 224 and 96 crops
    student_backbone = timm.create_model(args.arch, num_classes=0, drop_path_rate=args.drop_path_rate,
                                         dynamic_img_size=True)
    teacher_backbone = timm.create_model(args.arch, num_classes=0, dynamic_img_size=True)
    embed_dim = student_backbone.embed_dim
    student = MultiCropWrapper(student_backbone, DINOHead(embed_dim, args.out_dim, args.norm_last_layer))
    teacher = MultiCropWrapper(teacher_backbone, DINOHead(embed_dim, args.out_dim))
    student, teacher = student.cuda(), teacher.cuda()

    # ViTs have no batch norms, so the teacher needs no DDP wrapper: it only gets EMA updates
    teacher_without_ddp = teacher
    student = nn.parallel.DistributedDataParallel(student, device_ids=[local_rank])
    teacher_without_ddp.load_state_dict(student.module.state_dict())
    for p in teacher.parameters():
        p.requires_grad = False

    dino_loss = DINOLoss(args.out_dim, args.local_crops_number + 2, args.warmup_teacher_temp, args.teacher_temp,
                         args.warmup_teacher_temp_epochs, args.epochs).cuda()
    optimizer = torch.optim.AdamW(get_params_groups(student))
    fp16_scaler = torch.cuda.amp.GradScaler() if args.use_fp16 else None

    niter = len(data_loader)
    lr_schedule = cosine_scheduler(args.lr * (args.batch_size_per_gpu * world_size) / 256., args.min_lr,
                                   args.epochs, niter, warmup_epochs=args.warmup_epochs)
    wd_schedule = cosine_scheduler(args.weight_decay, args.weight_decay_end, args.epochs, niter)
    momentum_schedule = cosine_scheduler(args.momentum_teacher, 1, args.epochs, niter)

    start_epoch = 0
    ckpt_file = os.path.join(args.output_dir, "checkpoint.pth")
    if os.path.isfile(ckpt_file):
        ckpt = torch.load(ckpt_file, map_location="cpu")
        student.load_state_dict(ckpt["student"])
        teacher_without_ddp.load_state_dict(ckpt["teacher"])
        optimizer.load_state_dict(ckpt["optimizer"])
        if fp16_scaler is not None and "fp16_scaler" in ckpt:
            fp16_scaler.load_state_dict(ckpt["fp16_scaler"])
        dino_loss.load_state_dict(ckpt["dino_loss"])
        start_epoch = ckpt["epoch"]

    start_time = time.time()
    for epoch in range(start_epoch, args.epochs):
        data_loader.sampler.set_epoch(epoch)
        student.train()
        loss_acc = torch.zeros(2, device="cuda")
        for it, (images, _) in enumerate(data_loader):
            it = niter * epoch + it
            for i, param_group in enumerate(optimizer.param_groups):
                param_group["lr"] = lr_schedule[it]
                if i == 0:
                    param_group["weight_decay"] = wd_schedule[it]
            images = [im.cuda(non_blocking=True) for im in images]

            with torch.cuda.amp.autocast(fp16_scaler is not None):
                teacher_output = teacher(images[:2])
                student_output = student(images)
                loss = dino_loss(student_output, teacher_output, epoch)

            if not math.isfinite(loss.item()):
                print(f"Loss is {loss.item()}, stopping training", flush=True)
                sys.exit(1)

            optimizer.zero_grad()
            if fp16_scaler is None:
                loss.backward()
                nn.utils.clip_grad_norm_(student.parameters(), args.clip_grad)
                cancel_gradients_last_layer(epoch, student, args.freeze_last_layer)
                optimizer.step()
            else:
                fp16_scaler.scale(loss).backward()
                fp16_scaler.unscale_(optimizer)
                nn.utils.clip_grad_norm_(student.parameters(), args.clip_grad)
                cancel_gradients_last_layer(epoch, student, args.freeze_last_layer)
                fp16_scaler.step(optimizer)
                fp16_scaler.update()

            with torch.no_grad():
                m = momentum_schedule[it]
                for param_q, param_k in zip(student.module.parameters(), teacher_without_ddp.parameters()):
                    param_k.data.mul_(m).add_((1 - m) * param_q.detach().data)

            loss_acc += torch.stack([loss.detach().float(), torch.ones((), device="cuda")])
            if rank == 0 and it % 100 == 0:
                print(f"Epoch [{epoch}] it {it} loss {loss.item():.4f} lr {lr_schedule[it]:.6f} "
                      f"wd {wd_schedule[it]:.4f} m {m:.4f}", flush=True)

        dist.all_reduce(loss_acc)
        if rank == 0:
            save_dict = {"student": student.state_dict(), "teacher": teacher_without_ddp.state_dict(),
                         "optimizer": optimizer.state_dict(), "epoch": epoch + 1, "args": args,
                         "dino_loss": dino_loss.state_dict()}
            if fp16_scaler is not None:
                save_dict["fp16_scaler"] = fp16_scaler.state_dict()
            torch.save(save_dict, ckpt_file)
            if args.saveckp_freq and epoch % args.saveckp_freq == 0:
                torch.save(save_dict, os.path.join(args.output_dir, f"checkpoint{epoch:04}.pth"))
            log_stats = {"train_loss": (loss_acc[0] / loss_acc[1]).item(), "epoch": epoch}
            with (Path(args.output_dir) / "log.txt").open("a") as f:
                f.write(json.dumps(log_stats) + "\n")

    if rank == 0:
        print(f"Training time {datetime.timedelta(seconds=int(time.time() - start_time))}")
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser("DINO", parents=[get_args_parser()])
    train_dino(parser.parse_args())
