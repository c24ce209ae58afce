# Self-distillation with no labels (DINO) - ViT-S/16 pretraining on ImageNet.
import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torchvision import datasets, transforms


def get_world_size():
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def get_rank():
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_main_process():
    return get_rank() == 0


def save_on_master(*args, **kwargs):
    if is_main_process():
        torch.save(*args, **kwargs)


def init_distributed_mode(args):
    if 'RANK' in os.environ and 'WORLD_SIZE' in os.environ:
        args.rank = int(os.environ["RANK"])
        args.world_size = int(os.environ['WORLD_SIZE'])
        args.gpu = args.local_rank
    elif torch.cuda.is_available():
        print('Will run the code on one GPU.')
        args.rank, args.gpu, args.world_size = 0, 0, 1
        os.environ['MASTER_ADDR'] = '127.0.0.1'
        os.environ['MASTER_PORT'] = '29500'
    else:
        print('Does not support training without GPU.')
        sys.exit(1)
    torch.cuda.set_device(args.gpu)
    dist.init_process_group(backend="nccl", init_method=args.dist_url, world_size=args.world_size, rank=args.rank)
    print('| distributed init (rank {}): {}'.format(args.rank, args.dist_url), flush=True)
    dist.barrier()


def cosine_scheduler(base_value, final_value, epochs, niter_per_ep, warmup_epochs=0, start_warmup_value=0):
    warmup_schedule = np.array([])
    warmup_iters = warmup_epochs * niter_per_ep
    if warmup_epochs > 0:
        warmup_schedule = np.linspace(start_warmup_value, base_value, warmup_iters)
    iters = np.arange(epochs * niter_per_ep - warmup_iters)
    schedule = final_value + 0.5 * (base_value - final_value) * (1 + np.cos(np.pi * iters / len(iters)))
    return np.concatenate((warmup_schedule, schedule))


