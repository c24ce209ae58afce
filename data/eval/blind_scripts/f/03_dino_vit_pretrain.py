"""DINO self-distillation pre-training (ViT-S/16), single file version of our fork.

torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29400 \
    main_dino.py --arch vit_small --data_path /datasets/imagenet/train --output_dir ./out/dino_vits16
"""
import argparse
import datetime
import json
import os
import time
from pathlib import Path

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torchvision import datasets, transforms


def get_args():
    p = argparse.ArgumentParser("DINO")
    p.add_argument("--arch", default="vit_small", type=str)
    p.add_argument("--patch_size", default=16, type=int)
    p.add_argument("--out_dim", default=65536, type=int)
    p.add_argument("--momentum_teacher", default=0.996, type=float)
    p.add_argument("--warmup_teacher_temp", default=0.04, type=float)
    p.add_argument("--teacher_temp", default=0.04, type=float)
    p.add_argument("--warmup_teacher_temp_epochs", default=0, type=int)
    p.add_argument("--use_fp16", default=True, type=bool)
    p.add_argument("--weight_decay", default=0.04, type=float)
    p.add_argument("--weight_decay_end", default=0.4, type=float)
    p.add_argument("--clip_grad", default=3.0, type=float)
    p.add_argument("--batch_size_per_gpu", default=64, type=int)
    p.add_argument("--epochs", default=100, type=int)
    p.add_argument("--freeze_last_layer", default=1, type=int)
    p.add_argument("--lr", default=0.0005, type=float, help="lr at batch size 256, scaled linearly")
    p.add_argument("--warmup_epochs", default=10, type=int)
    p.add_argument("--min_lr", default=1e-6, type=float)
    p.add_argument("--local_crops_number", default=8, type=int)
    p.add_argument("--data_path", default="/path/to/imagenet/train/", type=str)
    p.add_argument("--output_dir", default=".", type=str)
    p.add_argument("--saveckp_freq", default=20, type=int)
    p.add_argument("--num_workers", default=10, type=int)
    p.add_argument("--dist_url", default="env://", type=str)
    return p.parse_args()


def init_distributed_mode(args):
    args.rank = int(os.environ["RANK"])
    args.world_size = int(os.environ["WORLD_SIZE"])
    args.gpu = int(os.environ["LOCAL_RANK"])
    dist.init_process_group(backend="nccl", init_method=args.dist_url,
                            world_size=args.world_size, rank=args.rank)
    dist.barrier()
    torch.cuda.set_device(args.gpu)
    print(f"| distributed init (rank {args.rank}): {args.dist_url}", flush=True)


def is_main_process():
    return dist.get_rank() == 0


def cosine_scheduler(base_value, final_value, epochs, niter_per_ep, warmup_epochs=0, start_warmup_value=0):
    warmup_iters = warmup_epochs * niter_per_ep
    warmup = np.linspace(start_warmup_value, base_value, warmup_iters) if warmup_iters > 0 else np.array([])
    iters = np.arange(epochs * niter_per_ep - warmup_iters)
    schedule = final_value + 0.5 * (base_value - final_value) * (1 + np.cos(np.pi * iters / len(iters)))
    return np.concatenate((warmup, schedule))


