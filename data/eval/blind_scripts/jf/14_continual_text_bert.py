"""Lifelong text classification (AGNews -> Yelp -> Amazon -> DBPedia -> Yahoo)
with sparse experience replay, BERT-base, multi-GPU.

Data: the CSV splits of Zhang et al. (2015) as used by MbPA++ / LAMOL, under
<data-dir>/<name>_csv/{train,test}.csv. Labels of the five tasks are merged
into one 33-way output space (Yelp and Amazon share their 5 rating classes).

    torchrun --nproc_per_node=4 14_continual_text_bert.py --data-dir /data/lll_text --wandb-project lll
"""
import argparse
import os
import random
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

TASKS = ["ag_news", "yelp_review_full", "amazon_review_full", "dbpedia", "yahoo_answers"]
N_LABELS = {"ag_news": 4, "yelp_review_full": 5, "amazon_review_full": 5, "dbpedia": 14, "yahoo_answers": 10}
OFFSET = {"ag_news": 0, "yelp_review_full": 4, "amazon_review_full": 4, "dbpedia": 9, "yahoo_answers": 23}


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", default="/data/lll_text")
    p.add_argument("--output-dir", default="outputs/lll_bert")
    p.add_argument("--model", default="bert-base-uncased")
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--train-per-task", type=int, default=115000)
    p.add_argument("--test-per-task", type=int, default=7600)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--warmup-ratio", type=float, default=0.06)
    p.add_argument("--replay-rate", type=float, default=0.01, help="fraction of each task stored")
    p.add_argument("--replay-every", type=int, default=100, help="replay one batch every N steps")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--wandb-project", default="lifelong-text")
    return p.parse_args()


class TextTask(Dataset):
    def __init__(self, df, tokenizer, max_len, offset):
        text = (df[1].fillna("").astype(str) + " " + df[df.columns[-1]].fillna("").astype(str)).tolist() \
            if df.shape[1] > 2 else df[1].astype(str).tolist()
        self.enc = tokenizer(text, truncation=True, max_length=max_len, padding="max_length",
                             return_tensors="pt")
        self.labels = torch.tensor(df[0].values - 1 + offset, dtype=torch.long)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.enc["input_ids"][i], self.enc["attention_mask"][i], self.labels[i]


def load_task(args, name, split, n, tokenizer):
    df = pd.read_csv(os.path.join(args.data_dir, f"{name}_csv", f"{split}.csv"), header=None)
    df = df.sample(n=min(n, len(df)), random_state=args.seed).reset_index(drop=True)
    return TextTask(df, tokenizer, args.max_len, OFFSET[name])


@torch.no_grad()
def evaluate(model, ds, device, rank, world):
    model.eval()
    shard = Subset(ds, range(rank, len(ds), world))
    stat = torch.zeros(2, device=device)
    for ids, mask, y in DataLoader(shard, batch_size=128):
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
        stat[0] += (logits.argmax(-1) == y.to(device)).sum()
        stat[1] += y.numel()
    dist.all_reduce(stat)
    model.train()
    return (stat[0] / stat[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    run = wandb.init(project=args.wandb_project, config=vars(args),
                     name=f"er-bert-{time.strftime('%m%d-%H%M')}")

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    hf_model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=33).to(device)
    model = DDP(hf_model, device_ids=[local_rank])
    per_device = args.global_batch // world
    amp_dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    scaler = torch.cuda.amp.GradScaler(enabled=amp_dtype == torch.float16)

    test_sets = [load_task(args, n, "test", args.test_per_task, tokenizer) for n in TASKS]
    memory = []  # list of (ids, mask, label) batches kept on CPU
    acc = np.zeros((len(TASKS), len(TASKS)))
    global_step = 0

    for t, name in enumerate(TASKS):
        train_ds = load_task(args, name, "train", args.train_per_task, tokenizer)
        sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
        loader = DataLoader(train_ds, batch_size=per_device, sampler=sampler, num_workers=2,
                            pin_memory=True, drop_last=True)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
        n_steps = len(loader)
        sched = get_linear_schedule_with_warmup(opt, int(args.warmup_ratio * n_steps), n_steps)
        store_every = max(int(1 / args.replay_rate), 1)
        sampler.set_epoch(0)  # single pass over every task
        tic = time.time()

        for step, (ids, mask, y) in enumerate(loader):
            batches = [(ids, mask, y)]
            if t > 0 and step % args.replay_every == 0:
                batches.append(memory[random.randrange(len(memory))])
            for b_ids, b_mask, b_y in batches:
                with torch.autocast("cuda", dtype=amp_dtype):
                    out = model(input_ids=b_ids.to(device, non_blocking=True),
                                attention_mask=b_mask.to(device, non_blocking=True))
                    loss = F.cross_entropy(out.logits.float(), b_y.to(device, non_blocking=True))
                opt.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
            sched.step()
            if step % store_every == 0:
                memory.append((ids.clone(), mask.clone(), y.clone()))
            global_step += 1
            if rank == 0 and step % 200 == 0:
                wandb.log({"train/loss": loss.item(), "train/lr": sched.get_last_lr()[0], "task": t,
                           "memory_batches": len(memory)}, step=global_step)
                print(f"[{name}] step {step}/{n_steps} loss {loss.item():.4f} "
                      f"({(time.time() - tic) / (step + 1):.3f}s/it)", flush=True)

        for j in range(t + 1):
            acc[t, j] = evaluate(hf_model, test_sets[j], device, rank, world)
        if rank == 0:
            row = {f"acc/{TASKS[j]}": acc[t, j] for j in range(t + 1)}
            row["acc/avg_seen"] = acc[t, :t + 1].mean()
            wandb.log(row, step=global_step)
            print(f"after {name}: " + ", ".join(f"{TASKS[j]}={acc[t, j]:.4f}" for j in range(t + 1)), flush=True)
            save_dir = os.path.join(args.output_dir, f"after_{t}_{name}")
            hf_model.save_pretrained(save_dir)
            tokenizer.save_pretrained(save_dir)
        dist.barrier()

    if rank == 0:
        wandb.log({"final/avg_acc": acc[-1].mean()})
        np.save(os.path.join(args.output_dir, "acc_matrix.npy"), acc)
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
