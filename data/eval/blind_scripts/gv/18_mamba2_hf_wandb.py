"""
Mamba-2 (transformers Mamba2ForCausalLM, fused SSD kernels from mamba_ssm) pretraining on
a packed code corpus, with Weights & Biases tracking.

    torchrun --nproc_per_node=8 18_mamba2_hf_wandb.py --dataset /data/the_stack_py_packed_4k \
        --wandb_project mamba2-code --run_name m2-780m-4k
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import wandb
from datasets import load_from_disk
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import Mamba2Config, Mamba2ForCausalLM, get_cosine_schedule_with_warmup


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", required=True)
    p.add_argument("--wandb_project", default="mamba2-code")
    p.add_argument("--run_name", default=None)
    p.add_argument("--hidden_size", type=int, default=1536)
    p.add_argument("--num_hidden_layers", type=int, default=48)
    p.add_argument("--state_size", type=int, default=128)
    p.add_argument("--vocab_size", type=int, default=49152)
    p.add_argument("--per_device_batch", type=int, default=8)
    p.add_argument("--grad_accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup_steps", type=int, default=2000)
    p.add_argument("--max_steps", type=int, default=50000)
    p.add_argument("--eval_steps", type=int, default=1000)
    p.add_argument("--save_steps", type=int, default=5000)
    p.add_argument("--output_dir", default="outputs/mamba2_code")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def collate(examples):
    ids = torch.tensor([ex["input_ids"] for ex in examples], dtype=torch.long)
    return {"input_ids": ids, "labels": ids}


@torch.no_grad()
def evaluate(model, loader, device, max_batches=100):
    model.eval()
    tot = torch.zeros(2, device=device, dtype=torch.float64)
    for i, batch in enumerate(loader):
        if i >= max_batches:
            break
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch).loss
        tot[0] += loss.double()
        tot[1] += 1
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    run = wandb.init(project=args.wandb_project, name=args.run_name,
                     config={**vars(args), "world_size": world_size})

    data = load_from_disk(args.dataset)
    train_set, eval_set = data["train"], data["test"]
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    eval_sampler = DistributedSampler(eval_set, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.per_device_batch, sampler=train_sampler,
                              collate_fn=collate, num_workers=4, pin_memory=True, drop_last=True)
    eval_loader = DataLoader(eval_set, batch_size=args.per_device_batch, sampler=eval_sampler,
                             collate_fn=collate, num_workers=2)

    config = Mamba2Config(hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers,
                          state_size=args.state_size, vocab_size=args.vocab_size, expand=2,
                          head_dim=64, num_heads=2 * args.hidden_size // 64,
                          n_groups=1, chunk_size=256, tie_word_embeddings=True, use_cache=False)
    model = Mamba2ForCausalLM(config).to(device)
    model = DDP(model, device_ids=[local_rank])

    no_decay = ("bias", "norm", "A_log", "D", "dt_bias")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)],
         "weight_decay": 0.1},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=True)
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, args.max_steps)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        config.save_pretrained(args.output_dir)

    step, epoch, micro = 0, 0, 0
    t_last = time.time()
    model.train()
    while step < args.max_steps:
        train_sampler.set_epoch(epoch)
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            micro += 1
            boundary = micro % args.grad_accum == 0
            model.require_backward_grad_sync = boundary
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            (loss / args.grad_accum).backward()
            if not boundary:
                continue

            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % 10 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                now = time.time()
                tokens = 10 * args.grad_accum * args.per_device_batch * batch["input_ids"].size(1) * world_size
                wandb.log({"train/loss": l.item(), "train/grad_norm": grad_norm.item(),
                           "train/lr": scheduler.get_last_lr()[0],
                           "perf/tokens_per_sec": tokens / (now - t_last), "epoch": epoch}, step=step)
                t_last = now

            if step % args.eval_steps == 0:
                eval_loss = evaluate(model, eval_loader, device)
                wandb.log({"eval/loss": eval_loss, "eval/ppl": math.exp(eval_loss)}, step=step)
                if rank == 0:
                    print(f"step {step}: eval loss {eval_loss:.4f}", flush=True)

            if step % args.save_steps == 0 and rank == 0:
                save_dir = os.path.join(args.output_dir, f"checkpoint-{step}")
                model.module.save_pretrained(save_dir)
                torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                            "step": step}, os.path.join(save_dir, "optim.pt"))

            if step >= args.max_steps:
                break
        epoch += 1

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.output_dir, "final"))
    run.finish()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
