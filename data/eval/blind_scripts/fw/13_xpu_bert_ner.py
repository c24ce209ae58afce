#!/usr/bin/env python
"""BERT token classification (CoNLL-2003 NER) on Intel Data Center GPU Max, launched with Intel MPI.

    source /opt/intel/oneapi/setvars.sh
    source $(python -c "import oneccl_bindings_for_pytorch as t; print(t.cwd)")/env/setvars.sh
    export MASTER_ADDR=$(hostname) MASTER_PORT=29510
    mpirun -n 12 -ppn 12 -genv CCL_ZE_IPC_EXCHANGE=sockets python 13_xpu_bert_ner.py \
        --output_dir /home/$USER/ner/bert-base-conll03
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

import intel_extension_for_pytorch as ipex
import oneccl_bindings_for_pytorch  # noqa: F401  (provides the "ccl" process group backend)

import evaluate
from datasets import load_dataset
from transformers import AutoModelForTokenClassification, AutoTokenizer, DataCollatorForTokenClassification
from transformers import get_linear_schedule_with_warmup


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model_name", default="bert-base-cased")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--batch_size", type=int, default=16, help="per tile")
    p.add_argument("--lr", type=float, default=5e-5, help="lr at a global batch of 32")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--warmup_ratio", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=2024)
    return p.parse_args()


def init_distributed():
    # Intel MPI exports PMI_RANK / PMI_SIZE / MPI_LOCALRANKID; torchrun exports RANK etc.
    rank = int(os.environ.get("RANK", os.environ.get("PMI_RANK", 0)))
    world_size = int(os.environ.get("WORLD_SIZE", os.environ.get("PMI_SIZE", 1)))
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("MPI_LOCALRANKID", 0)))
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29510")

    torch.xpu.set_device(local_rank)
    dist.init_process_group(backend="ccl", init_method="env://", rank=rank, world_size=world_size)
    return rank, world_size, local_rank


def tokenize_and_align(tokenizer):
    def fn(examples):
        enc = tokenizer(examples["tokens"], truncation=True, is_split_into_words=True, max_length=256)
        all_labels = []
        for i, tags in enumerate(examples["ner_tags"]):
            word_ids = enc.word_ids(batch_index=i)
            prev, labels = None, []
            for w in word_ids:
                if w is None or w == prev:
                    labels.append(-100)  # special tokens and word-piece continuations
                else:
                    labels.append(tags[w])
                prev = w
            all_labels.append(labels)
        enc["labels"] = all_labels
        return enc
    return fn


@torch.no_grad()
def evaluate_ner(model, loader, device, id2label, seqeval):
    model.eval()
    preds, refs = [], []
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.xpu.amp.autocast(dtype=torch.bfloat16):
            logits = model(**batch).logits
        pred_ids = logits.argmax(-1).cpu().tolist()
        for p_row, l_row in zip(pred_ids, batch["labels"].cpu().tolist()):
            preds.append([id2label[p] for p, l in zip(p_row, l_row) if l != -100])
            refs.append([id2label[l] for l in l_row if l != -100])
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (preds, refs))
    model.train()
    all_preds = [s for part in gathered for s in part[0]]
    all_refs = [s for part in gathered for s in part[1]]
    res = seqeval.compute(predictions=all_preds, references=all_refs)
    return res["overall_f1"], res["overall_precision"], res["overall_recall"]


def main():
    args = parse_args()
    rank, world_size, local_rank = init_distributed()
    device = torch.device(f"xpu:{local_rank}")
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    if rank != 0:
        dist.barrier()  # wait until rank 0 has populated the datasets cache
    raw = load_dataset("conll2003")
    tokenized = raw.map(tokenize_and_align(tokenizer), batched=True, remove_columns=raw["train"].column_names)
    if rank == 0:
        dist.barrier()
    label_names = raw["train"].features["ner_tags"].feature.names
    id2label = dict(enumerate(label_names))

    collator = DataCollatorForTokenClassification(tokenizer, pad_to_multiple_of=8)
    sampler = DistributedSampler(tokenized["train"], num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=args.seed)
    train_loader = DataLoader(tokenized["train"], batch_size=args.batch_size, sampler=sampler,
                              collate_fn=collator, num_workers=2)
    val = tokenized["validation"]
    val_loader = DataLoader(Subset(val, range(rank, len(val), world_size)), batch_size=64, collate_fn=collator)

    model = AutoModelForTokenClassification.from_pretrained(
        args.model_name, num_labels=len(label_names), id2label=id2label,
        label2id={v: k for k, v in id2label.items()},
    ).to(device)
    lr = args.lr * math.sqrt(args.batch_size * world_size / 32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    model, optimizer = ipex.optimize(model, optimizer=optimizer, dtype=torch.bfloat16)
    model = DDP(model, device_ids=[device])

    total = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total), total)
    seqeval = evaluate.load("seqeval")

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"ranks={world_size} steps/epoch={len(train_loader)} global_batch={args.batch_size * world_size}",
              flush=True)

    best_f1 = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device) for k, v in batch.items()}
            with torch.xpu.amp.autocast(dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)

        f1, prec, rec = evaluate_ner(model.module, val_loader, device, id2label, seqeval)
        if rank == 0:
            print(f"epoch {epoch}: f1 {f1:.4f} p {prec:.4f} r {rec:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if f1 > best_f1:
                best_f1 = f1
                model.module.save_pretrained(args.output_dir)
                tokenizer.save_pretrained(args.output_dir)
        dist.barrier()

    if rank == 0:
        print(f"best dev F1 {best_f1:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
