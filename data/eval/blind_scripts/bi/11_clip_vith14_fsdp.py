"""CLIP ViT-H/14 pre-training with FSDP (full sharding, bf16) on webdataset shards.

Multi-node:
    torchrun --nnodes 4 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $HEAD:29400 \
        11_clip_vith14_fsdp.py --shards "/lustre/laion2b/{000000..231349}.tar" --samples-per-epoch 200000000
"""
import argparse
import functools
import math
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
import webdataset as wds
from torch.distributed.fsdp import (FullStateDictConfig, FullyShardedDataParallel as FSDP,
                                    MixedPrecision, ShardingStrategy, StateDictType)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

import open_clip
from open_clip.transformer import ResidualAttentionBlock


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--shards", required=True)
    p.add_argument("--samples-per-epoch", type=int, required=True)
    p.add_argument("--model", default="ViT-H-14")
    p.add_argument("--batch-size", type=int, default=160)
    p.add_argument("--epochs", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--wd", type=float, default=0.2)
    p.add_argument("--warmup", type=int, default=10000)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--ckpt-dir", default="/lustre/exp/clip_vith14_fsdp")
    p.add_argument("--log-every", type=int, default=50)
    return p.parse_args()


def to_tokens(text, tokenizer):
    return tokenizer([text])[0]


def build_loader(args, preprocess, tokenizer, world_size):
    ds = wds.DataPipeline(
        wds.ResampledShards(args.shards),
        wds.tarfile_to_samples(handler=wds.warn_and_continue),
        wds.shuffle(10000, initial=2000),
        wds.decode("pilrgb", handler=wds.warn_and_continue),
        wds.rename(image="jpg;png;webp", text="txt"),
        wds.map_dict(image=preprocess, text=functools.partial(to_tokens, tokenizer=tokenizer)),
        wds.to_tuple("image", "text"),
        wds.batched(args.batch_size, partial=False),
    )
    batches = args.samples_per_epoch // (args.batch_size * world_size)
    per_worker = math.ceil(batches / args.workers)
    ds = ds.with_epoch(per_worker)
    loader = wds.WebLoader(ds, batch_size=None, shuffle=False, num_workers=args.workers,
                           pin_memory=True, persistent_workers=True)
    return loader, per_worker * args.workers


def contrastive_loss(img, txt, scale):
    rank = dist.get_rank()
    all_img = torch.cat(dist_nn.all_gather(img))
    all_txt = torch.cat(dist_nn.all_gather(txt))
    labels = torch.arange(img.shape[0], device=img.device) + rank * img.shape[0]
    return 0.5 * (F.cross_entropy(scale * img @ all_txt.t(), labels)
                  + F.cross_entropy(scale * txt @ all_img.t(), labels))


def save_full_checkpoint(model, path, rank):
    if rank == 0:
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            state = model.state_dict()
        torch.save(state, path)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    model, preprocess, _ = open_clip.create_model_and_transforms(args.model)
    tokenizer = open_clip.get_tokenizer(args.model)

    wrap_policy = functools.partial(transformer_auto_wrap_policy,
                                    transformer_layer_cls={ResidualAttentionBlock})
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                        buffer_dtype=torch.float32)
    model = FSDP(model, auto_wrap_policy=wrap_policy, mixed_precision=mp,
                 sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=local_rank,
                 use_orig_params=True, limit_all_gathers=True)

    no_wd = lambda n, p: p.ndim < 2 or "logit_scale" in n or "positional_embedding" in n \
        or "class_embedding" in n
    optimizer = torch.optim.AdamW(
        [{"params": [p for n, p in model.named_parameters() if not no_wd(n, p)], "weight_decay": args.wd},
         {"params": [p for n, p in model.named_parameters() if no_wd(n, p)], "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.98), eps=1e-6)

    loader, steps_per_epoch = build_loader(args, preprocess, tokenizer, world_size)
    total = steps_per_epoch * args.epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / args.warmup,
                                 0.5 * (1 + math.cos(math.pi * min(1.0, s / total)))))

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        print(f"world {world_size}, global batch {args.batch_size * world_size}, "
              f"{steps_per_epoch} steps/epoch", flush=True)

    step = 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for i, (images, texts) in enumerate(loader):
            images = images.to(device, non_blocking=True)
            texts = texts.to(device, non_blocking=True)
            img, txt, scale = model(images, texts)
            loss = contrastive_loss(img.float(), txt.float(), scale.float())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = model.clip_grad_norm_(1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if rank == 0 and i % args.log_every == 0:
                sps = (i + 1) * args.batch_size * world_size / (time.time() - t0)
                print(f"ep {epoch} {i}/{steps_per_epoch} loss {loss.item():.4f} "
                      f"scale {scale.item():.1f} gnorm {gnorm.item():.2f} {sps:.0f} img/s", flush=True)

        save_full_checkpoint(model, os.path.join(args.ckpt_dir, f"epoch_{epoch + 1}.pt"), rank)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