class DataAugmentationDINO(object):
    def __init__(self, global_crops_scale, local_crops_scale, local_crops_number):
        flip_and_color_jitter = transforms.Compose([
            transforms.RandomHorizontalFlip(p=0.5),
            transforms.RandomApply([transforms.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
            transforms.RandomGrayscale(p=0.2)])
        normalize = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
        blur = lambda p: transforms.RandomApply([transforms.GaussianBlur(23, sigma=(0.1, 2.0))], p=p)
        self.global_transfo1 = transforms.Compose([transforms.RandomResizedCrop(224, scale=global_crops_scale, interpolation=Image.BICUBIC),
                                                   flip_and_color_jitter, blur(1.0), normalize])
        self.global_transfo2 = transforms.Compose([transforms.RandomResizedCrop(224, scale=global_crops_scale, interpolation=Image.BICUBIC),
                                                   flip_and_color_jitter, blur(0.1), transforms.RandomSolarize(128, p=0.2), normalize])
        self.local_crops_number = local_crops_number
        self.local_transfo = transforms.Compose([transforms.RandomResizedCrop(96, scale=local_crops_scale, interpolation=Image.BICUBIC),
                                                 flip_and_color_jitter, blur(0.5), normalize])

    def __call__(self, image):
        crops = [self.global_transfo1(image), self.global_transfo2(image)]
        crops += [self.local_transfo(image) for _ in range(self.local_crops_number)]
        return crops


class DINOHead(nn.Module):
    def __init__(self, in_dim, out_dim, norm_last_layer=True, hidden_dim=2048, bottleneck_dim=256):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(in_dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, hidden_dim), nn.GELU(),
                                 nn.Linear(hidden_dim, bottleneck_dim))
        self.last_layer = nn.utils.weight_norm(nn.Linear(bottleneck_dim, out_dim, bias=False))
        self.last_layer.weight_g.data.fill_(1)
        if norm_last_layer:
            self.last_layer.weight_g.requires_grad = False

    def forward(self, x):
        x = nn.functional.normalize(self.mlp(x), dim=-1, p=2)
        return self.last_layer(x)


class MultiCropWrapper(nn.Module):
    def __init__(self, backbone, head):
        super().__init__()
        self.backbone, self.head = backbone, head

    def forward(self, x):
        idx_crops = torch.cumsum(torch.unique_consecutive(torch.tensor([inp.shape[-1] for inp in x]), return_counts=True)[1], 0)
        start_idx, output = 0, []
        for end_idx in idx_crops:
            output.append(self.backbone(torch.cat(x[start_idx: end_idx])))
            start_idx = end_idx
        return self.head(torch.cat(output))


class DINOLoss(nn.Module):
    def __init__(self, out_dim, ncrops, warmup_teacher_temp, teacher_temp, warmup_teacher_temp_epochs, nepochs,
                 student_temp=0.1, center_momentum=0.9):
        super().__init__()
        self.student_temp, self.center_momentum, self.ncrops = student_temp, center_momentum, ncrops
        self.register_buffer("center", torch.zeros(1, out_dim))
        self.teacher_temp_schedule = np.concatenate((np.linspace(warmup_teacher_temp, teacher_temp, warmup_teacher_temp_epochs),
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


def train_one_epoch(student, teacher, teacher_without_ddp, dino_loss, data_loader, optimizer, lr_schedule, wd_schedule,
                    momentum_schedule, epoch, fp16_scaler, args):
    total, t0 = 0.0, time.time()
    for it, (images, _) in enumerate(data_loader):
        it = len(data_loader) * epoch + it
        for i, param_group in enumerate(optimizer.param_groups):
            param_group["lr"] = lr_schedule[it]
            if i == 0:
                param_group["weight_decay"] = wd_schedule[it]
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
            for n, p in student.named_parameters():
                if "last_layer" in n:
                    p.grad = None
        fp16_scaler.step(optimizer)
        fp16_scaler.update()

        with torch.no_grad():
            m = momentum_schedule[it]
            for param_q, param_k in zip(student.module.parameters(), teacher_without_ddp.parameters()):
                param_k.data.mul_(m).add_((1 - m) * param_q.detach().data)
        torch.cuda.synchronize()
        total += loss.item()
        if it % 10 == 0:
            print('Epoch: [{}/{}] it {} loss: {:.4f} lr: {:.6f} ({:.0f}s)'.format(
                epoch, args.epochs, it, loss.item(), optimizer.param_groups[0]["lr"], time.time() - t0))
    stats = torch.tensor([total, len(data_loader)], dtype=torch.float64, device='cuda')
    dist.all_reduce(stats)
    return {'loss': (stats[0] / stats[1]).item(), 'lr': optimizer.param_groups[0]["lr"]}


def get_args_parser():
    parser = argparse.ArgumentParser('DINO', add_help=False)
    parser.add_argument('--arch', default='vit_small_patch16_224', type=str)
    parser.add_argument('--out_dim', default=65536, type=int)
    parser.add_argument('--momentum_teacher', default=0.996, type=float)
    parser.add_argument('--warmup_teacher_temp', default=0.04, type=float)
    parser.add_argument('--teacher_temp', default=0.04, type=float)
    parser.add_argument('--warmup_teacher_temp_epochs', default=0, type=int)
    parser.add_argument('--weight_decay', type=float, default=0.04)
    parser.add_argument('--weight_decay_end', type=float, default=0.4)
    parser.add_argument('--clip_grad', type=float, default=3.0)
    parser.add_argument('--batch_size_per_gpu', default=64, type=int)
    parser.add_argument('--epochs', default=100, type=int)
    parser.add_argument('--freeze_last_layer', default=1, type=int)
    parser.add_argument("--lr", default=0.0005, type=float, help="lr at the end of warmup, scaled to the batch size 256")
    parser.add_argument("--warmup_epochs", default=10, type=int)
    parser.add_argument('--min_lr', type=float, default=1e-6)
    parser.add_argument('--local_crops_number', type=int, default=8)
    parser.add_argument('--data_path', default='/path/to/imagenet/train/', type=str)
    parser.add_argument('--output_dir', default=".", type=str)
    parser.add_argument('--saveckp_freq', default=20, type=int)
    parser.add_argument('--seed', default=0, type=int)
    parser.add_argument('--num_workers', default=10, type=int)
    parser.add_argument("--dist_url", default="env://", type=str)
    parser.add_argument("--local_rank", default=0, type=int, help="Please ignore and do not set this argument.")
    return parser


def train_dino(args):
    init_distributed_mode(args)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    print("\n".join("%s: %s" % (k, str(v)) for k, v in sorted(dict(vars(args)).items())))

    transform = DataAugmentationDINO((0.4, 1.), (0.05, 0.4), args.local_crops_number)
    dataset = datasets.ImageFolder(args.data_path, transform=transform)
    sampler = torch.utils.data.DistributedSampler(dataset, shuffle=True)
    data_loader = torch.utils.data.DataLoader(dataset, sampler=sampler, batch_size=args.batch_size_per_gpu,
                                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    print(f"Data loaded: there are {len(dataset)} images.")

    student = timm.create_model(args.arch, num_classes=0, drop_path_rate=0.1)
    teacher = timm.create_model(args.arch, num_classes=0)
    embed_dim = student.num_features
    student = MultiCropWrapper(student, DINOHead(embed_dim, args.out_dim, norm_last_layer=True)).cuda()
    teacher = MultiCropWrapper(teacher, DINOHead(embed_dim, args.out_dim)).cuda()
    teacher_without_ddp = teacher
    student = nn.parallel.DistributedDataParallel(student, device_ids=[args.gpu])
    teacher_without_ddp.load_state_dict(student.module.state_dict())
    for p in teacher.parameters():
        p.requires_grad = False

    dino_loss = DINOLoss(args.out_dim, args.local_crops_number + 2, args.warmup_teacher_temp, args.teacher_temp,
                         args.warmup_teacher_temp_epochs, args.epochs).cuda()
    regularized = [p for n, p in student.named_parameters() if p.requires_grad and not (n.endswith(".bias") or p.ndim == 1)]
    not_regularized = [p for n, p in student.named_parameters() if p.requires_grad and (n.endswith(".bias") or p.ndim == 1)]
    optimizer = torch.optim.AdamW([{'params': regularized}, {'params': not_regularized, 'weight_decay': 0.}])
    fp16_scaler = torch.cuda.amp.GradScaler()

    lr_schedule = cosine_scheduler(args.lr * (args.batch_size_per_gpu * get_world_size()) / 256., args.min_lr,
                                   args.epochs, len(data_loader), warmup_epochs=args.warmup_epochs)
    wd_schedule = cosine_scheduler(args.weight_decay, args.weight_decay_end, args.epochs, len(data_loader))
    momentum_schedule = cosine_scheduler(args.momentum_teacher, 1, args.epochs, len(data_loader))

    start_epoch = 0
    ckpt_path = os.path.join(args.output_dir, "checkpoint.pth")
    if os.path.isfile(ckpt_path):
        checkpoint = torch.load(ckpt_path, map_location="cpu")
        student.load_state_dict(checkpoint['student'])
        teacher.load_state_dict(checkpoint['teacher'])
        optimizer.load_state_dict(checkpoint['optimizer'])
        fp16_scaler.load_state_dict(checkpoint['fp16_scaler'])
        dino_loss.load_state_dict(checkpoint['dino_loss'])
        start_epoch = checkpoint['epoch']
        print("Found checkpoint at {}, resuming from epoch {}".format(ckpt_path, start_epoch))

    start_time = time.time()
    for epoch in range(start_epoch, args.epochs):
        data_loader.sampler.set_epoch(epoch)
        train_stats = train_one_epoch(student, teacher, teacher_without_ddp, dino_loss, data_loader, optimizer,
                                      lr_schedule, wd_schedule, momentum_schedule, epoch, fp16_scaler, args)
        save_dict = {'student': student.state_dict(), 'teacher': teacher.state_dict(),
                     'optimizer': optimizer.state_dict(), 'epoch': epoch + 1, 'args': args,
                     'dino_loss': dino_loss.state_dict(), 'fp16_scaler': fp16_scaler.state_dict()}
        save_on_master(save_dict, ckpt_path)
        if args.saveckp_freq and epoch % args.saveckp_freq == 0:
            save_on_master(save_dict, os.path.join(args.output_dir, f'checkpoint{epoch:04}.pth'))
        log_stats = {**{f'train_{k}': v for k, v in train_stats.items()}, 'epoch': epoch}
        if is_main_process():
            with (Path(args.output_dir) / "log.txt").open("a") as f:
                f.write(json.dumps(log_stats) + "\n")
    total_time = time.time() - start_time
    print('Training time {}'.format(str(datetime.timedelta(seconds=int(total_time)))))
    dist.destroy_process_group()


if __name__ == '__main__':
    parser = argparse.ArgumentParser('DINO', parents=[get_args_parser()])
    args = parser.parse_args()
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    train_dino(args)
