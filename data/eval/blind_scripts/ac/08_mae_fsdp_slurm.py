"""MAE pretraining (ViT-L/16 encoder) on the unlabeled satellite tile archive, FSDP.

#!/bin/bash
#SBATCH --job-name=mae-vitl-fsdp
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=96
#SBATCH --exclusive
#SBATCH --time=72:00:00
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
srun torchrun --nnodes="$SLURM_NNODES" --nproc_per_node=8 \
    --rdzv_id="$SLURM_JOB_ID" --rdzv_backend=c10d --rdzv_endpoint="$head:29500" \
    mae_fsdp.py --data /lustre/tiles/s2-2023 --out /lustre/$USER/mae-vitl --epochs 400
"""
import argparse
import functools
import math
import os
import time

import torch
import torch.distributed as dist
import torchvision.transforms as T
from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder
from transformers import ViTMAEConfig, ViTMAEForPreTraining
from transformers.models.vit_mae.modeling_vit_mae import ViTMAELayer


def args_():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=400)
    p.add_argument("--warmup-epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=128, help="per GPU")
    p.add_argument("--blr", type=float, default=1.5e-4, help="base lr per 256 images")
    p.add_argument("--mask-ratio", type=float, default=0.75)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--workers", type=int, default=10)
    return p.parse_args()


def lr_at(epoch_f, args, peak):
    if epoch_f < args.warmup_epochs:
        return peak * epoch_f / args.warmup_epochs
    t = (epoch_f - args.warmup_epochs) / (args.epochs - args.warmup_epochs)
    return peak * 0.5 * (1.0 + math.cos(math.pi * t))


def build_model(args):
    cfg = ViTMAEConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                       intermediate_size=4096, image_size=224, patch_size=16,
                       decoder_hidden_size=512, decoder_num_hidden_layers=8,
                       decoder_num_attention_heads=16, decoder_intermediate_size=2048,
                       mask_ratio=args.mask_ratio, norm_pix_loss=True)
    return ViTMAEForPreTraining(cfg)


def save_checkpoint(model, opt, epoch, path):
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        model_state = model.state_dict()
        optim_state = FSDP.optim_state_dict(model, opt)
    torch.save({"model": model_state, "optimizer": optim_state, "epoch": epoch}, path + ".tmp")
    os.replace(path + ".tmp", path)


def main():
    args = args_()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    tf = T.Compose([T.RandomResizedCrop(224, scale=(0.2, 1.0), interpolation=T.InterpolationMode.BICUBIC),
                    T.RandomHorizontalFlip(), T.RandomVerticalFlip(), T.ToTensor(),
                    T.Normalize([0.35, 0.38, 0.33], [0.21, 0.18, 0.17])])
    ds = ImageFolder(args.data, transform=tf)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                    pin_memory=True, drop_last=True, persistent_workers=True, prefetch_factor=4)

    model = build_model(args)
    ckpt_path = os.path.join(args.out, "checkpoint-last.pth")
    start_epoch = 0
    ckpt = None
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        start_epoch = ckpt["epoch"] + 1

    wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={ViTMAELayer})
    model = FSDP(model, auto_wrap_policy=wrap, sharding_strategy=ShardingStrategy.FULL_SHARD,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                buffer_dtype=torch.float32),
                 device_id=local_rank, use_orig_params=True)

    eff_bs = args.batch_size * world
    peak_lr = args.blr * eff_bs / 256
    decay = [p for n, p in model.named_parameters() if p.ndim > 1 and "position_embeddings" not in n]
    other = [p for n, p in model.named_parameters() if not (p.ndim > 1 and "position_embeddings" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": other, "weight_decay": 0.0}],
                            lr=peak_lr, betas=(0.9, 0.95))
    if ckpt is not None:
        osd = FSDP.optim_state_dict_to_load(model, opt, ckpt["optimizer"])
        opt.load_state_dict(osd)
        del ckpt

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world {world}, eff batch {eff_bs}, peak lr {peak_lr:.2e}, {len(dl)} it/epoch", flush=True)

    n_iter = len(dl)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_acc = torch.zeros(2, device=device)
        for i, (x, _) in enumerate(dl):
            lr = lr_at(epoch + i / n_iter, args, peak_lr)
            for g in opt.param_groups:
                g["lr"] = lr
            x = x.to(device, non_blocking=True)
            loss = model(pixel_values=x).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_acc += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            if i % 100 == 0 and rank == 0:
                print(f"ep {epoch} [{i}/{n_iter}] loss {loss.item():.4f} lr {lr:.2e}", flush=True)

        dist.all_reduce(loss_acc)
        if rank == 0:
            print(f"epoch {epoch} mean loss {(loss_acc[0] / loss_acc[1]).item():.4f} "
                  f"time {time.time() - t0:.0f}s", flush=True)

        if (epoch + 1) % args.save_every == 0 or epoch + 1 == args.epochs:
            if rank == 0:
                save_checkpoint(model, opt, epoch, ckpt_path)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
