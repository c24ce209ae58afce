"""LayoutLM (v1) on FUNSD with token-budget batching.

Pages have between a few dozen and ~500 OCR tokens. Instead of a fixed batch size every
batch holds up to --max_tokens (padded) tokens, so each rank ends up with a different
number of batches per epoch; DDP's Join context shadows the missing all-reduces.

    torchrun --nproc_per_node=4 09_funsd_layoutlm_bucketed.py --max_tokens 4096
"""
import argparse
import math
import os
import random

import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pad_sequence
from transformers import LayoutLMForTokenClassification, LayoutLMTokenizerFast


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="microsoft/layoutlm-base-uncased")
    p.add_argument("--max_tokens", type=int, default=4096)
    p.add_argument("--max_len", type=int, default=512)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/funsd_layoutlm")
    return p.parse_args()


def encode(example, tokenizer, max_len):
    enc = tokenizer(example["tokens"], is_split_into_words=True, truncation=True, max_length=max_len)
    boxes, labels, prev = [], [], None
    for wid in enc.word_ids():
        if wid is None:
            boxes.append([0, 0, 0, 0])
            labels.append(-100)
        else:
            boxes.append(example["bboxes"][wid])
            labels.append(example["ner_tags"][wid] if wid != prev else -100)
        prev = wid
    return {"input_ids": enc["input_ids"], "bbox": boxes, "labels": labels}


def rank_batches(lengths, rank, world, max_tokens, epoch, seed, shuffle=True):
    """Same permutation on every rank, then each rank packs its own slice by length."""
    idx = list(range(len(lengths)))
    if shuffle:
        random.Random(seed + epoch).shuffle(idx)
    mine = sorted(idx[rank::world], key=lambda i: lengths[i])
    batches, cur, cur_max = [], [], 0
    for i in mine:
        new_max = max(cur_max, lengths[i])
        if cur and new_max * (len(cur) + 1) > max_tokens:
            batches.append(cur)
            cur, new_max = [], lengths[i]
        cur.append(i)
        cur_max = new_max
    if cur:
        batches.append(cur)
    if shuffle:
        random.Random(seed + epoch + 1000 * rank).shuffle(batches)
    return batches


def collate(rows, pad_id, device):
    ids = pad_sequence([torch.tensor(r["input_ids"]) for r in rows], batch_first=True, padding_value=pad_id)
    bbox = pad_sequence([torch.tensor(r["bbox"]) for r in rows], batch_first=True, padding_value=0)
    labels = pad_sequence([torch.tensor(r["labels"]) for r in rows], batch_first=True, padding_value=-100)
    mask = (ids != pad_id).long()
    return {k: v.to(device, non_blocking=True) for k, v in
            dict(input_ids=ids, bbox=bbox, attention_mask=mask, labels=labels).items()}


def spans(tags, names):
    out, start, typ = set(), None, None
    for i, t in enumerate(list(tags) + [0]):
        name = names[t]
        if name.startswith("B-") or name == "O" or (name.startswith("I-") and name[2:] != typ):
            if typ is not None:
                out.add((start, i, typ))
            start, typ = (i, name[2:]) if name != "O" else (None, None)
    return out


@torch.no_grad()
def entity_counts(model, data, batches, names, pad_id, device):
    model.eval()
    counts = torch.zeros(3, dtype=torch.long, device=device)  # tp, fp, fn
    for b in batches:
        batch = collate([data[i] for i in b], pad_id, device)
        pred = model(**{k: v for k, v in batch.items() if k != "labels"}).logits.argmax(-1)
        for p_row, l_row in zip(pred.tolist(), batch["labels"].tolist()):
            keep = [(p, l) for p, l in zip(p_row, l_row) if l != -100]
            gold = spans([l for _, l in keep], names)
            hyp = spans([p for p, _ in keep], names)
            counts[0] += len(gold & hyp)
            counts[1] += len(hyp - gold)
            counts[2] += len(gold - hyp)
    model.train()
    return counts


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tokenizer = LayoutLMTokenizerFast.from_pretrained(args.model)
    raw = load_dataset("nielsr/funsd")
    names = raw["train"].features["ner_tags"].feature.names
    train = [encode(ex, tokenizer, args.max_len) for ex in raw["train"]]
    test = [encode(ex, tokenizer, args.max_len) for ex in raw["test"]]
    train_len = [len(r["input_ids"]) for r in train]
    test_len = [len(r["input_ids"]) for r in test]
    test_batches = rank_batches(test_len, rank, world, args.max_tokens, 0, args.seed, shuffle=False)

    model = LayoutLMForTokenClassification.from_pretrained(args.model, num_labels=len(names)).to(device)
    # LayoutLMModel always runs its pooler, which token classification never uses: freeze it
    for p in model.layoutlm.pooler.parameters():
        p.requires_grad_(False)
    model = DDP(model, device_ids=[local_rank])
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.01)
    approx_steps = args.epochs * math.ceil(sum(train_len) / args.max_tokens / world)
    warmup = max(1, approx_steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: min(1.0, (s + 1) / warmup) * max(0.02, 1.0 - s / approx_steps))

    best = 0.0
    for epoch in range(args.epochs):
        batches = rank_batches(train_len, rank, world, args.max_tokens, epoch, args.seed)
        model.train()
        with Join([model]):
            for b in batches:
                batch = collate([train[i] for i in b], tokenizer.pad_token_id, device)
                loss = model(**batch).loss
                optim.zero_grad(set_to_none=True)
                loss.backward()
                optim.step()
                sched.step()

        counts = entity_counts(model.module, test, test_batches, names, tokenizer.pad_token_id, device)
        dist.all_reduce(counts)
        tp, fp, fn = counts.tolist()
        prec = tp / max(tp + fp, 1)
        rec = tp / max(tp + fn, 1)
        f1 = 2 * prec * rec / max(prec + rec, 1e-9)
        if rank == 0:
            print(f"epoch {epoch:3d} batches(rank0)={len(batches)} loss={loss.item():.4f} "
                  f"P={prec:.4f} R={rec:.4f} F1={f1:.4f}", flush=True)
            if f1 > best:
                best = f1
                model.module.save_pretrained(args.out)
                tokenizer.save_pretrained(args.out)

    if rank == 0:
        print(f"best entity F1 {best:.4f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
