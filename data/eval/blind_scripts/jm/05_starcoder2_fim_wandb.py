"""StarCoder2-3B fill-in-the-middle fine-tune on Python + TypeScript, packed to 4k.

torchrun --nproc_per_node=8 05_starcoder2_fim_wandb.py \
    --dataset_name my-org/ts-py-dedup --wandb_project sc2-fim
"""
import argparse
import math
import os
import random
import time

import torch
import torch.distributed as dist
import wandb
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_path", default="bigcode/starcoder2-3b")
    parser.add_argument("--dataset_name", required=True)
    parser.add_argument("--languages", nargs="+", default=["python", "typescript"])
    parser.add_argument("--seq_length", type=int, default=4096)
    parser.add_argument("--fim_rate", type=float, default=0.5)
    parser.add_argument("--per_device_batch", type=int, default=2)
    parser.add_argument("--gradient_accumulation", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=2e-5)
    parser.add_argument("--num_epochs", type=int, default=1)
    parser.add_argument("--warmup_ratio", type=float, default=0.02)
    parser.add_argument("--eval_steps", type=int, default=200)
    parser.add_argument("--save_dir", default="/shared/ckpt/sc2-3b-fim")
    parser.add_argument("--wandb_project", default="sc2-fim")
    parser.add_argument("--run_name", default=None)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def fim_chars(code, rng, fim_rate, tok_prefix, tok_middle, tok_suffix):
    """Character-level FIM split (PSM / SPM chosen 50/50), as in SantaCoder."""
    if rng.random() >= fim_rate or len(code) < 10:
        return code
    a, b = sorted(rng.sample(range(len(code) + 1), 2))
    prefix, middle, suffix = code[:a], code[a:b], code[b:]
    if rng.random() < 0.5:
        return f"{tok_prefix}{prefix}{tok_suffix}{suffix}{tok_middle}{middle}"
    return f"{tok_prefix}{tok_suffix}{suffix}{tok_middle}{prefix}{middle}"


class PackedFIM(Dataset):
    def __init__(self, hf_split, tokenizer, seq_length, fim_rate, seed, languages):
        rng = random.Random(seed)
        eos = tokenizer.eos_token_id
        stream = []
        for ex in hf_split:
            if ex["lang"] not in languages:
                continue
            text = fim_chars(ex["content"], rng, fim_rate, "<fim_prefix>", "<fim_middle>", "<fim_suffix>")
            stream.extend(tokenizer(text, add_special_tokens=False).input_ids)
            stream.append(eos)
        n = len(stream) // seq_length
        self.blocks = torch.tensor(stream[: n * seq_length]).view(n, seq_length)

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        return self.blocks[i]


@torch.no_grad()
def eval_loss(model, loader, device):
    model.eval()
    s = torch.zeros(2, device=device)
    for x in loader:
        x = x.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            s[0] += model(input_ids=x, labels=x).loss.float()
        s[1] += 1
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args))

    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    raw = load_dataset(args.dataset_name)
    langs = set(args.languages)
    train_ds = PackedFIM(raw["train"], tokenizer, args.seq_length, args.fim_rate, args.seed, langs)
    val_ds = PackedFIM(raw["validation"], tokenizer, args.seq_length, args.fim_rate, args.seed + 1, langs)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.per_device_batch, sampler=train_sampler,
                          num_workers=4, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.per_device_batch, sampler=val_sampler, num_workers=2)

    model = AutoModelForCausalLM.from_pretrained(args.model_path, torch_dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model = DDP(model.to(device), device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.1, betas=(0.9, 0.95))
    updates_per_epoch = len(train_dl) // args.gradient_accumulation
    total_updates = updates_per_epoch * args.num_epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_updates), total_updates)

    tokens_per_update = args.per_device_batch * args.gradient_accumulation * args.seq_length * world
    update = 0
    tic = time.time()
    for epoch in range(args.num_epochs):
        train_sampler.set_epoch(epoch)
        acc_loss = torch.zeros((), device=device)
        for i, x in enumerate(train_dl):
            x = x.to(device, non_blocking=True)
            sync_now = (i + 1) % args.gradient_accumulation == 0
            model.require_backward_grad_sync = sync_now
            loss = model(input_ids=x, labels=x).loss / args.gradient_accumulation
            loss.backward()
            acc_loss += loss.detach()
            if not sync_now:
                continue

            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            update += 1

            dist.all_reduce(acc_loss, op=dist.ReduceOp.AVG)
            elapsed = time.time() - tic
            tic = time.time()
            wandb.log({
                "train/loss": acc_loss.item(),
                "train/ppl": math.exp(acc_loss.item()),
                "train/grad_norm": grad_norm.item(),
                "train/lr": scheduler.get_last_lr()[0],
                "perf/tokens_per_sec": tokens_per_update / elapsed,
            }, step=update)
            acc_loss.zero_()

            if update % args.eval_steps == 0:
                vl = eval_loss(model.module, val_dl, device)
                if rank == 0:
                    print(f"update {update}/{total_updates} val_loss {vl:.4f}", flush=True)
                wandb.log({"val/loss": vl, "val/ppl": math.exp(vl)}, step=update)

        if rank == 0:
            out = os.path.join(args.save_dir, f"epoch_{epoch}")
            model.module.save_pretrained(out)
            tokenizer.save_pretrained(out)
        dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
