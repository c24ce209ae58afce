"""Step-based LM pretraining from streamed parquet shards (Hugging Face datasets).

Launch:
    torchrun --nnodes=1 --nproc_per_node=8 03_hf_streaming_llama.py --config configs/llama_350m.yaml

Every rank streams its own slice of the shards (split_dataset_by_node), so there is no
sampler. Dataloader position is saved per rank so a run can be resumed mid-epoch on
the same number of GPUs.
"""
import argparse
import math
import os
import time
from itertools import chain

import torch
import torch.distributed as dist
import wandb
import yaml
from datasets import load_dataset
from datasets.distributed import split_dataset_by_node
from torch.nn.parallel import DistributedDataParallel as DDP
from torchdata.stateful_dataloader import StatefulDataLoader
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

DEFAULTS = dict(
    train_files="/datasets/fineweb-edu/sample-10BT/*.parquet",
    val_files="/datasets/fineweb-edu/val/*.parquet",
    tokenizer="meta-llama/Llama-2-7b-hf",
    seq_len=2048,
    micro_batch=4,
    global_batch=256,
    lr=3e-4,
    min_lr=3e-5,
    warmup=1000,
    max_steps=50_000,
    shuffle_buffer=10_000,
    num_workers=4,
    eval_every=1000,
    eval_steps=25,
    save_every=1000,
    ckpt_dir="/shared/ckpt/llama350m",
    seed=42,
    wandb_project="llama-350m",
)


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--resume", action="store_true")
    a = ap.parse_args()
    cfg = dict(DEFAULTS)
    if a.config:
        with open(a.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    cfg["resume"] = a.resume
    return argparse.Namespace(**cfg)


def build_stream(files, tokenizer, cfg, rank, world_size, shuffle):
    ds = load_dataset("parquet", data_files=files, split="train", streaming=True)
    if shuffle:
        # same seed on every rank -> same shard permutation, then each rank takes its part
        ds = ds.shuffle(seed=cfg.seed, buffer_size=cfg.shuffle_buffer)
    ds = split_dataset_by_node(ds, rank=rank, world_size=world_size)

    def tokenize(examples):
        ids = tokenizer(examples["text"], add_special_tokens=False)["input_ids"]
        return {"input_ids": [x + [tokenizer.eos_token_id] for x in ids]}

    def pack(examples):
        flat = list(chain.from_iterable(examples["input_ids"]))
        n = (len(flat) // cfg.seq_len) * cfg.seq_len
        return {"input_ids": [flat[i:i + cfg.seq_len] for i in range(0, n, cfg.seq_len)]}

    ds = ds.map(tokenize, batched=True, remove_columns=ds.column_names)
    ds = ds.map(pack, batched=True, batch_size=1000)
    return ds.with_format("torch")


def cosine_lr(step, cfg):
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = min(1.0, (step - cfg.warmup) / max(1, cfg.max_steps - cfg.warmup))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * t))


@torch.no_grad()
def run_eval(model, loader, steps, device):
    model.eval()
    total = torch.zeros(2, device=device)
    it = iter(loader)
    for _ in range(steps):
        try:
            batch = next(it)
        except StopIteration:
            break
        ids = batch["input_ids"].to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        total += torch.stack([loss.float() * ids.size(0), torch.tensor(float(ids.size(0)), device=device)])
    dist.all_reduce(total)
    model.train()
    return (total[0] / total[1].clamp(min=1)).item()


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)

    grad_accum = cfg.global_batch // (cfg.micro_batch * world_size)
    assert grad_accum * cfg.micro_batch * world_size == cfg.global_batch, "global_batch not divisible"

    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer)
    train_ds = build_stream(cfg.train_files, tokenizer, cfg, rank, world_size, shuffle=True)
    val_ds = build_stream(cfg.val_files, tokenizer, cfg, rank, world_size, shuffle=False)
    train_loader = StatefulDataLoader(train_ds, batch_size=cfg.micro_batch,
                                      num_workers=cfg.num_workers, pin_memory=True)
    val_loader = StatefulDataLoader(val_ds, batch_size=cfg.micro_batch, num_workers=2)

    mcfg = LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=1024, intermediate_size=2816,
                       num_hidden_layers=24, num_attention_heads=16,
                       max_position_embeddings=cfg.seq_len)
    model = LlamaForCausalLM(mcfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                                  weight_decay=0.1, fused=True)

    step, epoch = 0, 0
    if cfg.resume and os.path.exists(os.path.join(cfg.ckpt_dir, "latest.pt")):
        ckpt = torch.load(os.path.join(cfg.ckpt_dir, "latest.pt"), map_location="cpu")
        if ckpt["world_size"] != world_size:
            raise RuntimeError(f"checkpoint was written with {ckpt['world_size']} ranks, "
                               f"this run has {world_size}; per-rank data state cannot be reused")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        step = ckpt["step"]
        data_state = torch.load(os.path.join(cfg.ckpt_dir, f"data_rank{rank}.pt"))
        train_loader.load_state_dict(data_state["loader"])
        epoch = data_state["epoch"]

    model = DDP(model, device_ids=[local_rank])

    if rank == 0:
        wandb.init(project=cfg.wandb_project, config=vars(cfg), resume="allow")

    def train_batches():
        # every rank rolls over to the next epoch on its own; no collective is tied to it
        nonlocal epoch
        while True:
            train_ds.set_epoch(epoch)
            for b in train_loader:
                yield b
            epoch += 1

    batches = train_batches()
    model.train()
    t0 = time.time()
    while step < cfg.max_steps:
        lr = cosine_lr(step, cfg)
        for g in optimizer.param_groups:
            g["lr"] = lr
        loss_sum = torch.zeros((), device=device)
        for micro in range(grad_accum):
            ids = next(batches)["input_ids"].to(device, non_blocking=True)
            last = micro == grad_accum - 1
            with (model.no_sync() if not last else torch.enable_grad()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(input_ids=ids, labels=ids).loss / grad_accum
                loss.backward()
            loss_sum += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1

        if step % 10 == 0:
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
            if rank == 0:
                elapsed, t0 = time.time() - t0, time.time()
                wandb.log({"train/loss": loss_sum.item(), "train/lr": lr,
                           "train/grad_norm": grad_norm.item(), "train/epoch": epoch,
                           "perf/tokens_per_s": 10 * cfg.global_batch * cfg.seq_len / elapsed},
                          step=step)

        if step % cfg.eval_every == 0:
            val_loss = run_eval(model.module, val_loader, cfg.eval_steps, device)
            if rank == 0:
                wandb.log({"val/loss": val_loss, "val/ppl": math.exp(val_loss)}, step=step)

        if step % cfg.save_every == 0:
            os.makedirs(cfg.ckpt_dir, exist_ok=True)
            # each rank has its own position in its own slice of the stream
            torch.save({"loader": train_loader.state_dict(), "epoch": epoch},
                       os.path.join(cfg.ckpt_dir, f"data_rank{rank}.pt"))
            if rank == 0:
                tmp = os.path.join(cfg.ckpt_dir, "latest.pt.tmp")
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "step": step, "world_size": world_size}, tmp)
                os.replace(tmp, os.path.join(cfg.ckpt_dir, "latest.pt"))
            dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
