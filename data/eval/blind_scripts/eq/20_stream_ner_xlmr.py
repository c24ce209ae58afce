"""
Multilingual NER (xlm-roberta-large) trained on a streamed, sharded silver-label corpus.

Shards: /data/ner_silver/{train,dev}/part-*.jsonl.gz, lines: {"tokens": [...], "ner_tags": [...]}

    torchrun --nproc_per_node=8 20_stream_ner_xlmr.py --max_steps 40000 --out /shared/ner/xlmr_l
"""
import argparse
import glob
import os
import time
from functools import partial

import torch
import torch.distributed as dist
from datasets import load_dataset
from datasets.distributed import split_dataset_by_node
from seqeval.metrics import f1_score, precision_score, recall_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.tensorboard import SummaryWriter
from transformers import (AutoModelForTokenClassification, AutoTokenizer, DataCollatorForTokenClassification,
                          get_linear_schedule_with_warmup)

LABELS = ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC"]


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/ner_silver")
    ap.add_argument("--model", default="xlm-roberta-large")
    ap.add_argument("--out", required=True)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--max_steps", type=int, default=40_000)
    ap.add_argument("--warmup", type=int, default=2_000)
    ap.add_argument("--eval_every", type=int, default=2_000)
    ap.add_argument("--max_len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=7)
    return ap.parse_args()


def tokenize_and_align(batch, tok, max_len):
    enc = tok(batch["tokens"], is_split_into_words=True, truncation=True, max_length=max_len)
    all_labels = []
    for i, tags in enumerate(batch["ner_tags"]):
        prev, labels = None, []
        for w in enc.word_ids(batch_index=i):
            labels.append(-100 if w is None or w == prev else tags[w])
            prev = w
        all_labels.append(labels)
    enc["labels"] = all_labels
    return enc


def make_stream(files, tok, args, rank, world, shuffle):
    ds = load_dataset("json", data_files=files, split="train", streaming=True)
    if shuffle:
        ds = ds.shuffle(seed=args.seed, buffer_size=50_000)
    ds = split_dataset_by_node(ds, rank=rank, world_size=world)
    ds = ds.map(partial(tokenize_and_align, tok=tok, max_len=args.max_len), batched=True,
                remove_columns=["tokens", "ner_tags"])
    return ds


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    y_true, y_pred = [], []
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        preds = logits.argmax(-1).cpu().tolist()
        golds = batch["labels"].cpu().tolist()
        for p_seq, g_seq in zip(preds, golds):
            y_true.append([LABELS[g] for g in g_seq if g != -100])
            y_pred.append([LABELS[p] for p, g in zip(p_seq, g_seq) if g != -100])
    model.train()
    return {"precision": precision_score(y_true, y_pred), "recall": recall_score(y_true, y_pred),
            "f1": f1_score(y_true, y_pred)}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    collator = DataCollatorForTokenClassification(tok, pad_to_multiple_of=8)
    train_files = sorted(glob.glob(os.path.join(args.data, "train", "part-*.jsonl.gz")))
    dev_files = sorted(glob.glob(os.path.join(args.data, "dev", "part-*.jsonl.gz")))
    train_ds = make_stream(train_files, tok, args, rank, world, shuffle=True)
    dev_ds = make_stream(dev_files, tok, args, rank, world, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.bs, collate_fn=collator, num_workers=4, pin_memory=True)
    dev_dl = DataLoader(dev_ds, batch_size=64, collate_fn=collator, num_workers=2)

    model = AutoModelForTokenClassification.from_pretrained(
        args.model, num_labels=len(LABELS), id2label=dict(enumerate(LABELS)),
        label2id={l: i for i, l in enumerate(LABELS)}).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = get_linear_schedule_with_warmup(opt, args.warmup, args.max_steps)

    writer = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None

    def train_batches():
        epoch = 0
        while True:
            train_ds.set_epoch(epoch)
            for b in train_dl:
                yield b
            epoch += 1

    batches = train_batches()
    best_f1 = -1.0
    model.train()
    t0 = time.time()
    for step in range(1, args.max_steps + 1):
        batch = {k: v.to(device, non_blocking=True) for k, v in next(batches).items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)

        if step % 100 == 0:
            l = loss.detach().float()
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            if rank == 0:
                writer.add_scalar("train/loss", l.item(), step)
                writer.add_scalar("train/lr", sched.get_last_lr()[0], step)
                print(f"step {step} loss {l.item():.4f} {(time.time() - t0) / 100:.2f}s/it", flush=True)
                t0 = time.time()

        if step % args.eval_every == 0 or step == args.max_steps:
            metrics = evaluate(model.module, dev_dl, device)
            if rank == 0:
                for k, v in metrics.items():
                    writer.add_scalar(f"dev/{k}", v, step)
                print(f"step {step} dev {metrics}")
                if metrics["f1"] > best_f1:
                    best_f1 = metrics["f1"]
                    model.module.save_pretrained(os.path.join(args.out, "best"))
                    tok.save_pretrained(os.path.join(args.out, "best"))
            dist.barrier()

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.out, "last"))
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
