"""
Multi-task fine-tuning of one encoder with a head per task, every task streamed from its
own set of jsonl shards (Hugging Face datasets, streaming=True).

Each micro-batch comes from a single task, drawn from a schedule that is identical on all
ranks (seeded by the step), so in any backward pass the heads of the other tasks get no
gradient - hence find_unused_parameters=True.

    torchrun --nproc_per_node=8 14_multitask_streams_stateful.py --out /shared/mt/deberta_mt --resume
"""
import argparse
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from datasets import load_dataset
from datasets.distributed import split_dataset_by_node
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader
from transformers import AutoModel, AutoTokenizer, DataCollatorWithPadding

TASKS = {
    # name: (train glob, val glob, num_labels, text fields, sampling weight)
    "nli": ("/data/mt/nli/train-*.jsonl", "/data/mt/nli/val-*.jsonl", 3, ("premise", "hypothesis"), 0.5),
    "sentiment": ("/data/mt/sst/train-*.jsonl", "/data/mt/sst/val-*.jsonl", 2, ("text", None), 0.3),
    "topic": ("/data/mt/topic/train-*.jsonl", "/data/mt/topic/val-*.jsonl", 20, ("text", None), 0.2),
}


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--encoder", default="microsoft/deberta-v3-base")
    ap.add_argument("--out", required=True)
    ap.add_argument("--micro_bs", type=int, default=16)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--steps", type=int, default=30_000)
    ap.add_argument("--eval_every", type=int, default=2_000)
    ap.add_argument("--eval_batches", type=int, default=50)
    ap.add_argument("--max_len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--resume", action="store_true")
    return ap.parse_args()


class MultiTaskModel(nn.Module):
    def __init__(self, encoder_name):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(encoder_name)
        h = self.encoder.config.hidden_size
        self.heads = nn.ModuleDict({t: nn.Sequential(nn.Dropout(0.1), nn.Linear(h, spec[2]))
                                    for t, spec in TASKS.items()})

    def forward(self, task, input_ids, attention_mask):
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.heads[task](hidden[:, 0])


def task_stream(task, pattern, tok, args, rank, world_size, train):
    ds = load_dataset("json", data_files=pattern, split="train", streaming=True)
    if train:
        ds = ds.shuffle(seed=args.seed, buffer_size=20_000)
    ds = split_dataset_by_node(ds, rank=rank, world_size=world_size)
    a, b = TASKS[task][3]

    def enc(ex):
        return tok(ex[a], ex[b] if b else None, truncation=True, max_length=args.max_len)

    ds = ds.map(enc, remove_columns=[f for f in (a, b) if f])
    return ds.select_columns(["input_ids", "attention_mask", "label"])


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.encoder)
    collate = DataCollatorWithPadding(tok, pad_to_multiple_of=8)
    train_ds, loaders, val_loaders = {}, {}, {}
    for t, (tr, va, _, _, _) in TASKS.items():
        train_ds[t] = task_stream(t, tr, tok, args, rank, world_size, train=True)
        loaders[t] = StatefulDataLoader(train_ds[t], batch_size=args.micro_bs, collate_fn=collate,
                                        num_workers=2, pin_memory=True)
        val_loaders[t] = DataLoader(task_stream(t, va, tok, args, rank, world_size, train=False),
                                    batch_size=64, collate_fn=collate, num_workers=1)

    model = MultiTaskModel(args.encoder).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 1000) * max(0.0, 1 - s / args.steps))

    step, epochs = 0, {t: 0 for t in TASKS}
    if args.resume and os.path.exists(os.path.join(args.out, "model.pt")):
        ck = torch.load(os.path.join(args.out, "model.pt"), map_location="cpu")
        assert ck["world_size"] == world_size, "resume needs the same number of ranks (per-rank data state)"
        model.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["sched"])
        step = ck["step"]
        mine = torch.load(os.path.join(args.out, f"data_rank{rank:03d}.pt"))
        for t in TASKS:
            loaders[t].load_state_dict(mine["loaders"][t])
        epochs = mine["epochs"]

    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    loss_fn = nn.CrossEntropyLoss()
    for t in TASKS:
        train_ds[t].set_epoch(epochs[t])
    iters = {t: iter(loaders[t]) for t in TASKS}

    def next_batch(t):
        try:
            return next(iters[t])
        except StopIteration:
            # this rank's share of the task ran out: start its next pass locally
            epochs[t] += 1
            train_ds[t].set_epoch(epochs[t])
            iters[t] = iter(loaders[t])
            return next(iters[t])

    names = list(TASKS)
    weights = [TASKS[t][4] for t in names]
    model.train()
    t0 = time.time()
    while step < args.steps:
        sched_rng = random.Random(args.seed * 1_000_003 + step)  # same draw on every rank
        log = torch.zeros(2, device=device)
        for m in range(args.accum):
            task = sched_rng.choices(names, weights)[0]
            batch = {k: v.to(device, non_blocking=True) for k, v in next_batch(task).items()}
            labels = batch.pop("labels")
            sync = m == args.accum - 1
            with (torch.enable_grad() if sync else model.no_sync()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(task, **batch)
                loss = loss_fn(logits.float(), labels) / args.accum
                loss.backward()
            log += torch.stack([loss.detach(), torch.ones((), device=device)])
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        sched.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1

        if step % 50 == 0:
            dist.all_reduce(log)
            if rank == 0:
                print(f"step {step} loss {(log[0] * args.accum / log[1]).item():.4f} "
                      f"{(time.time() - t0) / 50:.2f}s/step epochs {epochs}", flush=True)
                t0 = time.time()

        if step % args.eval_every == 0 or step == args.steps:
            model.eval()
            accs = {}
            with torch.no_grad():
                for t in names:
                    c = torch.zeros(2, device=device)
                    for i, vb in enumerate(val_loaders[t]):
                        if i >= args.eval_batches:
                            break
                        vb = {k: v.to(device) for k, v in vb.items()}
                        y = vb.pop("labels")
                        c += torch.stack([(model.module(t, **vb).argmax(-1) == y).sum().float(),
                                          torch.tensor(float(y.numel()), device=device)])
                    dist.all_reduce(c)
                    accs[t] = (c[0] / c[1].clamp(min=1)).item()
            model.train()

            os.makedirs(args.out, exist_ok=True)
            torch.save({"loaders": {t: loaders[t].state_dict() for t in TASKS}, "epochs": epochs},
                       os.path.join(args.out, f"data_rank{rank:03d}.pt"))
            if rank == 0:
                print(f"step {step} val acc {accs}")
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "sched": sched.state_dict(), "step": step, "world_size": world_size},
                           os.path.join(args.out, "model.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
