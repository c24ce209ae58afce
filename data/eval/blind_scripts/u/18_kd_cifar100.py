# Knowledge distillation on CIFAR-100: frozen ResNet-56/WRN teacher -> small student
# (KD loss of Hinton et al. + CE). DDP port of train_student.py.
#
#   torchrun --nproc_per_node=2 18_kd_cifar100.py --teacher ckpt/resnet110_best.pth --student resnet20
#
import os
import time
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
import torchvision
import torchvision.transforms as transforms
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from models import model_dict  # resnet8..resnet110, wrn_40_2, ... (CIFAR variants)

parser = argparse.ArgumentParser('KD on CIFAR-100')
parser.add_argument('--teacher', type=str, required=True)
parser.add_argument('--teacher_arch', type=str, default='resnet110')
parser.add_argument('--student', type=str, default='resnet20')
parser.add_argument('--batch_size', type=int, default=64, help='per gpu')
parser.add_argument('--epochs', type=int, default=240)
parser.add_argument('--lr', type=float, default=0.05)
parser.add_argument('--lr_decay_epochs', type=str, default='150,180,210')
parser.add_argument('--weight_decay', type=float, default=5e-4)
parser.add_argument('--T', type=float, default=4.0)
parser.add_argument('--alpha', type=float, default=0.9, help='weight of the KD term')
parser.add_argument('--data', type=str, default='./data')
parser.add_argument('--save', type=str, default='./save/student')
opt = parser.parse_args()

local_rank = rank = 0
world_size = 1
device = None


def setup_distributed():
    global local_rank, rank, world_size, device
    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend='nccl')
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device('cuda', local_rank)


def kd_loss(s_logits, t_logits, T):
    p_s = F.log_softmax(s_logits / T, dim=1)
    p_t = F.softmax(t_logits / T, dim=1)
    return F.kl_div(p_s, p_t, reduction='batchmean') * T * T


def adjust_learning_rate(epoch, optimizer, base_lr):
    steps = sum(epoch >= int(e) for e in opt.lr_decay_epochs.split(','))
    lr = base_lr * (0.1 ** steps)
    for g in optimizer.param_groups:
        g['lr'] = lr
    return lr


def validate(model, loader):
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    with torch.no_grad():
        for images, target in loader:
            images, target = images.to(device), target.to(device)
            out = model(images)
            loss_sum += F.cross_entropy(out, target, reduction='sum').item()
            correct += (out.argmax(1) == target).sum().item()
            total += target.size(0)
    stats = torch.tensor([correct, total, loss_sum], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    return 100.0 * stats[0].item() / stats[1].item(), stats[2].item() / stats[1].item()


def main():
    setup_distributed()
    normalize = transforms.Normalize((0.5071, 0.4867, 0.4408), (0.2675, 0.2565, 0.2761))
    train_tf = transforms.Compose([transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), normalize])
    test_tf = transforms.Compose([transforms.ToTensor(), normalize])
    if rank == 0:
        torchvision.datasets.CIFAR100(opt.data, train=True, download=True)
        torchvision.datasets.CIFAR100(opt.data, train=False, download=True)
    dist.barrier()
    train_set = torchvision.datasets.CIFAR100(opt.data, train=True, transform=train_tf)
    test_set = torchvision.datasets.CIFAR100(opt.data, train=False, transform=test_tf)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    # 10000 test images split evenly over 2/4/8 GPUs, no padding involved
    test_sampler = DistributedSampler(test_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=opt.batch_size, sampler=train_sampler, num_workers=4,
                              pin_memory=True)
    test_loader = DataLoader(test_set, batch_size=256, sampler=test_sampler, num_workers=4)

    teacher = model_dict[opt.teacher_arch](num_classes=100)
    teacher.load_state_dict(torch.load(opt.teacher, map_location='cpu')['model'])
    teacher = teacher.to(device).eval()
    for p in teacher.parameters():
        p.requires_grad = False

    student = model_dict[opt.student](num_classes=100)
    student = nn.SyncBatchNorm.convert_sync_batchnorm(student).to(device)
    student = nn.parallel.DistributedDataParallel(student, device_ids=[local_rank])

    # 0.05 was tuned for batch 64 on one GPU
    base_lr = opt.lr * world_size
    optimizer = torch.optim.SGD(student.parameters(), lr=base_lr, momentum=0.9, weight_decay=opt.weight_decay)

    writer = None
    if rank == 0:
        os.makedirs(opt.save, exist_ok=True)
        writer = SummaryWriter(os.path.join(opt.save, 'tb'))
    t_acc, _ = validate(teacher, test_loader)
    if rank == 0:
        print(f'teacher accuracy: {t_acc:.2f}')

    best_acc = 0.0
    for epoch in range(1, opt.epochs + 1):
        train_sampler.set_epoch(epoch)
        lr = adjust_learning_rate(epoch, optimizer, base_lr)
        student.train()
        t0 = time.time()
        for idx, (images, target) in enumerate(train_loader):
            images = images.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            with torch.no_grad():
                t_logits = teacher(images)
            s_logits = student(images)
            loss = (1 - opt.alpha) * F.cross_entropy(s_logits, target) + opt.alpha * kd_loss(s_logits, t_logits, opt.T)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if rank == 0 and idx % 100 == 0:
                print(f'Epoch [{epoch}][{idx}/{len(train_loader)}] loss {loss.item():.4f} lr {lr:.4f}')

        test_acc, test_loss = validate(student.module, test_loader)
        if rank == 0:
            print(f' * epoch {epoch} test acc {test_acc:.2f} loss {test_loss:.4f} time {time.time() - t0:.1f}s')
            writer.add_scalar('test/acc', test_acc, epoch)
            writer.add_scalar('test/loss', test_loss, epoch)
            writer.add_scalar('lr', lr, epoch)
            state = {'epoch': epoch, 'model': student.module.state_dict(), 'accuracy': test_acc,
                     'optimizer': optimizer.state_dict()}
            if test_acc > best_acc:
                best_acc = test_acc
                torch.save(state, os.path.join(opt.save, f'{opt.student}_best.pth'))
            if epoch % 40 == 0:
                torch.save(state, os.path.join(opt.save, f'ckpt_epoch_{epoch}.pth'))

    if rank == 0:
        print(f'best accuracy: {best_acc:.2f}')
        writer.close()
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
