"""BERT-base MLM pretraining (phase 1, seq 128) with DDP and torch.compile (max-autotune, no cudagraphs).

All sequences are exactly 128 tokens, so the compiled graph is fully static and
Inductor's autotuned GEMM choices are reused for every step.

    torchrun --nproc_per_node=8 bert_mlm_compile.py --data /shared/wiki_books_128 --out /shared/bert_base_p1
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
from datasets import load_from_disk
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import BertConfig, BertForMaskedLM, BertTokenizerFast, DataCollatorForLanguageModeling


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokenizer", default="bert-base-uncased")
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=256, help="per GPU")
    parser.add_argument("--lr", type=float, default=6e-4, help="for the global batch of 2048")
    parser.add_argument("--warmup-ratio", type=float, default=0.06)
    parser.add_argument("--max-steps", type=int, default=100_000)
    parser.add_argument("--eval-every", type=int, default=2000)
    parser.add_argument("--save-every", type=int, default=10_000)
    parser.add_argument("--compile-mode", default="max-autotune-no-cudagraphs")
    return parser.parse_args()


def linear_warmup_decay(step, total, warmup):
    if step < warmup:
        return step / max(1, warmup)
    return max(0.0, (total - step) / max(1, total - warmup))


@torch.no_grad()
def evaluate(model, loader, device, max_batches=200):
    model.eval()
    s = torch.zeros(3, device=device)
    for i, batch in enumerate(loader):
        if i == max_batches:
            break
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           token_type_ids=batch["token_type_ids"]).logits
        mask = batch["labels"] != -100
        s[0] += torch.nn.functional.cross_entropy(logits[mask].float(), batch["labels"][mask], reduction="sum")
        s[1] += (logits[mask].argmax(-1) == batch["labels"][mask]).sum()
        s[2] += mask.sum()
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[2]).item(), (s[1] / s[2]).item()


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    device = torch.device("cuda", args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)
    torch.backends.cuda.matmul.allow_tf32 = True

    tokenizer = BertTokenizerFast.from_pretrained(args.tokenizer)
    ds = load_from_disk(args.data).with_format("torch", columns=["input_ids", "token_type_ids", "attention_mask"])
    train_ds, val_ds = ds["train"], ds["validation"]
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=0.15)

    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=1234, drop_last=True)
    val_sampler = DistributedSampler(val_ds, num_replicas=world, rank=rank, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, collate_fn=collator,
                          num_workers=8, pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler, collate_fn=collator,
                        num_workers=4, pin_memory=True, drop_last=True)

    config = BertConfig.from_pretrained("bert-base-uncased", vocab_size=len(tokenizer))
    model = BertForMaskedLM(config).to(device)
    raw_model = model
    model = DDP(model, device_ids=[args.local_rank], gradient_as_bucket_view=True)
    model = torch.compile(model, mode=args.compile_mode)

    decay = [p for n, p in raw_model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in raw_model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.98), eps=1e-6, fused=True)
    warmup = int(args.warmup_ratio * args.max_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: linear_warmup_decay(s, args.max_steps, warmup))

    step, epoch = 0, 0
    tic = time.time()
    done = False
    while not done:
        train_sampler.set_epoch(epoch)
        for batch in train_dl:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(raw_model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    seqs = 100 * args.batch_size * world / (time.time() - tic)
                    print(f"step {step} loss {l.item():.4f} lr {scheduler.get_last_lr()[0]:.3e} {seqs:.0f} seq/s",
                          flush=True)
                tic = time.time()

            if step % args.eval_every == 0:
                val_loss, val_acc = evaluate(model, val_dl, device)
                if rank == 0:
                    print(f"step {step} val loss {val_loss:.4f} ppl {math.exp(val_loss):.2f} mlm acc {val_acc:.4f}",
                          flush=True)

            if step % args.save_every == 0 or step == args.max_steps:
                if rank == 0:
                    path = os.path.join(args.out, f"step_{step}")
                    raw_model.save_pretrained(path)
                    tokenizer.save_pretrained(path)
                    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                                "step": step, "epoch": epoch}, os.path.join(path, "trainer_state.pt"))
                dist.barrier()

            if step == args.max_steps:
                done = True
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
