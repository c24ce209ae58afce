"""TENT: fully test-time adaptation by entropy minimisation (Wang et al., ICLR'21).

Adapts a CIFAR-10 pretrained WideResNet-28-10 online on CIFAR-10-C, one corruption
after the other, updating only the BatchNorm affine parameters.  Uses every GPU on
the box through nn.DataParallel.

    python 02_tent_cifar10c.py --data data/CIFAR-10-C --ckpt ckpt/wrn28_10_cifar10.pt
"""
import argparse
import json
import logging
import os
import time
from copy import deepcopy

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

CORRUPTIONS = [
    "gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "glass_blur",
    "motion_blur", "zoom_blur", "snow", "frost", "fog", "brightness", "contrast",
    "elastic_transform", "pixelate", "jpeg_compression",
]

log = logging.getLogger("tent")


# --------------------------------------------------------------------------- model
class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride, drop=0.0):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.drop = drop
        self.equal = cin == cout
        self.short = None if self.equal else nn.Conv2d(cin, cout, 1, stride, 0, bias=False)

    def forward(self, x):
        o = F.relu(self.bn1(x))
        y = self.conv1(o)
        y = F.relu(self.bn2(y))
        if self.drop > 0:
            y = F.dropout(y, p=self.drop, training=self.training)
        y = self.conv2(y)
        return y + (x if self.equal else self.short(o))


class WideResNet(nn.Module):
    def __init__(self, depth=28, widen=10, num_classes=10):
        super().__init__()
        n = (depth - 4) // 6
        w = [16, 16 * widen, 32 * widen, 64 * widen]
        self.conv1 = nn.Conv2d(3, w[0], 3, 1, 1, bias=False)
        layers = []
        for i, stride in enumerate([1, 2, 2]):
            for j in range(n):
                layers.append(BasicBlock(w[i] if j == 0 else w[i + 1], w[i + 1], stride if j == 0 else 1))
        self.blocks = nn.Sequential(*layers)
        self.bn = nn.BatchNorm2d(w[3])
        self.fc = nn.Linear(w[3], num_classes)

    def forward(self, x):
        x = self.blocks(self.conv1(x))
        x = F.relu(self.bn(x))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)


# --------------------------------------------------------------------------- tent
def softmax_entropy(logits):
    return -(logits.softmax(1) * logits.log_softmax(1)).sum(1)


class Tent(nn.Module):
    """Wraps a model so that every forward also takes one adaptation step."""

    def __init__(self, model, optimizer, steps=1, episodic=False):
        super().__init__()
        self.model = model
        self.optimizer = optimizer
        self.steps = steps
        self.episodic = episodic
        self.model_state = deepcopy(model.state_dict())
        self.optimizer_state = deepcopy(optimizer.state_dict())

    def forward(self, x):
        if self.episodic:
            self.reset()
        for _ in range(self.steps):
            outputs = self.forward_and_adapt(x)
        return outputs

    @torch.enable_grad()
    def forward_and_adapt(self, x):
        outputs = self.model(x)
        loss = softmax_entropy(outputs).mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return outputs

    def reset(self):
        self.model.load_state_dict(self.model_state, strict=True)
        self.optimizer.load_state_dict(self.optimizer_state)


def configure_model(model):
    model.train()
    model.requires_grad_(False)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.requires_grad_(True)
            # use test-batch statistics only
            m.track_running_stats = False
            m.running_mean = None
            m.running_var = None
    return model


def collect_bn_params(model):
    params = []
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            params += [m.weight, m.bias]
    return params


# --------------------------------------------------------------------------- data
def load_cifar10c(root, corruption, severity, n_examples=10000):
    x = np.load(os.path.join(root, f"{corruption}.npy"))
    y = np.load(os.path.join(root, "labels.npy"))
    lo, hi = (severity - 1) * 10000, severity * 10000
    x = torch.from_numpy(x[lo:hi][:n_examples]).permute(0, 3, 1, 2).float().div(255.0)
    y = torch.from_numpy(y[lo:hi][:n_examples]).long()
    return TensorDataset(x, y)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data/CIFAR-10-C")
    p.add_argument("--ckpt", default="ckpt/wrn28_10_cifar10.pt")
    p.add_argument("--severity", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--episodic", action="store_true")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--out", default="results/tent_cifar10c.json")
    return p.parse_args()


def main():
    args = get_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.backends.cudnn.benchmark = True

    base = WideResNet()
    state = torch.load(args.ckpt, map_location="cpu")
    base.load_state_dict(state.get("model", state))
    base = configure_model(base).cuda()
    optimizer = torch.optim.Adam(collect_bn_params(base), lr=args.lr, betas=(0.9, 0.999))
    tent = Tent(base, optimizer, steps=args.steps, episodic=args.episodic)
    if torch.cuda.device_count() > 1:
        log.info("using %d GPUs", torch.cuda.device_count())
        tent = nn.DataParallel(tent)
    tent_core = tent.module if isinstance(tent, nn.DataParallel) else tent

    mean = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1).cuda()
    std = torch.tensor([0.2471, 0.2435, 0.2616]).view(1, 3, 1, 1).cuda()

    results = {}
    for corruption in CORRUPTIONS:
        if not args.episodic:
            # continual across corruptions is a different protocol; reset per domain
            tent_core.reset()
        ds = load_cifar10c(args.data, corruption, args.severity)
        loader = DataLoader(ds, batch_size=args.batch_size, shuffle=False,
                            num_workers=args.workers, pin_memory=True)
        correct, seen = 0, 0
        t0 = time.time()
        for x, y in loader:
            x = (x.cuda(non_blocking=True) - mean) / std
            y = y.cuda(non_blocking=True)
            logits = tent(x)
            correct += (logits.argmax(1) == y).sum().item()
            seen += y.numel()
        err = 100.0 * (1.0 - correct / seen)
        results[corruption] = err
        log.info("%-18s severity %d  error %.2f%%  (%.1fs)", corruption, args.severity,
                 err, time.time() - t0)

    mean_err = sum(results.values()) / len(results)
    log.info("mean error %.2f%%", mean_err)
    results["mean"] = mean_err
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
