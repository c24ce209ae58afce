"""CoTTA: continual test-time adaptation (Wang et al., CVPR'22) on ImageNet-C, DDP.

The 15 corruptions (severity 5) arrive one after the other without any reset.
Each GPU adapts on its own stream of test batches (batch size per GPU as in the
paper); gradients of the student are averaged across GPUs, the teacher is an EMA
of the student and a small random fraction of weights is restored to the source
weights after every step.

    torchrun --nproc_per_node=4 18_cotta_imagenet_c.py --data /data/ImageNet-C --batch-size 64
"""
import argparse
import copy
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, models

CORRUPTIONS = ["gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "glass_blur",
               "motion_blur", "zoom_blur", "snow", "frost", "fog", "brightness", "contrast",
               "elastic_transform", "pixelate", "jpeg_compression"]


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/ImageNet-C")
    p.add_argument("--severity", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--mt-alpha", type=float, default=0.999)
    p.add_argument("--rst", type=float, default=0.01)
    p.add_argument("--ap", type=float, default=0.1)
    p.add_argument("--n-aug", type=int, default=32)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--log-file", default="logs/cotta_imagenet_c.txt")
    return p.parse_args()


def configure(model):
    model.train()
    model.requires_grad_(True)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.track_running_stats = False
            m.running_mean = None
            m.running_var = None
    return model


def softmax_entropy(x, x_ema):
    return -(x_ema.softmax(1) * x.log_softmax(1)).sum(1)


@torch.no_grad()
def update_ema(ema_model, model, alpha):
    for ema_p, p in zip(ema_model.parameters(), model.parameters()):
        ema_p.mul_(alpha).add_(p, alpha=1 - alpha)


def tta_augment(x):
    """Flip + small affine + colour perturbation, applied batch-wise on the GPU."""
    aug = T.Compose([
        T.RandomHorizontalFlip(),
        T.RandomAffine(degrees=15, translate=(1 / 16, 1 / 16), scale=(0.95, 1.05)),
        T.ColorJitter(brightness=0.2, contrast=0.2, saturation=0.2),
    ])
    return aug(x)


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    # identical on every rank, so the stochastic restore picks the same weights everywhere
    restore_gen = torch.Generator(device=device)
    restore_gen.manual_seed(args.seed)

    net = models.resnet50(weights=models.ResNet50_Weights.IMAGENET1K_V1)
    net = configure(net).to(device)
    source_state = copy.deepcopy(net.state_dict())
    teacher = copy.deepcopy(net)
    anchor = copy.deepcopy(net)
    for m in (teacher, anchor):
        m.requires_grad_(False)
    anchor.eval()

    student = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)

    mean = torch.tensor([0.485, 0.456, 0.406], device=device).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225], device=device).view(1, 3, 1, 1)
    tf = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor()])

    if rank == 0:
        os.makedirs(os.path.dirname(args.log_file) or ".", exist_ok=True)
        log = open(args.log_file, "a")
    errors = []
    for corruption in CORRUPTIONS:
        ds = datasets.ImageFolder(os.path.join(args.data, corruption, str(args.severity)), tf)
        sampler = DistributedSampler(ds, shuffle=True, seed=args.seed)
        loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler,
                            num_workers=args.workers, pin_memory=True)
        correct, total = 0, 0
        t0 = time.time()
        for x, y in loader:
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            xn = (x - mean) / std

            outputs = student(xn)
            with torch.no_grad():
                anchor_prob = anchor(xn).softmax(1).max(1)[0]
                ema_out = teacher(xn)
                if anchor_prob.mean() < args.ap:
                    aug_outs = [teacher((tta_augment(x) - mean) / std) for _ in range(args.n_aug)]
                    ema_out = torch.stack(aug_outs).mean(0)

            loss = softmax_entropy(outputs, ema_out).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            update_ema(teacher, net, args.mt_alpha)

            with torch.no_grad():
                for name, p in net.named_parameters():
                    mask = (torch.rand(p.shape, device=device, generator=restore_gen) < args.rst).float()
                    p.mul_(1.0 - mask).add_(source_state[name] * mask)

            correct += (ema_out.argmax(1) == y).sum().item()
            total += y.numel()

        counts = torch.tensor([correct, total], dtype=torch.float64)
        dist.all_reduce(counts)
        err = 100.0 * (1.0 - counts[0].item() / counts[1].item())
        errors.append(err)
        if rank == 0:
            msg = f"{corruption:<18s} sev {args.severity}: error {err:.2f}% ({time.time() - t0:.0f}s)"
            print(msg, flush=True)
            log.write(msg + "\n")
            log.flush()

    if rank == 0:
        msg = f"mean error over {len(errors)} corruptions: {sum(errors) / len(errors):.2f}%"
        print(msg)
        log.write(msg + "\n")
        log.close()
        torch.save({"student": net.state_dict(), "teacher": teacher.state_dict()},
                   os.path.join(os.path.dirname(args.log_file) or ".", "cotta_final.pth"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
