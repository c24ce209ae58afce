"""RoBERTa-base MLM pretraining from a pre-tokenized HF dataset saved with save_to_disk().

Logs to Weights & Biases.

    torchrun --nproc_per_node=8 10_roberta_mlm_wandb.py \
        --dataset /data/cc_news_roberta_512 --tokenizer roberta-base --run_name rb-ccnews-8gpu
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
from transformers import (
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    RobertaConfig,
    RobertaForMaskedLM,
    get_polynomial_decay_schedule_with_warmup,
)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", required=True)
    p.add_argument("--tokenizer", default="roberta-base")
    p.add_argument("--output_dir", default="checkpoints/roberta")
    p.add_argument("--run_name", default=None)
    p.add_argument("--wandb_project", default="roberta-pretrain")
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--grad_accum", type=int, default=8)
    p.add_argument("--peak_lr", type=float, default=6e-4)
    p.add_argument("--warmup_steps", type=int, default=24000)
    p.add_argument("--max_steps", type=int, default=500000)
    p.add_argument("--log_every", type=int, default=50)
    p.add_argument("--eval_every", type=int, default=5000)
    p.add_argument("--save_every", type=int, default=10000)
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args()


def setup():
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    return dist.get_rank(), dist.get_world_size(), local_rank


@torch.no_grad()
def run_eval(model, loader, device):
    model.eval()
    loss_sum = torch.zeros(1, device=device)
    n = torch.zeros(1, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**batch)
        masked = (batch["labels"] != -100).sum()
        loss_sum += out.loss.float() * masked
        n += masked
    dist.all_reduce(loss_sum)
    dist.all_reduce(n)
    model.train()
    return (loss_sum / n).item()


def main():
    args = parse_args()
    rank, world, local_rank = setup()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    run = wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args),
                     resume="allow")

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    ds = load_from_disk(args.dataset)
    ds.set_format(type="torch", columns=["input_ids", "attention_mask"])
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=0.15)

    train_sampler = DistributedSampler(ds["train"], shuffle=True, seed=args.seed)
    train_loader = DataLoader(ds["train"], batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collator, num_workers=8, pin_memory=True, drop_last=True)
    val_loader = DataLoader(ds["validation"], batch_size=args.batch_size,
                            sampler=DistributedSampler(ds["validation"], shuffle=False),
                            collate_fn=collator, num_workers=2)

    config = RobertaConfig(vocab_size=len(tokenizer), max_position_embeddings=514, type_vocab_size=1,
                           hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                           intermediate_size=3072, layer_norm_eps=1e-5,
                           pad_token_id=tokenizer.pad_token_id)
    model = RobertaForMaskedLM(config).to(device)
    model = DDP(model, device_ids=[local_rank])

    no_decay = ["bias", "LayerNorm.weight"]
    params = [
        {"params": [p for n, p in model.named_parameters() if not any(x in n for x in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(x in n for x in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(params, lr=args.peak_lr, betas=(0.9, 0.98), eps=1e-6)
    scheduler = get_polynomial_decay_schedule_with_warmup(optimizer, args.warmup_steps, args.max_steps)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"global batch: {args.batch_size * args.grad_accum * world} sequences")

    step, epoch, micro = 0, 0, 0
    loss_window = 0.0
    t_last = time.time()
    model.train()
    while step < args.max_steps:
        train_sampler.set_epoch(epoch)
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            micro += 1
            boundary = micro % args.grad_accum == 0
            if boundary:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(**batch).loss / args.grad_accum
                loss.backward()
            else:
                with model.no_sync():
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss = model(**batch).loss / args.grad_accum
                    loss.backward()
            loss_window += loss.item()
            if not boundary:
                continue

            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % args.log_every == 0:
                elapsed = time.time() - t_last
                t_last = time.time()
                seqs = args.log_every * args.batch_size * args.grad_accum * world
                metrics = {"train/loss": loss_window / args.log_every,
                           "train/grad_norm": grad_norm.item(),
                           "train/lr": scheduler.get_last_lr()[0],
                           "perf/seq_per_s": seqs / elapsed,
                           "epoch": epoch}
                run.log(metrics, step=step)
                loss_window = 0.0
                if rank == 0:
                    print(f"step {step} " + " ".join(f"{k}={v:.4g}" for k, v in metrics.items()))

            if step % args.eval_every == 0:
                val_loss = run_eval(model, val_loader, device)
                run.log({"val/loss": val_loss, "val/ppl": math.exp(val_loss)}, step=step)

            if step % args.save_every == 0 and rank == 0:
                save_dir = os.path.join(args.output_dir, f"step-{step}")
                model.module.save_pretrained(save_dir)
                tokenizer.save_pretrained(save_dir)
                torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                            "step": step, "epoch": epoch}, os.path.join(save_dir, "trainer_state.pt"))
            if step >= args.max_steps:
                break
        epoch += 1

    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
