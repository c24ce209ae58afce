#!/usr/bin/env python
"""
NCBI-disease NER with DeBERTa-v3-large.
Gradient accumulation with DDP no_sync, activation checkpointing, early stopping on dev F1.

    torchrun --nproc_per_node=4 14_ner_ncbi_deberta_accum.py --out runs/ncbi-debv3l --accum 4
"""
import argparse
import contextlib
import logging
import math
import os

import torch
import torch.distributed as dist
from datasets import load_dataset
from seqeval.metrics import f1_score, precision_score, recall_score
from seqeval.scheme import IOB2
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForTokenClassification, AutoTokenizer, DataCollatorForTokenClassification, get_linear_schedule_with_warmup

logger = logging.getLogger("ncbi")


def options():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="microsoft/deberta-v3-large")
    ap.add_argument("--out", required=True)
    ap.add_argument("--micro_bs", type=int, default=8)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--patience", type=int, default=3)
    ap.add_argument("--warmup", type=float, default=0.1)
    ap.add_argument("--max_len", type=int, default=320)
    ap.add_argument("--seed", type=int, default=2024)
    return ap.parse_args()


def tokenize(batch, tok, max_len):
    enc = tok(batch["tokens"], is_split_into_words=True, truncation=True, max_length=max_len)
    enc["labels"] = []
    for i, tags in enumerate(batch["ner_tags"]):
        prev, lab = None, []
        for w in enc.word_ids(i):
            lab.append(-100 if (w is None or w == prev) else tags[w])
            prev = w
        enc["labels"].append(lab)
    return enc


@torch.no_grad()
def evaluate(model, loader, names, device):
    model.eval()
    out = []
    for batch in loader:
        ids = batch.pop("ex_id").tolist()
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(**batch).logits
        pred, gold = logits.argmax(-1).cpu(), batch["labels"].cpu()
        for i, p, g in zip(ids, pred, gold):
            m = g != -100
            out.append((i, [names[x] for x in p[m].tolist()], [names[x] for x in g[m].tolist()]))
    world = [None] * dist.get_world_size()
    dist.all_gather_object(world, out)
    model.train()
    merged = dict((i, (p, g)) for part in world for i, p, g in part)
    keys = sorted(merged)
    yp, yt = [merged[k][0] for k in keys], [merged[k][1] for k in keys]
    kw = dict(mode="strict", scheme=IOB2)
    return precision_score(yt, yp, **kw), recall_score(yt, yp, **kw), f1_score(yt, yp, **kw)


def main():
    args = options()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    torch.manual_seed(args.seed)

    ds = load_dataset("ncbi_disease")
    names = ds["train"].features["ner_tags"].feature.names
    tok = AutoTokenizer.from_pretrained(args.model)

    if rank != 0:
        dist.barrier()  # wait for rank 0 to populate the datasets cache
    ds = ds.map(tokenize, batched=True, fn_kwargs={"tok": tok, "max_len": args.max_len},
                remove_columns=ds["train"].column_names)
    if rank == 0:
        dist.barrier()

    train = ds["train"]
    dev = ds["validation"].add_column("ex_id", list(range(len(ds["validation"]))))
    test = ds["test"].add_column("ex_id", list(range(len(ds["test"]))))

    collate = DataCollatorForTokenClassification(tok, pad_to_multiple_of=8)
    sampler = DistributedSampler(train, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train, batch_size=args.micro_bs, sampler=sampler, collate_fn=collate,
                          num_workers=2, pin_memory=True)
    dev_dl = DataLoader(dev, batch_size=32, sampler=DistributedSampler(dev, shuffle=False), collate_fn=collate)
    test_dl = DataLoader(test, batch_size=32, sampler=DistributedSampler(test, shuffle=False), collate_fn=collate)

    model = AutoModelForTokenClassification.from_pretrained(
        args.model, num_labels=len(names), id2label=dict(enumerate(names)), label2id={n: i for i, n in enumerate(names)}
    )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    updates_per_epoch = math.ceil(len(train_dl) / args.accum)
    total_updates = updates_per_epoch * args.epochs
    sched = get_linear_schedule_with_warmup(opt, int(args.warmup * total_updates), total_updates)
    logger.info("global batch = %d x %d x %d = %d; %d optimizer updates",
                world_size, args.micro_bs, args.accum, world_size * args.micro_bs * args.accum, total_updates)

    best, bad = -1.0, 0
    best_dir = os.path.join(args.out, "best")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        opt.zero_grad(set_to_none=True)
        for step, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            boundary = (step + 1) % args.accum == 0 or (step + 1) == len(train_dl)
            # skip the gradient all-reduce on micro-batches that are only accumulated
            ctx = contextlib.nullcontext() if boundary else model.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(**batch).loss / args.accum
                loss.backward()
            if boundary:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            if step % 200 == 0:
                logger.info("epoch %d step %d/%d loss %.4f", epoch, step, len(train_dl), loss.item() * args.accum)

        p, r, f = evaluate(model, dev_dl, names, device)
        logger.info("epoch %d dev P %.4f R %.4f F1 %.4f", epoch, p, r, f)

        # rank 0 decides, everyone follows, so all ranks leave the loop together
        decision = [None]
        if rank == 0:
            if f > best:
                best, bad = f, 0
                model.module.save_pretrained(best_dir)
                tok.save_pretrained(best_dir)
            else:
                bad += 1
            decision[0] = bad >= args.patience
        dist.broadcast_object_list(decision, src=0)
        if decision[0]:
            logger.info("early stopping after epoch %d (best dev F1 %.4f)", epoch, best)
            break

    dist.barrier()
    # reload the best weights on every rank for the test pass
    best_model = AutoModelForTokenClassification.from_pretrained(best_dir).to(device)
    model.module.load_state_dict(best_model.state_dict())
    del best_model
    p, r, f = evaluate(model, test_dl, names, device)
    logger.info("test P %.4f R %.4f F1 %.4f", p, r, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
