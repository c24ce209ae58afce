"""Large CLIP (ViT-L/14 image tower + 12-layer text transformer) with FSDP full sharding.

    srun -N 4 --ntasks-per-node=1 --gpus-per-node=8 torchrun --nnodes=4 --nproc_per_node=8 \
        --rdzv_id=$SLURM_JOB_ID --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 \
        08_clip_fsdp.py --train-shards "/lustre/laion400m/{00000..41407}.tar" --out /lustre/ckpt/clip_l14
"""
import argparse
import functools
import math
import os
import time

import open_clip
import torch
import torch.distributed as dist
import torch.distributed.nn
import torch.nn.functional as F
import webdataset as wds
from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from open_clip.transformer import ResidualAttentionBlock


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-shards", required=True)
    p.add_argument("--train-num-samples", type=int, default=400_000_000)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="ViT-L-14")
    p.add_argument("--batch-size", type=int, default=256, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3, help="peak lr for the global batch of 32768")
    p.add_argument("--wd", type=float, default=0.2)
    p.add_argument("--warmup", type=int, default=5000)
    p.add_argument("--epochs", type=int, default=32)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--save-every-steps", type=int, default=2000)
    p.add_argument("--resume", default=None)
    return p.parse_args()


def make_loader(args, preprocess, tokenizer, world_size):
    global_batch = args.batch_size * world_size
    steps = args.train_num_samples // global_batch
    pipeline = wds.DataPipeline(
        wds.ResampledShards(args.train_shards),
        wds.tarfile_to_samples(handler=wds.warn_and_continue),
        wds.shuffle(5000, initial=1000),
        wds.decode("pilrgb", handler=wds.warn_and_continue),
        wds.rename(image="jpg;png;jpeg;webp", text="txt"),
        wds.map_dict(image=preprocess, text=lambda t: tokenizer([t])[0]),
        wds.to_tuple("image", "text"),
        wds.batched(args.batch_size, partial=False),
    ).with_epoch(steps // args.workers)
    loader = wds.WebLoader(pipeline, batch_size=None, shuffle=False, num_workers=args.workers,
                           persistent_workers=True, pin_memory=True)
    return loader, steps


class ClipLoss(torch.nn.Module):
    def __init__(self, rank, world_size):
        super().__init__()
        self.rank, self.world_size = rank, world_size

    def forward(self, image_features, text_features, logit_scale):
        all_img = torch.cat(torch.distributed.nn.all_gather(image_features), dim=0)
        all_txt = torch.cat(torch.distributed.nn.all_gather(text_features), dim=0)
        logits_per_image = logit_scale * image_features @ all_txt.T
        logits_per_text = logit_scale * text_features @ all_img.T
        n = image_features.shape[0]
        labels = torch.arange(n, device=image_features.device) + n * self.rank
        return (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_text, labels)) / 2


def save_checkpoint(model, step, args, rank):
    if rank == 0:
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            state = model.state_dict()
        path = os.path.join(args.out, f"step_{step:07d}.pt")
        torch.save({"state_dict": state, "step": step}, path + ".tmp")
        os.replace(path + ".tmp", path)
        print(f"saved {path}", flush=True)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(42)

    model, preprocess_train, _ = open_clip.create_model_and_transforms(args.model, pretrained=None)
    tokenizer = open_clip.get_tokenizer(args.model)
    start_step = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["state_dict"])
        start_step = ckpt["step"]

    wrap_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={ResidualAttentionBlock})
    model = FSDP(
        model,
        auto_wrap_policy=wrap_policy,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.float32),
        device_id=torch.cuda.current_device(),
        use_orig_params=True,
        limit_all_gathers=True,
    )

    loader, steps_per_epoch = make_loader(args, preprocess_train, tokenizer, world_size)
    total_steps = steps_per_epoch * args.epochs
    global_batch = args.batch_size * world_size
    peak_lr = args.lr * global_batch / 32768

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "logit_scale" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "logit_scale" in n]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=peak_lr, betas=(0.9, 0.98), eps=1e-6)
    loss_fn = ClipLoss(rank, world_size)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    step = start_step
    model.train()
    t0 = time.time()
    for epoch in range(start_step // steps_per_epoch, args.epochs):
        for images, texts in loader:
            if step >= total_steps:
                break
            if step < args.warmup:
                lr = peak_lr * (step + 1) / args.warmup
            else:
                lr = 0.5 * peak_lr * (1 + math.cos(math.pi * (step - args.warmup) / (total_steps - args.warmup)))
            for g in optimizer.param_groups:
                g["lr"] = lr

            images = images.cuda(non_blocking=True)
            texts = texts.cuda(non_blocking=True)
            image_features, text_features, logit_scale = model(images, texts)
            loss = loss_fn(image_features.float(), text_features.float(), logit_scale.float())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            step += 1

            if step % 50 == 0:
                avg = loss.detach()
                dist.all_reduce(avg, op=dist.ReduceOp.AVG)
                if rank == 0:
                    sps = 50 * global_batch / (time.time() - t0)
                    print(f"epoch {epoch} step {step}/{total_steps} loss {avg.item():.4f} lr {lr:.2e} "
                          f"scale {logit_scale.item():.2f} {sps:.0f} samples/s", flush=True)
                    t0 = time.time()
            if step % args.save_every_steps == 0:
                save_checkpoint(model, step, args, rank)

    save_checkpoint(model, step, args, rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
