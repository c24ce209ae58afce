"""Entropy-based active learning over a large unlabelled image pool, ViT-B/16 under FSDP.

The labelled set is a small ImageFolder that grows each round (the queried file
list is written out for the annotation team); the pool is a flat list of images.

    torchrun --standalone --nproc_per_node=8 08_al_vit_fsdp_entropy.py \
        --pool-list /data/webpool/files.txt --labelled-root /data/webpool/labelled \
        --val-root /data/webpool/val --round 3 --out /shared/al/vit_entropy
"""
import argparse
import functools
import json
import os
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from timm.models.vision_transformer import Block
from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pool-list", required=True)
    ap.add_argument("--labelled-root", required=True)
    ap.add_argument("--val-root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--arch", default="vit_base_patch16_224.augreg_in21k")
    ap.add_argument("--query", type=int, default=5000)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=512, help="global")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--round", type=int, required=True, help="index of this AL round")
    return ap.parse_args()


class FileList(Dataset):
    def __init__(self, files, tf):
        self.files, self.tf = files, tf

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        return self.tf(Image.open(self.files[i]).convert("RGB")), i


def build_fsdp(arch, num_classes, local_rank):
    model = timm.create_model(arch, pretrained=True, num_classes=num_classes, drop_path_rate=0.1)
    wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.float32)
    return FSDP(model, auto_wrap_policy=wrap, mixed_precision=mp, device_id=local_rank,
                sharding_strategy=ShardingStrategy.FULL_SHARD, use_orig_params=True)


def gather(t):
    bufs = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(bufs, t)
    return torch.cat(bufs)


@torch.no_grad()
def run_inference(model, ds, device, batch):
    # FSDP all-gathers parameters in every forward, so all ranks must run the same
    # number of batches: DistributedSampler pads, duplicates are dropped by index below
    sampler = DistributedSampler(ds, shuffle=False)
    loader = DataLoader(ds, batch_size=batch, sampler=sampler, num_workers=8, pin_memory=True)
    model.eval()
    logits, ids = [], []
    for x, i in loader:
        logits.append(model(x.to(device, non_blocking=True)).float())
        ids.append(i.to(device))
    logits, ids = gather(torch.cat(logits)), gather(torch.cat(ids))
    _, first = np.unique(ids.cpu().numpy(), return_index=True)
    first = torch.as_tensor(first, device=device)
    return logits[first], ids[first]


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    out_dir = os.path.join(args.out, f"round_{args.round:02d}")
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)

    norm = transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    train_tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                   transforms.RandAugment(2, 9), transforms.ToTensor(), norm])
    eval_tf = transforms.Compose([transforms.Resize(248), transforms.CenterCrop(224), transforms.ToTensor(), norm])
    labelled = datasets.ImageFolder(args.labelled_root, transform=train_tf)
    val = datasets.ImageFolder(args.val_root, transform=eval_tf)
    assert labelled.classes == val.classes
    with open(args.pool_list) as f:
        pool_files = [ln.strip() for ln in f if ln.strip()]
    already = {os.path.basename(p) for p, _ in labelled.samples}
    pool_files = [p for p in pool_files if os.path.basename(p) not in already]

    model = build_fsdp(args.arch, len(labelled.classes), local_rank)
    per_gpu = args.batch_size // world
    sampler = DistributedSampler(labelled, shuffle=True, seed=args.round, drop_last=True)
    loader = DataLoader(labelled, batch_size=per_gpu, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    total = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, total // 10)) * 0.5 * (1 + np.cos(np.pi * s / total)))

    t0 = time.time()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        seen = torch.zeros(2, device=device)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            seen += torch.stack([loss.detach().float() * len(y), torch.tensor(float(len(y)), device=device)])
        dist.all_reduce(seen)
        if rank == 0:
            print(f"epoch {epoch}: loss {(seen[0] / seen[1]).item():.4f} ({time.time() - t0:.0f}s)", flush=True)

    val_logits, val_ids = run_inference(model, val, device, 256)
    targets = torch.as_tensor(val.targets, device=device)[val_ids]
    val_acc = (val_logits.argmax(1) == targets).float().mean().item()

    pool_logits, pool_ids = run_inference(model, FileList(pool_files, eval_tf), device, 256)
    p = pool_logits.softmax(1)
    entropy = -(p * p.clamp_min(1e-12).log()).sum(1)
    top = pool_ids[torch.topk(entropy, min(args.query, len(pool_files))).indices].cpu().tolist()

    if rank == 0:
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            state = model.state_dict()
        torch.save({"model": state, "classes": labelled.classes, "round": args.round},
                   os.path.join(out_dir, "model.pt"))
        with open(os.path.join(out_dir, "to_annotate.txt"), "w") as f:
            f.write("\n".join(pool_files[i] for i in top) + "\n")
        with open(os.path.join(out_dir, "metrics.json"), "w") as f:
            json.dump({"round": args.round, "n_labelled": len(labelled), "val_acc": val_acc,
                       "pool_size": len(pool_files), "mean_entropy": entropy.mean().item()}, f, indent=2)
        print(f"round {args.round}: val acc {val_acc:.4f}, queried {len(top)}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