class DataAugmentationDINO:
    def __init__(self, local_crops_number):
        flip_color = transforms.Compose([
            transforms.RandomHorizontalFlip(p=0.5),
            transforms.RandomApply([transforms.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
            transforms.RandomGrayscale(p=0.2),
        ])
        norm = transforms.Compose([transforms.ToTensor(),
                                   transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
        self.global1 = transforms.Compose([transforms.RandomResizedCrop(224, scale=(0.4, 1.0)), flip_color,
                                           transforms.GaussianBlur(23), norm])
        self.global2 = transforms.Compose([transforms.RandomResizedCrop(224, scale=(0.4, 1.0)), flip_color,
                                           transforms.RandomApply([transforms.GaussianBlur(23)], p=0.1),
                                           transforms.RandomSolarize(128, p=0.2), norm])
        self.local_crops_number = local_crops_number
        self.local = transforms.Compose([transforms.RandomResizedCrop(96, scale=(0.05, 0.4)), flip_color,
                                         transforms.RandomApply([transforms.GaussianBlur(23)], p=0.5), norm])

    def __call__(self, image):
        crops = [self.global1(image), self.global2(image)]
        crops += [self.local(image) for _ in range(self.local_crops_number)]
        return crops


class DINOHead(nn.Module):
    def __init__(self, in_dim, out_dim, hidden_dim=2048, bottleneck_dim=256):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(in_dim, hidden_dim), nn.GELU(),
                                 nn.Linear(hidden_dim, hidden_dim), nn.GELU(),
                                 nn.Linear(hidden_dim, bottleneck_dim))
        self.last_layer = nn.utils.weight_norm(nn.Linear(bottleneck_dim, out_dim, bias=False))
        self.last_layer.weight_g.data.fill_(1)
        self.last_layer.weight_g.requires_grad = False

    def forward(self, x):
        x = F.normalize(self.mlp(x), dim=-1, p=2)
        return self.last_layer(x)


class MultiCropWrapper(nn.Module):
    def __init__(self, backbone, head):
        super().__init__()
        self.backbone, self.head = backbone, head

    def forward(self, x):
        idx_crops = torch.cumsum(torch.unique_consecutive(
            torch.tensor([inp.shape[-1] for inp in x]), return_counts=True)[1], 0)
        start_idx, output = 0, torch.empty(0).to(x[0].device)
        for end_idx in idx_crops:
            _out = self.backbone(torch.cat(x[start_idx:end_idx]))
            output = torch.cat((output, _out))
            start_idx = end_idx
        return self.head(output)


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


def train_dino(args):
    init_distributed_mode(args)
    torch.manual_seed(0)
    np.random.seed(0)

    dataset = datasets.ImageFolder(args.data_path, transform=DataAugmentationDINO(args.local_crops_number))
    sampler = torch.utils.data.DistributedSampler(dataset, shuffle=True)
    data_loader = torch.utils.data.DataLoader(dataset, sampler=sampler, batch_size=args.batch_size_per_gpu,
                                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    print(f"Data loaded: there are {len(dataset)} images.")

    name = f"{args.arch}_patch{args.patch_size}_224"
    student = timm.create_model(name, num_classes=0, drop_path_rate=0.1, dynamic_img_size=True)
    teacher = timm.create_model(name, num_classes=0, dynamic_img_size=True)
    embed_dim = student.num_features
    student = MultiCropWrapper(student, DINOHead(embed_dim, args.out_dim)).cuda()
    teacher = MultiCropWrapper(teacher, DINOHead(embed_dim, args.out_dim)).cuda()
    student = nn.parallel.DistributedDataParallel(student, device_ids=[args.gpu])
    teacher.load_state_dict(student.module.state_dict())
    teacher_without_ddp = teacher
    for p in teacher.parameters():
        p.requires_grad = False

    dino_loss = DINOLoss(args.out_dim, args.local_crops_number + 2, args.warmup_teacher_temp,
                         args.teacher_temp, args.warmup_teacher_temp_epochs, args.epochs).cuda()

    regularized = [p for n, p in student.named_parameters() if p.requires_grad and not (n.endswith(".bias") or p.ndim == 1)]
    not_regularized = [p for n, p in student.named_parameters() if p.requires_grad and (n.endswith(".bias") or p.ndim == 1)]
    optimizer = torch.optim.AdamW([{"params": regularized}, {"params": not_regularized, "weight_decay": 0.0}])
    fp16_scaler = torch.cuda.amp.GradScaler() if args.use_fp16 else None

    lr_schedule = cosine_scheduler(args.lr * (args.batch_size_per_gpu * args.world_size) / 256.0,
                                   args.min_lr, args.epochs, len(data_loader), warmup_epochs=args.warmup_epochs)
    wd_schedule = cosine_scheduler(args.weight_decay, args.weight_decay_end, args.epochs, len(data_loader))
    momentum_schedule = cosine_scheduler(args.momentum_teacher, 1, args.epochs, len(data_loader))

    start_epoch = 0
    ckpt_path = os.path.join(args.output_dir, "checkpoint.pth")
    if os.path.isfile(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        student.load_state_dict(ckpt["student"])
        teacher.load_state_dict(ckpt["teacher"])
        optimizer.load_state_dict(ckpt["optimizer"])
        if fp16_scaler is not None:
            fp16_scaler.load_state_dict(ckpt["fp16_scaler"])
        dino_loss.load_state_dict(ckpt["dino_loss"])
        start_epoch = ckpt["epoch"]

    start_time = time.time()
    for epoch in range(start_epoch, args.epochs):
        data_loader.sampler.set_epoch(epoch)
        loss_sum = torch.zeros(2, device="cuda")
        for it, (images, _) in enumerate(data_loader):
            it = len(data_loader) * epoch + it
            for i, pg in enumerate(optimizer.param_groups):
                pg["lr"] = lr_schedule[it]
                if i == 0:
                    pg["weight_decay"] = wd_schedule[it]
            images = [im.cuda(non_blocking=True) for im in images]
            with torch.cuda.amp.autocast(fp16_scaler is not None):
                teacher_output = teacher(images[:2])
                student_output = student(images)
                loss = dino_loss(student_output, teacher_output, epoch)

            optimizer.zero_grad()
            fp16_scaler.scale(loss).backward()
            fp16_scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(student.parameters(), args.clip_grad)
            if epoch < args.freeze_last_layer:
                for n, p in student.module.named_parameters():
                    if "last_layer" in n:
                        p.grad = None
            fp16_scaler.step(optimizer)
            fp16_scaler.update()

            with torch.no_grad():
                m = momentum_schedule[it]
                for param_q, param_k in zip(student.module.parameters(), teacher_without_ddp.parameters()):
                    param_k.data.mul_(m).add_((1 - m) * param_q.detach().data)
            loss_sum += torch.stack([loss.detach(), torch.ones((), device="cuda")])

        dist.all_reduce(loss_sum)
        log = {"epoch": epoch, "train_loss": (loss_sum[0] / loss_sum[1]).item()}
        if is_main_process():
            torch.save({"student": student.state_dict(), "teacher": teacher.state_dict(),
                        "optimizer": optimizer.state_dict(), "epoch": epoch + 1, "args": args,
                        "dino_loss": dino_loss.state_dict(), "fp16_scaler": fp16_scaler.state_dict()},
                       ckpt_path)
            if args.saveckp_freq and epoch % args.saveckp_freq == 0:
                torch.save({"teacher": teacher.state_dict()}, os.path.join(args.output_dir, f"checkpoint{epoch:04}.pth"))
            with (Path(args.output_dir) / "log.txt").open("a") as f:
                f.write(json.dumps(log) + "\n")
        dist.barrier()
    print("Training time {}".format(str(datetime.timedelta(seconds=int(time.time() - start_time)))))
    dist.destroy_process_group()


if __name__ == "__main__":
    args = get_args()
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    train_dino(args)
