"""Fine-tune a code LM on the internal monorepo dump, streamed from S3 (jsonl.zst shards).

    torchrun --nnodes=2 --nproc-per-node=8 --max-restarts=2 --rdzv-backend=c10d \
        --rdzv-endpoint=$HEAD:29500 --rdzv-id=$SLURM_JOB_ID train_code_lm.py \
        --shards s3://ml-corpora/monorepo/2024-06/ --out /shared/code-lm/run7
"""
import argparse
import io
import json
import math
import os
import random
import time

import boto3
import torch
import torch.distributed as dist
import torch.nn.functional as F
import wandb
import zstandard as zstd
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from transformers import AutoModelForCausalLM, AutoTokenizer


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--shards", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="bigcode/starcoderbase-1b")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--est-steps-per-epoch", type=int, default=20000, help="for the LR schedule")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--project", default="code-lm")
    return p.parse_args()


def list_shards(url):
    bucket, prefix = url[len("s3://"):].split("/", 1)
    s3 = boto3.client("s3")
    keys = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys += [o["Key"] for o in page.get("Contents", []) if o["Key"].endswith(".jsonl.zst")]
    return bucket, sorted(keys)


class S3PackedStream(IterableDataset):
    """Streams documents from this rank's shards, tokenizes and packs them into fixed windows."""

    def __init__(self, bucket, keys, tokenizer, seq_len, rank, world, seed=0):
        self.bucket, self.tokenizer, self.seq_len = bucket, tokenizer, seq_len
        self.keys = keys[rank::world]
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _docs(self, key):
        body = boto3.client("s3").get_object(Bucket=self.bucket, Key=key)["Body"]
        reader = io.TextIOWrapper(zstd.ZstdDecompressor().stream_reader(body), encoding="utf-8")
        for line in reader:
            yield json.loads(line)["content"]

    def __iter__(self):
        keys = list(self.keys)
        random.Random(self.seed + self.epoch).shuffle(keys)
        info = get_worker_info()
        if info is not None:
            keys = keys[info.id::info.num_workers]
        buf, eos = [], self.tokenizer.eos_token_id
        for key in keys:
            for doc in self._docs(key):
                buf.extend(self.tokenizer(doc, add_special_tokens=False)["input_ids"] + [eos])
                while len(buf) > self.seq_len:
                    window, buf = buf[: self.seq_len + 1], buf[self.seq_len:]
                    yield torch.tensor(window, dtype=torch.long)


def lm_loss(model, batch):
    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    bucket, keys = list_shards(args.shards)
    if rank == 0:
        print(f"{len(keys)} shards, {len(keys) // world} per rank", flush=True)
    train_stream = S3PackedStream(bucket, keys, tokenizer, args.seq_len, rank, world)
    loader = DataLoader(train_stream, batch_size=args.batch_size, num_workers=4, pin_memory=True,
                        prefetch_factor=8)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32).to(device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    total = args.epochs * args.est_steps_per_epoch

    def lr_lambda(s):
        if s < args.warmup:
            return (s + 1) / args.warmup
        return max(0.1, 0.5 * (1 + math.cos(math.pi * min(1.0, (s - args.warmup) / (total - args.warmup)))))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)

    ckpt = os.path.join(args.out, "last.pt")
    start_epoch, step = 0, 0
    if os.path.exists(ckpt):
        st = torch.load(ckpt, map_location="cpu")
        model.module.load_state_dict(st["model"])
        optimizer.load_state_dict(st["optimizer"])
        scheduler.load_state_dict(st["scheduler"])
        start_epoch, step = st["epoch"] + 1, st["step"]
        del st

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project=args.project, config=vars(args) | {"world_size": world, "n_shards": len(keys)},
                   resume="allow", id=os.path.basename(args.out.rstrip("/")))

    for epoch in range(start_epoch, args.epochs):
        train_stream.set_epoch(epoch)
        t0, tokens = time.time(), 0
        for batch in loader:
            batch = batch.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = lm_loss(model, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            tokens += batch.numel()
            if step % args.log_every == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"loss": l.item(), "gnorm": gnorm.item(), "lr": scheduler.get_last_lr()[0],
                               "tok_per_s_per_gpu": tokens / (time.time() - t0)}, step=step)

        dist.barrier()
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch, "step": step}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
            model.module.save_pretrained(os.path.join(args.out, f"epoch{epoch}"))
            print(f"epoch {epoch} done at step {step}", flush=True)
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
