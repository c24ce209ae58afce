"""FixMatch on CIFAR-10 with 250 labels, using Hugging Face Accelerate.

Labelled and unlabelled loaders have very different lengths, so training is
driven by a fixed number of steps per epoch and both iterators are restarted
when exhausted.  Works on 1..N GPUs:

    accelerate launch --multi_gpu --num_processes 4 --mixed_precision bf16 fixmatch_accelerate.py
"""
import argparse
import math
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset, Subset

logger = get_logger(__name__)
MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2471, 0.2435, 0.2616)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="./data")
    p.add_argument("--out", default="./fixmatch_out")
    p.add_argument("--n-labeled", type=int, default=250)
    p.add_argument("--epochs", type=int, default=256)
    p.add_argument("--steps-per-epoch", type=int, default=1024)
    p.add_argument("--bs", type=int, default=64, help="labelled batch per process")
    p.add_argument("--mu", type=int, default=7)
    p.add_argument("--lr", type=float, default=0.03)
    p.add_argument("--tau", type=float, default=0.95)
    p.add_argument("--lambda-u", type=float, default=1.0)
    p.add_argument("--ema", type=float, default=0.999)
    p.add_argument("--resume", default=None)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class TwoViews(Dataset):
    def __init__(self, base, weak, strong):
        self.base, self.weak, self.strong = base, weak, strong

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        img, _ = self.base[i]
        return self.weak(img), self.strong(img)


def build_model():
    m = torchvision.models.resnet18(num_classes=10)
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m


def cycle(loader):
    while True:
        for batch in loader:
            yield batch


def main():
    args = get_args()
    accelerator = Accelerator(project_dir=args.out, log_with="tensorboard")
    set_seed(args.seed)
    accelerator.init_trackers("fixmatch", config=vars(args))

    weak = T.Compose([T.RandomHorizontalFlip(), T.RandomCrop(32, 4, padding_mode="reflect"),
                      T.ToTensor(), T.Normalize(MEAN, STD)])
    strong = T.Compose([T.RandomHorizontalFlip(), T.RandomCrop(32, 4, padding_mode="reflect"),
                        T.RandAugment(2, 10), T.ToTensor(), T.Normalize(MEAN, STD),
                        T.RandomErasing(p=1.0, scale=(0.02, 0.15))])
    test_tf = T.Compose([T.ToTensor(), T.Normalize(MEAN, STD)])

    with accelerator.main_process_first():
        raw = torchvision.datasets.CIFAR10(args.data, train=True, download=True)
        test_set = torchvision.datasets.CIFAR10(args.data, train=False, download=True, transform=test_tf)

    # labelled split from a fixed RNG, identical in every process
    rng = np.random.RandomState(args.seed)
    y = np.array(raw.targets)
    lab_idx = np.concatenate([rng.choice(np.where(y == c)[0], args.n_labeled // 10, replace=False)
                              for c in range(10)])
    # repeat the few labelled images so one epoch of the labelled loader covers
    # steps_per_epoch global batches (as in the reference implementation)
    n_expand = math.ceil(args.bs * accelerator.num_processes * args.steps_per_epoch / len(lab_idx))
    lab_idx = np.tile(lab_idx, n_expand)
    labeled = Subset(torchvision.datasets.CIFAR10(args.data, train=True, transform=weak), lab_idx)
    unlabeled = TwoViews(raw, weak, strong)

    # drop_last on both: every process gets full batches
    lab_loader = DataLoader(labeled, batch_size=args.bs, shuffle=True, num_workers=4, drop_last=True)
    unl_loader = DataLoader(unlabeled, batch_size=args.bs * args.mu, shuffle=True,
                            num_workers=8, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=512, num_workers=4)

    model = build_model()
    if accelerator.num_processes > 1:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    ema_model = torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(args.ema), use_buffers=True)

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if "bn" in n or n.endswith("bias") else decay).append(p)
    opt = torch.optim.SGD([{"params": decay, "weight_decay": 5e-4},
                           {"params": no_decay, "weight_decay": 0.0}],
                          lr=args.lr, momentum=0.9, nesterov=True)
    total = args.epochs * args.steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: math.cos(7 * math.pi * s / (16 * total)))

    model, opt, lab_loader, unl_loader, test_loader = accelerator.prepare(
        model, opt, lab_loader, unl_loader, test_loader)
    ema_model.to(accelerator.device)
    accelerator.register_for_checkpointing(sched, ema_model)

    start_epoch = 0
    if args.resume:
        accelerator.load_state(args.resume)
        start_epoch = int(os.path.basename(args.resume.rstrip("/")).split("_")[-1]) + 1

    lab_iter, unl_iter = cycle(lab_loader), cycle(unl_loader)
    best = 0.0
    for epoch in range(start_epoch, args.epochs):
        model.train()
        for step in range(args.steps_per_epoch):
            x, yl = next(lab_iter)
            uw, us = next(unl_iter)
            inputs = torch.cat([x, uw, us])
            with accelerator.autocast():
                logits = model(inputs)
            logits = logits.float()
            lx = logits[: x.size(0)]
            lw, ls = logits[x.size(0):].chunk(2)
            sup = F.cross_entropy(lx, yl)
            probs = lw.detach().softmax(1)
            conf, pseudo = probs.max(1)
            mask = (conf >= args.tau).float()
            unsup = (F.cross_entropy(ls, pseudo, reduction="none") * mask).mean()
            loss = sup + args.lambda_u * unsup

            opt.zero_grad()
            accelerator.backward(loss)
            opt.step()
            sched.step()
            ema_model.update_parameters(accelerator.unwrap_model(model))

            if step % 200 == 0:
                stats = accelerator.reduce(torch.stack([sup.detach(), unsup.detach(), mask.mean()]),
                                           reduction="mean")
                accelerator.log({"loss/sup": stats[0].item(), "loss/unsup": stats[1].item(),
                                 "mask_rate": stats[2].item(), "lr": sched.get_last_lr()[0]},
                                step=epoch * args.steps_per_epoch + step)

        ema_model.eval()
        correct = count = 0
        with torch.no_grad():
            for xt, yt in test_loader:
                pred = ema_model(xt).argmax(1)
                pred, yt = accelerator.gather_for_metrics((pred, yt))
                correct += (pred == yt).sum().item()
                count += yt.numel()
        acc = correct / count
        logger.info(f"epoch {epoch}: ema test acc {acc:.4f}", main_process_only=True)
        accelerator.log({"test/ema_acc": acc}, step=(epoch + 1) * args.steps_per_epoch)

        accelerator.save_state(os.path.join(args.out, f"epoch_{epoch}"))
        if acc > best:
            best = acc
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                torch.save(ema_model.module.state_dict(), os.path.join(args.out, "best_ema.pt"))

    accelerator.end_training()


if __name__ == "__main__":
    main()
