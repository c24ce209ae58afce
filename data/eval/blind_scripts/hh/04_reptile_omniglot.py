#!/usr/bin/env python3
"""Reptile (Nichol et al. 2018) on Omniglot, data-parallel over tasks.

There is no DDP wrapper here: every rank adapts a copy of the meta-parameters to
its own tasks, the parameter deltas are summed with one all_reduce, and every rank
applies the same meta-update, so the meta-parameters stay identical everywhere.

    torchrun --nproc_per_node=4 04_reptile_omniglot.py --data /data/omniglot --shots 1 --ways 5
"""
import argparse
import copy
import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image

logger = logging.getLogger("reptile")


def get_config():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/omniglot")
    p.add_argument("--ckpt-dir", default="ckpt/reptile_omniglot")
    p.add_argument("--ways", type=int, default=5)
    p.add_argument("--shots", type=int, default=1)
    p.add_argument("--train-shots", type=int, default=10, help="images per class seen in the inner loop")
    p.add_argument("--inner-batch", type=int, default=10)
    p.add_argument("--inner-iters", type=int, default=5)
    p.add_argument("--inner-lr", type=float, default=1e-3)
    p.add_argument("--meta-step", type=float, default=1.0)
    p.add_argument("--meta-step-final", type=float, default=0.0)
    p.add_argument("--meta-batch", type=int, default=8, help="tasks per meta-update, all ranks together")
    p.add_argument("--meta-iters", type=int, default=100000)
    p.add_argument("--eval-every", type=int, default=1000)
    p.add_argument("--eval-tasks", type=int, default=400, help="all ranks together")
    p.add_argument("--eval-inner-iters", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def load_omniglot(root):
    """Returns a list of [20, 1, 28, 28] tensors, one per character (both background and evaluation)."""
    chars = []
    for split in ("images_background", "images_evaluation"):
        for alphabet in sorted(os.listdir(os.path.join(root, split))):
            adir = os.path.join(root, split, alphabet)
            for char in sorted(os.listdir(adir)):
                cdir = os.path.join(adir, char)
                imgs = []
                for f in sorted(os.listdir(cdir)):
                    im = Image.open(os.path.join(cdir, f)).convert("L").resize((28, 28), Image.LANCZOS)
                    imgs.append(torch.from_numpy(1.0 - np.asarray(im, dtype=np.float32) / 255.0))
                chars.append(torch.stack(imgs).unsqueeze(1))
    return chars


def rotations(chars):
    return [torch.rot90(c, k, dims=(2, 3)) for c in chars for k in range(4)]


def sample_task(chars, ways, shots, rng):
    cls = rng.sample(range(len(chars)), ways)
    xs, ys = [], []
    for label, c in enumerate(cls):
        idx = rng.sample(range(chars[c].size(0)), shots)
        xs.append(chars[c][idx])
        ys.append(torch.full((shots,), label, dtype=torch.long))
    return torch.cat(xs), torch.cat(ys)


class OmniglotNet(nn.Module):
    def __init__(self, ways, hid=64):
        super().__init__()
        layers, cin = [], 1
        for _ in range(4):
            # transductive BN: batch statistics only, so no running buffers drift apart between ranks
            layers += [nn.Conv2d(cin, hid, 3, stride=2, padding=1),
                       nn.BatchNorm2d(hid, track_running_stats=False),
                       nn.ReLU()]
            cin = hid
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(hid * 2 * 2, ways)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def adapt(model, x, y, iters, batch, lr, rng):
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.0, 0.999))
    n = x.size(0)
    for _ in range(iters):
        idx = torch.tensor(rng.sample(range(n), min(batch, n)), device=x.device)
        loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()


@torch.no_grad()
def flat_params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def evaluate(meta_model, chars, cfg, n_tasks, rng, device):
    correct = torch.zeros(2, device=device)
    for _ in range(n_tasks):
        x, y = sample_task(chars, cfg.ways, cfg.shots + 1, rng)
        x, y = x.to(device), y.to(device)
        # last image of every class is the query
        q_mask = torch.zeros_like(y, dtype=torch.bool)
        q_mask[cfg.shots::cfg.shots + 1] = True
        learner = copy.deepcopy(meta_model)
        adapt(learner, x[~q_mask], y[~q_mask], cfg.eval_inner_iters, cfg.inner_batch, cfg.inner_lr, rng)
        with torch.no_grad():
            # query scored together with the support batch, as in the original transductive setup
            pred = learner(x).argmax(1)
        correct[0] += (pred[q_mask] == y[q_mask]).sum()
        correct[1] += q_mask.sum()
    dist.all_reduce(correct)
    return (correct[0] / correct[1]).item()


def main():
    cfg = get_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    assert cfg.meta_batch % world == 0, "meta-batch must split evenly over ranks"
    tasks_per_rank = cfg.meta_batch // world

    # the character split must be identical on all ranks: fixed seed, independent of rank
    chars = load_omniglot(cfg.data)
    random.Random(cfg.seed).shuffle(chars)
    train_chars = rotations(chars[:1200])
    test_chars = rotations(chars[1200:])
    logger.info("%d train / %d test classes (with rotations)", len(train_chars), len(test_chars))

    # task sampling is meant to differ between ranks
    task_rng = random.Random(cfg.seed * 1000 + rank)
    torch.manual_seed(cfg.seed)

    model = OmniglotNet(cfg.ways).to(device)
    for p in model.parameters():
        dist.broadcast(p.data, src=0)

    start = 0
    ckpt_path = os.path.join(cfg.ckpt_dir, "latest.pt")
    if os.path.exists(ckpt_path):
        state = torch.load(ckpt_path, map_location=device)
        model.load_state_dict(state["model"])
        start = state["iteration"] + 1
        logger.info("resumed from iteration %d", start)

    for it in range(start, cfg.meta_iters):
        frac = it / cfg.meta_iters
        meta_step = frac * cfg.meta_step_final + (1 - frac) * cfg.meta_step
        base = flat_params(model)
        delta = torch.zeros_like(base)
        for _ in range(tasks_per_rank):
            learner = copy.deepcopy(model)
            x, y = sample_task(train_chars, cfg.ways, cfg.train_shots, task_rng)
            adapt(learner, x.to(device), y.to(device), cfg.inner_iters, cfg.inner_batch, cfg.inner_lr, task_rng)
            delta += flat_params(learner) - base
        dist.all_reduce(delta)
        delta /= cfg.meta_batch
        with torch.no_grad():
            offset = 0
            for p in model.parameters():
                n = p.numel()
                p.add_(meta_step * delta[offset:offset + n].view_as(p))
                offset += n

        if (it + 1) % cfg.eval_every == 0:
            eval_rng = random.Random(cfg.seed * 7919 + rank)
            train_acc = evaluate(model, train_chars, cfg, cfg.eval_tasks // world, eval_rng, device)
            test_acc = evaluate(model, test_chars, cfg, cfg.eval_tasks // world, eval_rng, device)
            if rank == 0:
                logger.info("iter %d meta_step %.3f train %.4f test %.4f", it + 1, meta_step, train_acc, test_acc)
                os.makedirs(cfg.ckpt_dir, exist_ok=True)
                tmp = ckpt_path + ".tmp"
                torch.save({"model": model.state_dict(), "iteration": it, "config": vars(cfg)}, tmp)
                os.replace(tmp, ckpt_path)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
