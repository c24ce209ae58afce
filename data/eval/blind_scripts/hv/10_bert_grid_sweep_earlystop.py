"""Grid sweep (lr x weight decay x warmup) for BERT-base fine-tuning on MNLI.

Every grid point is a trial trained in the same process group; a trial stops
when the matched-dev loss has not improved for `--patience` evaluations.
The best checkpoint of each trial is kept under --out/<trial>/.

    torchrun --standalone --nproc_per_node=4 10_bert_grid_sweep_earlystop.py --out sweeps/mnli
"""
import argparse
import itertools
import json
import os
import time

import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import (AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding,
                          get_linear_schedule_with_warmup)

GRID = {
    "lr": [1e-5, 2e-5, 3e-5, 5e-5],
    "weight_decay": [0.0, 0.01],
    "warmup_ratio": [0.0, 0.06],
}


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="bert-base-uncased")
    p.add_argument("--out", default="sweeps/mnli")
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--per-device-bs", type=int, default=32)
    p.add_argument("--max-epochs", type=int, default=3)
    p.add_argument("--eval-every", type=int, default=2000)
    p.add_argument("--patience", type=int, default=3)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def prepare_data(args, tokenizer, rank):
    def tok(batch):
        return tokenizer(batch["premise"], batch["hypothesis"], truncation=True, max_length=args.max_len)

    # rank 0 builds the Arrow cache first, the others then read it
    if rank != 0:
        dist.barrier()
    raw = load_dataset("glue", "mnli")
    enc = raw.map(tok, batched=True, remove_columns=["premise", "hypothesis", "idx"])
    if rank == 0:
        dist.barrier()
    enc = enc.rename_column("label", "labels")
    return enc["train"], enc["validation_matched"]


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        out = model(**batch)
        n = batch["labels"].numel()
        loss_sum += out.loss.item() * n
        correct += (out.logits.argmax(-1) == batch["labels"]).sum().item()
        count += n
    totals = torch.tensor([loss_sum, correct, count], dtype=torch.float64)
    dist.all_reduce(totals)
    model.train()
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def run_trial(name, hp, args, data, tokenizer, device, local_rank, rank):
    train_set, dev_set = data
    collate = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)
    tr_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    tr = DataLoader(train_set, args.per_device_bs, sampler=tr_sampler, collate_fn=collate, num_workers=4,
                    pin_memory=True, drop_last=True)
    # contiguous shard per rank, no padding, so the reduced dev metrics are exact
    dev_shard = dev_set.shard(num_shards=dist.get_world_size(), index=rank, contiguous=True)
    dv = DataLoader(dev_shard, 128, shuffle=False, collate_fn=collate, num_workers=4)

    torch.manual_seed(args.seed)
    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=3).to(device)
    model = DDP(model, device_ids=[local_rank])
    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)],
         "weight_decay": hp["weight_decay"]},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=hp["lr"])
    total = args.max_epochs * len(tr)
    sched = get_linear_schedule_with_warmup(opt, int(hp["warmup_ratio"] * total), total)

    trial_dir = os.path.join(args.out, name)
    best, bad, step, stop = float("inf"), 0, 0, False
    history = []
    for epoch in range(args.max_epochs):
        tr_sampler.set_epoch(epoch)
        for batch in tr:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % args.eval_every == 0:
                dev_loss, dev_acc = evaluate(model, dv, device)
                history.append({"step": step, "dev_loss": dev_loss, "dev_acc": dev_acc})
                if dev_loss < best:
                    best, bad = dev_loss, 0
                    if rank == 0:
                        model.module.save_pretrained(trial_dir)
                        tokenizer.save_pretrained(trial_dir)
                else:
                    bad += 1
                    stop = bad >= args.patience
                if stop:
                    break
        if stop:
            break

    del model, opt, sched
    torch.cuda.empty_cache()
    dist.barrier()
    return best, history


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    train_set, dev_set = prepare_data(args, tokenizer, rank)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    summary = []
    keys = list(GRID)
    for values in itertools.product(*(GRID[k] for k in keys)):
        hp = dict(zip(keys, values))
        name = "lr{lr:g}_wd{weight_decay:g}_wu{warmup_ratio:g}".format(**hp)
        t0 = time.time()
        best, history = run_trial(name, hp, args, (train_set, dev_set), tokenizer, device, local_rank, rank)
        if rank == 0:
            summary.append({"trial": name, **hp, "best_dev_loss": best, "history": history,
                            "minutes": round((time.time() - t0) / 60, 1)})
            with open(os.path.join(args.out, "summary.json"), "w") as f:
                json.dump(summary, f, indent=2)
            print(f"[{name}] best dev loss {best:.4f}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
