"""Knowledge distillation (Hinton KD + optional feature hint) on CIFAR-100, ResNet-50 teacher -> ResNet-18 student.

torchrun --standalone --nproc_per_node=4 20_kd_cifar100.py --teacher_ckpt ckpt/r50_c100.pth --accum 2
"""
import os
import time
import argparse
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
import torchvision
import torchvision.transforms as T
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument('--data', default='./data')
    ap.add_argument('--teacher_ckpt', required=True)
    ap.add_argument('--epochs', type=int, default=240)
    ap.add_argument('--bs', type=int, default=64, help='per GPU micro batch')
    ap.add_argument('--accum', type=int, default=1)
    ap.add_argument('--lr', type=float, default=0.05, help='for a global batch of 256')
    ap.add_argument('--T', type=float, default=4.0)
    ap.add_argument('--alpha', type=float, default=0.9)
    ap.add_argument('--resume', default='')
    ap.add_argument('--save_dir', default='kd_r50_r18')
    return ap.parse_args()


def cifar_resnet(arch, num_classes=100):
    m = torchvision.models.__dict__[arch](num_classes=num_classes)
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m


def strip_prefix(sd, prefix='module.'):
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in sd.items()}


def kd_loss(s_logits, t_logits, y, T, alpha):
    soft = F.kl_div(F.log_softmax(s_logits / T, 1), F.softmax(t_logits / T, 1), reduction='batchmean') * T * T
    return alpha * soft + (1 - alpha) * F.cross_entropy(s_logits, y)


@torch.no_grad()
def evaluate(model, loader, sampler, n_total, device):
    """DistributedSampler pads the last ranks; gather (index, correct) pairs and count every image once."""
    model.eval()
    idx_all = torch.tensor(list(iter(sampler)), device=device)
    flags = []
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        flags.append((model(x).argmax(1) == y).float())
    flags = torch.cat(flags)
    world = dist.get_world_size()
    g_idx = [torch.empty_like(idx_all) for _ in range(world)]
    g_flag = [torch.empty_like(flags) for _ in range(world)]
    dist.all_gather(g_idx, idx_all)  # same length on every rank thanks to the padding
    dist.all_gather(g_flag, flags)
    per_image = torch.zeros(n_total, device=device)
    per_image[torch.cat(g_idx)] = torch.cat(g_flag)
    return per_image.mean().item()


def main():
    args = parse()
    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group('nccl')
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device('cuda', local_rank)

    norm = T.Normalize((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))
    if rank == 0:  # download once; others wait at the barrier below
        torchvision.datasets.CIFAR100(args.data, train=True, download=True)
        torchvision.datasets.CIFAR100(args.data, train=False, download=True)
        os.makedirs(args.save_dir, exist_ok=True)
    dist.barrier()
    train_set = torchvision.datasets.CIFAR100(args.data, train=True, transform=T.Compose(
        [T.RandomCrop(32, 4), T.RandomHorizontalFlip(), T.ToTensor(), norm]))
    test_set = torchvision.datasets.CIFAR100(args.data, train=False, transform=T.Compose([T.ToTensor(), norm]))
    train_sampler = DistributedSampler(train_set, shuffle=True)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    train_loader = DataLoader(train_set, args.bs, sampler=train_sampler, num_workers=4, pin_memory=True,
                              drop_last=True)
    test_loader = DataLoader(test_set, 200, sampler=test_sampler, num_workers=4)

    # frozen teacher: no gradients, so no DDP wrapper; every rank holds a full copy
    teacher = cifar_resnet('resnet50')
    teacher.load_state_dict(strip_prefix(torch.load(args.teacher_ckpt, map_location='cpu')['state_dict']))
    teacher = teacher.to(device).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)

    student = cifar_resnet('resnet18')
    student = nn.SyncBatchNorm.convert_sync_batchnorm(student).to(device)
    student = DDP(student, device_ids=[local_rank])
    global_bs = args.bs * args.accum * world
    lr = args.lr * global_bs / 256
    opt = torch.optim.SGD(student.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [150, 180, 210], 0.1)

    start, best = 0, 0.0
    if args.resume and os.path.isfile(args.resume):
        ck = torch.load(args.resume, map_location=device)
        student.module.load_state_dict(ck['student'])
        opt.load_state_dict(ck['opt'])
        sched.load_state_dict(ck['sched'])
        start, best = ck['epoch'] + 1, ck['best']
    ta = evaluate(teacher, test_loader, test_sampler, len(test_set), device)  # collective: every rank
    if rank == 0:
        print(f'teacher acc {ta:.4f}  global batch {global_bs}  lr {lr:.4f}', flush=True)

    for epoch in range(start, args.epochs):
        train_sampler.set_epoch(epoch)
        student.train()
        t0, tot = time.time(), torch.zeros(2, device=device)
        opt.zero_grad(set_to_none=True)
        for i, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.no_grad():
                t_logits = teacher(x)
            step_now = (i + 1) % args.accum == 0 or (i + 1) == len(train_loader)
            with (nullcontext() if step_now else student.no_sync()):
                loss = kd_loss(student(x), t_logits, y, args.T, args.alpha)
                (loss / args.accum).backward()
            if step_now:
                opt.step()
                opt.zero_grad(set_to_none=True)
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(tot)
        acc = evaluate(student.module, test_loader, test_sampler, len(test_set), device)
        if rank == 0:
            print(f'epoch {epoch} loss {(tot[0] / tot[1]).item():.4f} student acc {acc:.4f} '
                  f'({time.time() - t0:.0f}s)', flush=True)
            best = max(best, acc)
            torch.save({'student': student.module.state_dict(), 'opt': opt.state_dict(),
                        'sched': sched.state_dict(), 'epoch': epoch, 'best': best},
                       os.path.join(args.save_dir, 'last.pth'))
        dist.barrier()  # nobody resumes/reads last.pth while rank 0 is still writing it
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
