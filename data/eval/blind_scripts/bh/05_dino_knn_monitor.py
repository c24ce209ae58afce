"""DINO self-distillation with a ResNet-50 backbone, multi-crop, and a weighted k-NN monitor.

torchrun --nproc_per_node=8 05_dino_knn_monitor.py --data_path /data/imagenet --output_dir out/dino_r50
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torchvision import datasets, models, transforms


def get_args_parser():
    parser = argparse.ArgumentParser("DINO-R50", add_help=True)
    parser.add_argument("--data_path", default="/data/imagenet", type=str)
    parser.add_argument("--output_dir", default=".", type=str)
    parser.add_argument("--out_dim", default=60000, type=int)
    parser.add_argument("--momentum_teacher", default=0.996, type=float)
    parser.add_argument("--warmup_teacher_temp", default=0.04, type=float)
    parser.add_argument("--teacher_temp", default=0.07, type=float)
    parser.add_argument("--warmup_teacher_temp_epochs", default=50, type=int)
    parser.add_argument("--batch_size_per_gpu", default=51, type=int)
    parser.add_argument("--epochs", default=100, type=int)
    parser.add_argument("--lr", default=0.3, type=float, help="peak lr at batch 256 (linear scaling)")
    parser.add_argument("--min_lr", default=0.0048, type=float)
    parser.add_argument("--warmup_epochs", default=10, type=int)
    parser.add_argument("--weight_decay", default=1e-6, type=float)
    parser.add_argument("--global_crops_scale", type=float, nargs="+", default=(0.14, 1.0))
    parser.add_argument("--local_crops_number", type=int, default=6)
    parser.add_argument("--local_crops_scale", type=float, nargs="+", default=(0.05, 0.14))
    parser.add_argument("--num_workers", default=10, type=int)
    parser.add_argument("--knn_freq", default=10, type=int, help="k-NN eval every N epochs")
    parser.add_argument("--knn_k", default=20, type=int)
    parser.add_argument("--knn_subset", default=100, type=int, help="train images per class for the k-NN bank")
    parser.add_argument("--seed", default=0, type=int)
    return parser


class DataAugmentationDINO:
    def __init__(self, global_crops_scale, local_crops_scale, local_crops_number):
        flip_color = transforms.Compose([
            transforms.RandomHorizontalFlip(p=0.5),
            transforms.RandomApply([transforms.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
            transforms.RandomGrayscale(p=0.2),
        ])
        normalize = transforms.Compose([transforms.ToTensor(),
                                        transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
        blur = lambda p: transforms.RandomApply([transforms.GaussianBlur(23, (0.1, 2.0))], p=p)
        self.global1 = transforms.Compose([
            transforms.RandomResizedCrop(224, scale=global_crops_scale, interpolation=Image.BICUBIC),
            flip_color, blur(1.0), normalize])
        self.global2 = transforms.Compose([
            transforms.RandomResizedCrop(224, scale=global_crops_scale, interpolation=Image.BICUBIC),
            flip_color, blur(0.1), transforms.RandomSolarize(128, p=0.2), normalize])
        self.local_crops_number = local_crops_number
        self.local = transforms.Compose([
            transforms.RandomResizedCrop(96, scale=local_crops_scale, interpolation=Image.BICUBIC),
            flip_color, blur(0.5), normalize])

    def __call__(self, image):
        crops = [self.global1(image), self.global2(image)]
        crops += [self.local(image) for _ in range(self.local_crops_number)]
        return crops


class DINOHead(nn.Module):
    def __init__(self, in_dim, out_dim, hidden_dim=2048, bottleneck_dim=256):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(in_dim, hidden_dim), nn.BatchNorm1d(hidden_dim), nn.GELU(),
                                 nn.Linear(hidden_dim, hidden_dim), nn.BatchNorm1d(hidden_dim), nn.GELU(),
                                 nn.Linear(hidden_dim, bottleneck_dim))
        self.last_layer = nn.utils.weight_norm(nn.Linear(bottleneck_dim, out_dim, bias=False))
        self.last_layer.weight_g.data.fill_(1)
        self.last_layer.weight_g.requires_grad = False

    def forward(self, x):
        x = F.normalize(self.mlp(x), dim=-1, p=2)
        return self.last_layer(x)


class MultiCropWrapper(nn.Module):
    """Runs the backbone once per crop resolution and the head once on all features."""

    def __init__(self, backbone, head):
        super().__init__()
        backbone.fc = nn.Identity()
        self.backbone = backbone
        self.head = head

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
    def __init__(self, out_dim, ncrops, warmup_teacher_temp, teacher_temp, warmup_teacher_temp_epochs,
                 nepochs, student_temp=0.1, center_momentum=0.9):
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
        total_loss, n_terms = 0.0, 0
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


def cosine_scheduler(base_value, final_value, epochs, niter_per_ep, warmup_epochs=0):
    warmup_iters = warmup_epochs * niter_per_ep
    warmup = np.linspace(0, base_value, warmup_iters) if warmup_epochs > 0 else np.array([])
    iters = np.arange(epochs * niter_per_ep - warmup_iters)
    schedule = final_value + 0.5 * (base_value - final_value) * (1 + np.cos(np.pi * iters / len(iters)))
    return np.concatenate((warmup, schedule))


class ReturnIndexDataset(datasets.ImageFolder):
    def __getitem__(self, idx):
        img, lab = super().__getitem__(idx)
        return img, idx


@torch.no_grad()
def extract_features(backbone, loader, n):
    features = None
    for samples, index in loader:
        samples, index = samples.cuda(non_blocking=True), index.cuda(non_blocking=True)
        feats = F.normalize(backbone(samples).float(), dim=1)
        if features is None:
            features = torch.zeros(n, feats.shape[-1], device=feats.device)
        # gather from all ranks; DistributedSampler pads, duplicates just overwrite the same rows
        index_all = torch.empty(dist.get_world_size(), index.size(0), dtype=index.dtype, device=index.device)
        dist.all_gather(list(index_all.unbind(0)), index)
        feats_all = torch.empty(dist.get_world_size(), feats.size(0), feats.size(1), device=feats.device)
        dist.all_gather(list(feats_all.unbind(0)), feats)
        features.index_copy_(0, index_all.flatten(), feats_all.flatten(0, 1))
    return features


@torch.no_grad()
def knn_classifier(train_features, train_labels, test_features, test_labels, k, T=0.07, num_classes=1000):
    top1, total = 0.0, 0
    for idx in range(0, test_features.shape[0], 500):
        feats = test_features[idx:idx + 500]
        targets = test_labels[idx:idx + 500]
        similarity = feats @ train_features.t()
        distances, indices = similarity.topk(k, largest=True, sorted=True)
        retrieved = train_labels.view(1, -1).expand(feats.size(0), -1).gather(1, indices)
        one_hot = torch.zeros(feats.size(0) * k, num_classes, device=feats.device)
        one_hot.scatter_(1, retrieved.view(-1, 1), 1)
        probs = (one_hot.view(feats.size(0), -1, num_classes) * distances.div(T).exp_().view(feats.size(0), -1, 1)).sum(1)
        top1 += (probs.argmax(1) == targets).sum().item()
        total += targets.size(0)
    return 100.0 * top1 / total


def build_knn_loaders(args):
    tf = transforms.Compose([transforms.Resize(256, interpolation=Image.BICUBIC), transforms.CenterCrop(224),
                             transforms.ToTensor(),
                             transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    train_ds = ReturnIndexDataset(os.path.join(args.data_path, "train"), transform=tf)
    # fixed per-class subset for the memory bank, identical on every rank
    per_class = {}
    for i, (_, y) in enumerate(train_ds.samples):
        per_class.setdefault(y, []).append(i)
    keep = sorted(i for idxs in per_class.values() for i in idxs[:args.knn_subset])
    train_ds.samples = [train_ds.samples[i] for i in keep]
    train_ds.targets = [train_ds.targets[i] for i in keep]
    val_ds = ReturnIndexDataset(os.path.join(args.data_path, "val"), transform=tf)
    loaders = []
    for ds in (train_ds, val_ds):
        sampler = torch.utils.data.DistributedSampler(ds, shuffle=False)
        loaders.append(torch.utils.data.DataLoader(ds, sampler=sampler, batch_size=128,
                                                   num_workers=args.num_workers, pin_memory=True))
    return loaders[0], loaders[1], train_ds, val_ds


def knn_eval(backbone, args):
    train_loader, val_loader, train_ds, val_ds = build_knn_loaders(args)
    backbone.eval()
    train_feats = extract_features(backbone, train_loader, len(train_ds))
    val_feats = extract_features(backbone, val_loader, len(val_ds))
    train_labels = torch.tensor(train_ds.targets, device=train_feats.device)
    val_labels = torch.tensor(val_ds.targets, device=val_feats.device)
    return knn_classifier(train_feats, train_labels, val_feats, val_labels, args.knn_k)


def main(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed + rank)
    np.random.seed(args.seed + rank)

    transform = DataAugmentationDINO(args.global_crops_scale, args.local_crops_scale, args.local_crops_number)
    dataset = datasets.ImageFolder(os.path.join(args.data_path, "train"), transform=transform)
    sampler = torch.utils.data.DistributedSampler(dataset, shuffle=True)
    data_loader = torch.utils.data.DataLoader(dataset, sampler=sampler, batch_size=args.batch_size_per_gpu,
                                              num_workers=args.num_workers, pin_memory=True, drop_last=True)

    student = MultiCropWrapper(models.resnet50(), DINOHead(2048, args.out_dim))
    teacher = MultiCropWrapper(models.resnet50(), DINOHead(2048, args.out_dim))
    student = nn.SyncBatchNorm.convert_sync_batchnorm(student).cuda()
    teacher = nn.SyncBatchNorm.convert_sync_batchnorm(teacher).cuda()
    student = nn.parallel.DistributedDataParallel(student, device_ids=[local_rank])
    teacher.load_state_dict(student.module.state_dict())
    for p in teacher.parameters():
        p.requires_grad = False

    dino_loss = DINOLoss(args.out_dim, args.local_crops_number + 2, args.warmup_teacher_temp, args.teacher_temp,
                         args.warmup_teacher_temp_epochs, args.epochs).cuda()
    optimizer = torch.optim.SGD(student.parameters(), lr=0, momentum=0.9)

    niter = len(data_loader)
    lr_schedule = cosine_scheduler(args.lr * args.batch_size_per_gpu * world_size / 256.0, args.min_lr,
                                   args.epochs, niter, warmup_epochs=args.warmup_epochs)
    momentum_schedule = cosine_scheduler(args.momentum_teacher, 1, args.epochs, niter)

    ckpt_path = os.path.join(args.output_dir, "checkpoint.pth")
    start_epoch = 0
    if os.path.isfile(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        student.module.load_state_dict(ckpt["student"])
        teacher.load_state_dict(ckpt["teacher"])
        optimizer.load_state_dict(ckpt["optimizer"])
        dino_loss.load_state_dict(ckpt["dino_loss"])
        start_epoch = ckpt["epoch"]

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        student.train()
        teacher.train()
        t0 = time.time()
        for it, (images, _) in enumerate(data_loader):
            it_global = niter * epoch + it
            for g in optimizer.param_groups:
                g["lr"] = lr_schedule[it_global]
                g["weight_decay"] = args.weight_decay
            images = [im.cuda(non_blocking=True) for im in images]
            teacher_output = teacher(images[:2])
            student_output = student(images)
            loss = dino_loss(student_output, teacher_output, epoch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            with torch.no_grad():
                m = momentum_schedule[it_global]
                for ps, pt in zip(student.module.parameters(), teacher.parameters()):
                    pt.mul_(m).add_((1 - m) * ps.detach())
            if rank == 0 and it % 50 == 0:
                print(f"Epoch {epoch} [{it}/{niter}] loss {loss.item():.4f} lr {lr_schedule[it_global]:.4f} "
                      f"m {m:.4f} {time.time() - t0:.0f}s", flush=True)

        if rank == 0:
            os.makedirs(args.output_dir, exist_ok=True)
            torch.save({"student": student.module.state_dict(), "teacher": teacher.state_dict(),
                        "optimizer": optimizer.state_dict(), "dino_loss": dino_loss.state_dict(),
                        "epoch": epoch + 1, "args": args}, ckpt_path)
            if args.knn_freq and (epoch + 1) % args.knn_freq == 0:
                acc = knn_eval(teacher.backbone, args)
                print(f"Epoch {epoch}: teacher k-NN top-1 {acc:.2f}", flush=True)
                teacher.train()

    dist.destroy_process_group()


if __name__ == "__main__":
    main(get_args_parser().parse_args())
