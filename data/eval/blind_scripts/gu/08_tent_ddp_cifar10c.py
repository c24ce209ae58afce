"""TENT test-time adaptation on CIFAR-10-C, spread over several GPUs with DDP.

Each rank streams its own slice of every corruption.  Only the BatchNorm affine
parameters are trainable, so DDP registers (and all-reduces) just those.  BN layers
are converted to SyncBatchNorm and keep no running statistics, so the normalisation
uses the statistics of the whole global test batch, as in single-GPU TENT.

    torchrun --nproc_per_node=4 08_tent_ddp_cifar10c.py --data data/CIFAR-10-C \
        --ckpt ckpt/Standard.pt --batch-size 50
"""
import argparse
import copy
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from robustbench.model_zoo.architectures.wide_resnet import WideResNet

CORRUPTIONS = ("gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "glass_blur",
               "motion_blur", "zoom_blur", "snow", "frost", "fog", "brightness", "contrast",
               "elastic_transform", "pixelate", "jpeg_compression")


class CorruptionSet(Dataset):
    def __init__(self, root, corruption, severity):
        x = np.load(os.path.join(root, corruption + ".npy"), mmap_mode="r")
        y = np.load(os.path.join(root, "labels.npy"))
        sl = slice((severity - 1) * 10000, severity * 10000)
        self.x = x[sl]
        self.y = torch.from_numpy(y[sl].astype(np.int64))

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        img = torch.from_numpy(np.ascontiguousarray(self.x[i])).permute(2, 0, 1).float() / 255.0
        return img, self.y[i], i


def entropy(logits):
    return -(logits.softmax(1) * logits.log_softmax(1)).sum(1)


def prepare_tent(model):
    """Freeze everything but BN affine params; BN normalises with batch statistics."""
    model.train()
    model.requires_grad_(False)
    for m in model.modules():
        if isinstance(m, _BatchNorm):
            m.weight.requires_grad_(True)
            m.bias.requires_grad_(True)
            m.track_running_stats = False
            m.running_mean = None
            m.running_var = None
            m.num_batches_tracked = None
    return model


def run_corruption(ddp_model, optimizer, loader, device, n_total, steps):
    rank_idx, rank_hit = [], []
    for x, y, idx in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        for _ in range(steps):
            logits = ddp_model(x)
            loss = entropy(logits).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        rank_idx.append(idx.to(device))
        rank_hit.append((logits.detach().argmax(1) == y).to(torch.uint8))
    rank_idx = torch.cat(rank_idx)
    rank_hit = torch.cat(rank_hit)

    # DistributedSampler pads every rank to the same length, so the gathered tensors
    # have equal shapes; duplicated (padded) indices are counted once.
    world = dist.get_world_size()
    g_idx = [torch.empty_like(rank_idx) for _ in range(world)]
    g_hit = [torch.empty_like(rank_hit) for _ in range(world)]
    dist.all_gather(g_idx, rank_idx)
    dist.all_gather(g_hit, rank_hit)
    hit = torch.zeros(n_total, dtype=torch.uint8, device=device)
    hit[torch.cat(g_idx)] = torch.cat(g_hit)
    return 100.0 * (1.0 - hit.float().mean().item())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/CIFAR-10-C")
    ap.add_argument("--ckpt", default="ckpt/Standard.pt")
    ap.add_argument("--severity", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=50, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default="results/tent_ddp.json")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    net = WideResNet(depth=28, widen_factor=10, num_classes=10)
    sd = torch.load(args.ckpt, map_location="cpu")
    net.load_state_dict(sd["state_dict"] if "state_dict" in sd else sd)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    net = prepare_tent(net).to(device)
    init_state = copy.deepcopy(net.state_dict())

    params = [p for p in net.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=args.lr, betas=(0.9, 0.999))
    init_opt_state = copy.deepcopy(optimizer.state_dict())
    ddp_model = DDP(net, device_ids=[local_rank])

    results = {}
    for corruption in CORRUPTIONS:
        # episodic per corruption: start every domain from the source model
        net.load_state_dict(init_state)
        optimizer.load_state_dict(init_opt_state)

        ds = CorruptionSet(args.data, corruption, args.severity)
        sampler = DistributedSampler(ds, shuffle=False)
        loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler,
                            num_workers=args.workers, pin_memory=True)
        t0 = time.time()
        err = run_corruption(ddp_model, optimizer, loader, device, len(ds), args.steps)
        results[corruption] = err
        if rank == 0:
            print(f"{corruption:<18s} sev {args.severity}: error {err:.2f}% ({time.time() - t0:.1f}s)",
                  flush=True)

    if rank == 0:
        results["mean"] = float(np.mean([results[c] for c in CORRUPTIONS]))
        print(f"mean error {results['mean']:.2f}%")
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
