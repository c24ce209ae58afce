"""AugMix with the Jensen-Shannon consistency loss on CIFAR-10, evaluated on CIFAR-10-C.

    torchrun --nproc_per_node=4 17_augmix_jsd.py --data ./data --cifar-c ./data/CIFAR-10-C
"""
import argparse
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image, ImageOps
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

CORRUPTIONS = ["gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "glass_blur",
               "motion_blur", "zoom_blur", "snow", "frost", "fog", "brightness", "contrast",
               "elastic_transform", "pixelate", "jpeg_compression"]
MEAN, STD = [0.5] * 3, [0.5] * 3


def autocontrast(img, _):
    return ImageOps.autocontrast(img)


def equalize(img, _):
    return ImageOps.equalize(img)


def posterize(img, level):
    return ImageOps.posterize(img, 4 - int(level * 4 / 10))


def rotate(img, level):
    deg = level * 30 / 10 * np.random.choice([-1, 1])
    return img.rotate(deg, resample=Image.BILINEAR)


def solarize(img, level):
    return ImageOps.solarize(img, 256 - int(level * 256 / 10))


def shear_x(img, level):
    s = level * 0.3 / 10 * np.random.choice([-1, 1])
    return img.transform(img.size, Image.AFFINE, (1, s, 0, 0, 1, 0), resample=Image.BILINEAR)


def translate_y(img, level):
    t = int(level * img.size[1] / 3 / 10) * np.random.choice([-1, 1])
    return img.transform(img.size, Image.AFFINE, (1, 0, 0, 0, 1, t), resample=Image.BILINEAR)


AUGMENTATIONS = [autocontrast, equalize, posterize, rotate, solarize, shear_x, translate_y]


class AugMixDataset(Dataset):
    """Returns (clean, augmix_1, augmix_2), label."""

    def __init__(self, base, preprocess, severity=3, width=3, depth=-1, alpha=1.0):
        self.base, self.preprocess = base, preprocess
        self.severity, self.width, self.depth, self.alpha = severity, width, depth, alpha

    def __len__(self):
        return len(self.base)

    def augmix(self, img):
        ws = np.float32(np.random.dirichlet([self.alpha] * self.width))
        m = np.float32(np.random.beta(self.alpha, self.alpha))
        mix = torch.zeros_like(self.preprocess(img))
        for i in range(self.width):
            aug = img.copy()
            d = self.depth if self.depth > 0 else np.random.randint(1, 4)
            for _ in range(d):
                aug = np.random.choice(AUGMENTATIONS)(aug, self.severity)
            mix += ws[i] * self.preprocess(aug)
        return (1 - m) * self.preprocess(img) + m * mix

    def __getitem__(self, i):
        img, y = self.base[i]
        return (self.preprocess(img), self.augmix(img), self.augmix(img)), y


def jsd_loss(logits_clean, logits_aug1, logits_aug2):
    p_clean = F.softmax(logits_clean, dim=1)
    p_aug1 = F.softmax(logits_aug1, dim=1)
    p_aug2 = F.softmax(logits_aug2, dim=1)
    p_mixture = torch.clamp((p_clean + p_aug1 + p_aug2) / 3.0, 1e-7, 1).log()
    return (F.kl_div(p_mixture, p_clean, reduction="batchmean")
            + F.kl_div(p_mixture, p_aug1, reduction="batchmean")
            + F.kl_div(p_mixture, p_aug2, reduction="batchmean")) / 3.0


@torch.no_grad()
def test(net, loader, device):
    net.eval()
    s = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        s[0] += (net(x).argmax(1) == y).sum()
        s[1] += y.numel()
    dist.all_reduce(s)
    return (s[0] / s[1]).item()


def build_model(arch):
    net = getattr(torchvision.models, arch)(num_classes=10)
    # CIFAR stem: 3x3 conv, no max-pool
    net.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    net.maxpool = nn.Identity()
    return net


def cifar_c_loaders(root, rank, world, tf):
    labels = torch.from_numpy(np.load(os.path.join(root, "labels.npy"))).long()
    for name in CORRUPTIONS:
        x = np.load(os.path.join(root, name + ".npy"))  # (5 * 10000, 32, 32, 3) uint8
        x = torch.from_numpy(x).permute(0, 3, 1, 2).float().div(255)
        x = tf(x)
        ds = TensorDataset(x, labels)
        yield name, DataLoader(Subset(ds, range(rank, len(ds), world)), batch_size=1000)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="./data")
    ap.add_argument("--cifar-c", default="./data/CIFAR-10-C")
    ap.add_argument("--arch", default="resnet18", choices=["resnet18", "resnet50"])
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=128, help="per GPU")
    ap.add_argument("--lr", type=float, default=0.1, help="per 128 images")
    ap.add_argument("--jsd-weight", type=float, default=12.0)
    ap.add_argument("--save", default="./snapshots/augmix")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    preprocess = transforms.Compose([transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    train_base = torchvision.datasets.CIFAR10(
        args.data, train=True,
        transform=transforms.Compose([transforms.RandomHorizontalFlip(), transforms.RandomCrop(32, padding=4)]))
    train_set = AugMixDataset(train_base, preprocess)
    test_set = torchvision.datasets.CIFAR10(args.data, train=False, transform=preprocess)
    sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=8, pin_memory=True, drop_last=True)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)), batch_size=1000)

    net = build_model(args.arch).to(device)
    model = DDP(net, device_ids=[local_rank])

    lr = args.lr * args.batch_size * world / 128
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    total = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.5 * (1 + np.cos(s / total * np.pi)))

    if rank == 0:
        os.makedirs(args.save, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        agg = torch.zeros(2, device=device)
        for (x_clean, x_aug1, x_aug2), y in train_loader:
            x_clean = x_clean.to(device, non_blocking=True)
            x_aug1 = x_aug1.to(device, non_blocking=True)
            x_aug2 = x_aug2.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)

            logits_clean = model(x_clean)
            logits_aug1 = model(x_aug1)
            logits_aug2 = model(x_aug2)
            loss = F.cross_entropy(logits_clean, y)
            loss = loss + args.jsd_weight * jsd_loss(logits_clean, logits_aug1, logits_aug2)

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            agg += torch.stack([loss.detach(), torch.ones((), device=device)])

        dist.all_reduce(agg)
        acc = test(net, test_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: loss {(agg[0] / agg[1]).item():.4f} clean acc {100 * acc:.2f}")
            torch.save({"epoch": epoch, "state_dict": net.state_dict(),
                        "optimizer": optimizer.state_dict()},
                       os.path.join(args.save, "checkpoint.pth.tar"))

    errs = []
    norm = transforms.Normalize(MEAN, STD)
    for name, loader in cifar_c_loaders(args.cifar_c, rank, world, norm):
        err = 1 - test(net, loader, device)
        errs.append(err)
        if rank == 0:
            print(f"{name}: error {100 * err:.2f}")
    if rank == 0:
        print(f"mean corruption error: {100 * np.mean(errs):.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
