"""
Continued pretraining of TrOCR-large on our 40M synthetic + scanned line corpus with FSDP
(full sharding, bf16).  Validation is teacher-forced loss / token accuracy; beam-search CER is
done offline by the eval service on the exported checkpoint.

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29400 \
        18_trocr_large_fsdp.py --shards "/lustre/ocr/wds/train-{000000..003999}.tar" \
        --val-shards "/lustre/ocr/wds/val-{000000..000063}.tar" --out /lustre/ocr/runs/trocr_large_cpt
"""
import argparse
import functools
import io
import math
import os
import time

import torch
import torch.distributed as dist
import webdataset as wds
from PIL import Image
from torch.distributed.fsdp import (FullStateDictConfig, FullyShardedDataParallel as FSDP, MixedPrecision,
                                    ShardingStrategy, StateDictType)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from transformers import TrOCRProcessor, VisionEncoderDecoderModel
from transformers.models.trocr.modeling_trocr import TrOCRDecoderLayer
from transformers.models.vit.modeling_vit import ViTLayer


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--init", default="microsoft/trocr-large-stage1")
    p.add_argument("--shards", required=True)
    p.add_argument("--val-shards", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--micro-bs", type=int, default=16)
    p.add_argument("--max-steps", type=int, default=200_000)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--warmup", type=int, default=4000)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--val-every", type=int, default=5000)
    p.add_argument("--val-batches", type=int, default=50)
    p.add_argument("--save-every", type=int, default=10000)
    return p.parse_args()


def make_loader(urls, processor, args, train):
    tok = processor.tokenizer

    def preprocess(sample):
        img = Image.open(io.BytesIO(sample["png"])).convert("RGB")
        text = sample["txt"].decode("utf-8").strip()
        pixel_values = processor(images=img, return_tensors="pt").pixel_values[0]
        ids = tok(text, max_length=args.max_len, truncation=True, padding="max_length").input_ids
        labels = torch.tensor([i if i != tok.pad_token_id else -100 for i in ids])
        return pixel_values, labels

    ds = wds.WebDataset(urls, resampled=train, shardshuffle=train, nodesplitter=wds.split_by_node)
    if train:
        ds = ds.shuffle(5000)
    ds = ds.map(preprocess).batched(args.micro_bs, partial=False)
    # resampled shards make the train stream infinite, so every rank always has a next batch
    return wds.WebLoader(ds, batch_size=None, num_workers=8, pin_memory=True)


def lr_lambda(step, warmup, total):
    if step < warmup:
        return step / max(1, warmup)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


@torch.no_grad()
def validate(model, processor, args, device):
    model.eval()
    stats = torch.zeros(3, device=device)  # loss_sum, correct tokens, tokens
    val_loader = make_loader(args.val_shards, processor, args, train=False)
    it = iter(val_loader)
    for _ in range(args.val_batches):
        # a fixed number of batches on every rank; val shards are large enough for all of them
        pixel_values, labels = next(it)
        pixel_values, labels = pixel_values.to(device), labels.to(device)
        out = model(pixel_values=pixel_values, labels=labels)
        valid = labels != -100
        stats[0] += out.loss.float() * valid.sum()
        stats[1] += ((out.logits.argmax(-1) == labels) & valid).sum()
        stats[2] += valid.sum()
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def save_full(model, path, rank):
    if rank == 0:
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            state = model.state_dict()
        torch.save(state, path)
        print(f"saved {path}", flush=True)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    processor = TrOCRProcessor.from_pretrained(args.init)
    model = VisionEncoderDecoderModel.from_pretrained(args.init)
    tok = processor.tokenizer
    model.config.decoder_start_token_id = tok.cls_token_id if tok.cls_token_id is not None else tok.bos_token_id
    model.config.pad_token_id = tok.pad_token_id
    model.config.vocab_size = model.config.decoder.vocab_size

    wrap_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={ViTLayer, TrOCRDecoderLayer})
    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    model = FSDP(model, auto_wrap_policy=wrap_policy, mixed_precision=bf16,
                 sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=device,
                 limit_all_gathers=True, use_orig_params=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05, betas=(0.9, 0.98))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_lambda(s, args.warmup, args.max_steps))
    train_loader = make_loader(args.shards, processor, args, train=True)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        n_params = sum(p.numel() for p in model.parameters()) * world
        print(f"FSDP over {world} ranks, ~{n_params / 1e6:.0f}M params", flush=True)

    model.train()
    step, t0 = 0, time.time()
    for pixel_values, labels in train_loader:
        pixel_values = pixel_values.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        loss = model(pixel_values=pixel_values, labels=labels).loss
        loss.backward()
        model.clip_grad_norm_(1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1

        if step % 50 == 0:
            l = loss.detach().clone()
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"step {step} loss {l.item():.4f} lr {scheduler.get_last_lr()[0]:.2e} "
                      f"{(time.time() - t0) / 50:.2f}s/step", flush=True)
                t0 = time.time()
        if step % args.val_every == 0:
            vloss, vacc = validate(model, processor, args, device)
            if rank == 0:
                print(f"step {step} val loss {vloss:.4f} token acc {vacc:.4f}", flush=True)
        if step % args.save_every == 0:
            save_full(model, os.path.join(args.out, f"step_{step}.pt"), rank)
        if step >= args.max_steps:
            break

    save_full(model, os.path.join(args.out, "final.pt"), rank)
    if rank == 0:
        processor.save_pretrained(os.path.join(args.out, "processor"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
